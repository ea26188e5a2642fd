"""What a build says: INFO records of the ``codegen`` logger (what is built, one line more
for a long build, how long it took), on stderr while the application has configured no
logging, through its handlers once it has, and silenced like any library's."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import jit

REPO = Path(__file__).resolve().parent.parent
PLAIN_PROGRAM = 'extern "C" int {name}_probe() {{ return 1; }}\n'  # no headers: quick


@pytest.mark.build
def test_a_build_logs_what_it_builds_and_a_long_one_one_line_more(tmp_path, monkeypatch,
                                                                    caplog):
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit.extension, "PROGRESS_AFTER_S", 0.01)  # every build is a long one
    with caplog.at_level(logging.INFO, logger="codegen"):
        library = jit.extension.build_library("log_probe", PLAIN_PROGRAM.format(name="log"),
                                        full_torch=True)
    records = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert records[0] == ("codegen.jit", "INFO", "building log_probe ...")
    assert records[1] == ("codegen.jit", "INFO", "still building log_probe after 0.01 s "
                          "(against torch's full C++ headers, once per cache and torch) ...")
    name, level, built = records[2]
    assert (name, level) == ("codegen.jit", "INFO") and len(records) == 3
    assert built.startswith("built log_probe in ") and built.endswith(f" s ({library.parent})")


def test_a_quick_build_logs_no_progress_line(caplog):
    with caplog.at_level(logging.INFO, logger="codegen"), jit.extension._progress("quick", "why"):
        pass
    assert caplog.records == []


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)


def test_without_logging_configured_messages_go_to_stderr():
    run = _python("import logging, codegen\n"
                  "logging.getLogger('codegen.jit').info('building x ...')")
    assert run.returncode == 0 and run.stderr == "codegen: building x ...\n", run.stderr


def test_messages_are_silenced_by_the_codegen_loggers_level():
    run = _python("import logging, codegen\n"
                  "logging.getLogger('codegen').setLevel(logging.WARNING)\n"
                  "logging.getLogger('codegen.jit').info('building x ...')")
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_configured_logging_gets_each_message_once():
    run = _python("import logging, sys, codegen\n"
                  "logging.basicConfig(stream=sys.stdout, format='%(name)s %(message)s')\n"
                  "logging.getLogger('codegen.jit').info('building x ...')")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout == "codegen.jit building x ...\n"
