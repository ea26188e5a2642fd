"""What installing and importing codegen promises: one version for the package and its
distribution, and a clear refusal of a torch too old for the C++ it generates."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import codegen
from codegen import version

REPO = Path(__file__).resolve().parent.parent


def test_the_version_is_the_distributions():
    run = subprocess.run([sys.executable, "setup.py", "--version"], capture_output=True,
                         text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == codegen.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", codegen.__version__)


def test_setup_requires_the_torch_the_import_checks():
    setup = (REPO / "setup.py").read_text()
    assert "torch>={VERSION['TORCH_REQUIRED']}" in setup
    assert version.TORCH_REQUIRED == "2.10"


@pytest.mark.parametrize("found", ["2.10.0", "2.10.0a0+git1234", "2.14.1+cu130", "3.0.0"])
def test_a_recent_torch_is_accepted(found):
    version.check_torch(found, "/site-packages/torch")


@pytest.mark.parametrize("found", ["2.9.1", "2.4.0+cu121", "1.13.1", "nightly"])
def test_an_old_torch_is_refused_saying_what_and_where(found):
    with pytest.raises(ImportError) as e:
        version.check_torch(found, "/site-packages/torch/__init__.py")
    said = str(e.value)
    assert f"found torch {found} at /site-packages/torch/__init__.py" in said
    assert "codegen needs torch >= 2.10" in said and "pip install 'torch>=2.10'" in said


def test_import_codegen_refuses_an_old_torch():
    # torch's version as an older install reports it, before codegen looks at it
    code = "import torch; torch.__version__ = '2.9.1'; import codegen"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: codegen needs torch >= 2.10"), run.stderr
    assert "found torch 2.9.1 at " in last


def test_import_codegen_gives_codegen_nn():
    code = "import codegen; print(codegen.nn.offload.__module__, codegen.nn.report.__name__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["codegen.nn.offload", "report"]
