"""The interpreters of host IR: the evaluator (torch ops, node by node) and the
stream-order checker built on it (``races``)."""
