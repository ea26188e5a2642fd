"""What both executors of a host program consume at call time: the pick between a
program and its alternative (``dispatch``), the autograd bridge (``autograd``), and the
Python half of the C++ collectives (``collectives``)."""
