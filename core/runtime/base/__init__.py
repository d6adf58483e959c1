"""The floor the runtime stands on, importing nothing above it: the device (`device.py`), streams
and capture (`streams.py`), timers (`timing.py`), the cache folder (`cache.py`), packed
allocations (`regions.py`), the footprint by kind (`footprint.py`), output comparison
(`compare.py`) and the load-time settings (`settings.py`)."""
