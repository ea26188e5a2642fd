"""The frontend: the IR users write (``Fusion``, ``TensorView``, the ops) and what reads
a schedule. No CUDA, no host IR."""
