"""The checkout is lint-clean under the ruff that the test extra pins, run from this
interpreter's environment: a ruff elsewhere on PATH, or a newer release, may judge the
same code differently."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pinned_ruff() -> str:
    """The version of ruff that setup.py's test extra pins (``ruff==X.Y.Z``)."""
    setup = (REPO / "setup.py").read_text()
    test_extra = re.search(r'"test": \[([^\]]*)\]', setup)
    assert test_extra, "setup.py: no extras_require['test']"
    pin = re.search(r'"ruff==([^"]+)"', test_extra.group(1))
    assert pin, f"setup.py: the test extra must pin ruff (ruff==X.Y.Z), it has " \
                f"[{test_extra.group(1)}]"
    return pin.group(1)


def test_ruff_clean():
    try:
        installed = importlib.metadata.version("ruff")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"ruff is not installed in {sys.prefix} (pip install -e '.[test]')")
    assert installed == pinned_ruff(), (
        f"ruff {installed} is installed in {sys.prefix}; setup.py's test extra pins "
        f"{pinned_ruff()}: pip install -e '.[test]'")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
