"""Tools around the package: the bundled examples, the demo, the timeline and the command
line (``python -m codegen``)."""
