"""Choosing how a load runs on this GPU: the candidates and the tuning cache (`choices.py`), and the
search that builds and times them (`search.py`)."""
