import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None and not (REPO / ".venv/bin/ruff").exists(),
                    reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_clean():
    ruff = shutil.which("ruff") or str(REPO / ".venv/bin/ruff")
    run = subprocess.run([ruff, "check", str(REPO)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
