"""The C++ backend: the renderer (host program -> plain data -> Jinja templates), the
digest that names an op, the templates and the C++ runtime headers, shipped together."""
