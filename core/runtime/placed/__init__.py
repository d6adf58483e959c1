"""One op into its planned buffer: each op resolved once (`placement.py`) with the substitute that
writes its buffer (`substitutes.py`), issued in order (`run.py`); the preflight on the meta device
(`preflight.py`), index bounds (`indices.py`) and the serial reference runner (`reference.py`)."""
