"""The bundled examples, at the path users and their tests know: ``codegen.examples``.

They live with the tools (``codegen/tools/examples.py``); this module is that one."""

import sys

from .tools import examples

sys.modules[__name__] = examples
