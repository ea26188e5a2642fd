"""Build and render on the CPU: the op name and cache key cover what the C++ depends on,
a name rebuilt after a failed build, C++-hostile names (the C++ half), the library loaded
under the entry's lock."""

import fcntl
import re

import pytest
import torch

import codegen as cg
from codegen import jit
from codegen.backend.renderer import op_name
from codegen.examples import matmul_rows


def test_constraints_are_part_of_the_op_name():
    with cg.Fusion("tied") as f:
        a = cg.input([None, None])
        b = cg.input([None, None])
        out = cg.matmul(a, b)
        cg.output(out)
    program = cg.lower(f)
    assert program.constraints, "a @ b with free extents ties a's columns to b's rows"
    loose = program.replace(constraints=[])
    assert str(loose) == str(program)  # the dump does not show them...
    assert op_name(loose) != op_name(program)  # ...the name does
    assert "must have equal sizes" not in cg.render(loose)
    assert "must have equal sizes" in cg.render(program)


def test_gemm_sm_count_is_part_of_the_program():
    plain = cg.lower(matmul_rows(slices=2))
    capped = cg.lower(matmul_rows(slices=2), gemm_sm_count=100)
    assert op_name(plain) != op_name(capped)
    assert "[gemm_sm_count=100]" in str(capped)
    assert "/*sm_count=*/100" in cg.render(capped)


def test_gemm_library_is_part_of_the_program():
    plain = cg.lower(matmul_rows(slices=2))
    gemmex = cg.lower(matmul_rows(slices=2), gemm_library="cublas")
    assert op_name(plain) != op_name(gemmex)
    assert "gemm_library" not in str(plain) and "[gemm_library=cublas]" in str(gemmex)
    assert "/*cublaslt=*/true" in cg.render(plain)
    assert "/*cublaslt=*/false" in cg.render(gemmex)
    capped = cg.lower(matmul_rows(slices=2), gemm_sm_count=8)  # the default library: not shown
    assert str(capped).splitlines()[0].endswith("[gemm_sm_count=8]:")


@pytest.mark.parametrize(("args", "message"), [
    ({"gemm_library": "cutlass"},
     "gemm_library must be one of 'cublaslt', 'cublas', got 'cutlass'"),
    ({"gemm_library": "cublas", "gemm_sm_count": 8},
     "gemm_sm_count=8 needs gemm_library='cublaslt'"),
])
def test_bad_gemm_options_are_schedule_errors(args, message):
    with pytest.raises(cg.ScheduleError, match=re.escape(message)):
        cg.lower(matmul_rows(slices=2), **args)


@pytest.mark.build
def test_a_name_collision_in_one_process_is_an_error_not_a_stale_op(cache_dir):
    # Two programs whose 48-bit names collide reach build_library with one name and two
    # sources: the second must not get the first one's library.
    one = '#include "codegen/runtime.h"\nint collide_one() { return 1; }\n'
    two = '#include "codegen/runtime.h"\nint collide_two() { return 2; }\n'
    assert jit.extension.build_library("collide_000000000000", one).is_file()
    assert jit.extension.build_library("collide_000000000000", one).is_file()  # same: fine
    with pytest.raises(cg.BuildError, match="already loaded in this process for another"):
        jit.extension.build_library("collide_000000000000", two)


@pytest.mark.build
def test_a_name_builds_after_a_failed_build_in_the_same_process(cache_dir):
    with pytest.raises(cg.BuildError):
        jit.extension.build_library("retry_op", "int f() { return undefined_y; }\n")
    good = '#include "codegen/runtime.h"\nint retry_op_ok() { return 1; }\n'
    assert jit.extension.build_library("retry_op", good).is_file()


@pytest.mark.build
def test_the_library_is_loaded_under_the_entry_lock(cache_dir, monkeypatch):
    held = []
    real = torch.ops.load_library

    def probe(path: str) -> None:
        from pathlib import Path

        with open(Path(path).parent / "codegen.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
                fcntl.flock(f, fcntl.LOCK_UN)
            except BlockingIOError:
                held.append(True)
        real(path)

    monkeypatch.setattr(torch.ops, "load_library", probe)
    cg.compile(matmul_rows(slices=5, name="locked_load"))
    assert held == [True]


@pytest.mark.build
def test_cpp_words_and_generated_names_as_tensor_and_extent_names(cache_dir):
    with cg.Fusion("hostile") as f:
        a = cg.input(["i", "device"], name="op")
        b = cg.input(["device", "NULL"], name="and")
        c = cg.input(["NULL", "streams"], name="gemms")
        t = cg.matmul(a, b)
        out = cg.matmul(t, c)
        cg.output(out)
    out.outer_split(0, 2)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    compiled = cg.compile(f)
    source = compiled.source
    assert 'const rt::Buffer op_ = rt::input(op__arg, op, "op"' in source
    assert "(Tensor op_, Tensor and_, Tensor gemms_)" in source
    assert "const int64_t i_ = op_.size(0);" in source
    args = [torch.empty(s, device="meta") for s in ((5, 3), (3, 4), (4, 2))]
    assert compiled(*args).shape == (5, 2)
    with pytest.raises(ValueError, match="argument and axis 0 must have size device = 3"):
        compiled(torch.empty(5, 3, device="meta"), torch.empty(2, 4, device="meta"),
                 torch.empty(4, 2, device="meta"))


@pytest.mark.build
def test_programs_share_one_stream_pool_and_thread_lease(cache_dir):
    # Each program is a library with hidden symbols; the pool and the thread's lease are
    # GNU unique symbols (one object per process), named for the runtime headers' hash.
    import subprocess

    libraries = [cg.compile(matmul_rows(slices=s, name=f"shared_pool_{s}")).library
                 for s in (2, 3)]
    exported = []
    for library in libraries:
        symbols = subprocess.run(["readelf", "-sW", "--demangle", str(library)],
                                 capture_output=True, text=True, check=True).stdout
        unique = sorted({line.split()[-1] for line in symbols.splitlines()
                         if " UNIQUE " in line and ("lease_pool" in line or
                                                    "thread_lease" in line)})
        exported.append(unique)
    assert exported[0] == exported[1] and len(exported[0]) >= 2, exported
    tag = jit.compiler.toolchain().cflags
    abi = next(f for f in tag if f.startswith("-DCODEGEN_RT_ABI="))[len("-DCODEGEN_RT_ABI="):]
    assert all(abi in name for name in exported[0]), exported[0]
