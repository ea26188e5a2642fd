"""Building and loading: C++ source -> a loaded torch op (``CompiledOp``), through a cache
shared by processes."""
