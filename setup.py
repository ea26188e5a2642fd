"""codegen: stream-parallel host programs for PyTorch, generated as C++ and JIT-built."""

from pathlib import Path

from setuptools import setup

# The version and the torch requirement live in codegen/version.py (read, not imported:
# importing codegen needs torch).
VERSION: dict[str, object] = {}
exec((Path(__file__).parent / "codegen" / "version.py").read_text(), VERSION)

setup(
    # The distribution's name; the import name is `codegen` ("codegen" on the package index
    # is an unrelated project).
    name="codegen-streams",
    version=VERSION["__version__"],
    description="Compile stream-parallel matmul schedules into C++ torch ops calling cuBLAS",
    python_requires=">=3.10",
    # One package per stage of the pipeline (docs/architecture.md).
    packages=["codegen", "codegen.frontend", "codegen.hostir", "codegen.distributed",
              "codegen.transforms", "codegen.runtime", "codegen.interp", "codegen.backend",
              "codegen.jit", "codegen.nn", "codegen.tools"],
    # The templates and the C++ runtime headers ship with the renderer that uses them:
    # every generated program includes the headers.
    package_data={"codegen.backend": ["templates/*.j2", "include/codegen/*.h"]},
    install_requires=[f"torch>={VERSION['TORCH_REQUIRED']}", "jinja2>=3.0", "ninja"],
    extras_require={
        # ruff exactly: tests/test_lint.py runs it, and a new release's rules could fail
        # that test with no change here.
        "test": ["pytest>=7", "ruff==0.17.6", "matplotlib", "transformers>=4.40"],
        "offload": ["transformers>=4.40", "accelerate"],
        "plot": ["matplotlib"],
    },
)
