"""Building one load-time candidate: what a choice is (`choice.py`), the load's buffers
(`buffers.py`), the issue order, streams and pairs a choice runs with (`order.py`), fresh kernels
for each candidate (`lower.py`), what a call may copy in (`inputs.py`), and issue and capture
(`capture.py`)."""
