"""prefixmesh services, each runnable as ``python -m services.<name>``."""
