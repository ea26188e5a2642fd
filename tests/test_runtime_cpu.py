"""The parts of the C++ runtime that need no GPU, called through a small harness library
built against the runtime headers: torch's precision flags as the generated GEMMs read
them, and cuBLASLt's reduction schemes derived from them."""

import ctypes
import itertools

import pytest
import torch

from codegen.jit import build_library

pytestmark = pytest.mark.build  # every test here builds C++

HARNESS = r"""
#include "codegen/runtime.h"

#define EXPORT extern "C" __attribute__((visibility("default")))

// 0 and the flags in out[0..2] (tf32, fp16 reduction, bf16 reduction); 1 if it threw.
EXPORT int rtcheck_math_mode(int* out) {
  try {
    const codegen_rt::MathMode m = codegen_rt::math_mode("rtcheck");
    out[0] = m.tf32 ? 1 : 0;
    out[1] = static_cast<int>(m.fp16);
    out[2] = static_cast<int>(m.bf16);
    return 0;
  } catch (...) {
    return 1;
  }
}

EXPORT unsigned rtcheck_reduction_mask(int option) {
  return codegen_rt::reduction_scheme_mask(static_cast<codegen_rt::Reduction>(option));
}
"""


@pytest.fixture(scope="module")
def harness(cache_dir):
    lib = ctypes.CDLL(str(build_library("rtcheck_runtime_cpu", HARNESS)))
    lib.rtcheck_math_mode.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.rtcheck_reduction_mask.restype = ctypes.c_uint
    return lib


def _math_mode(harness) -> tuple[int, int, int]:
    out = (ctypes.c_int * 3)()
    assert harness.rtcheck_math_mode(out) == 0, "codegen_rt::math_mode threw"
    return tuple(out)


@pytest.fixture
def restore_flags():
    matmul = torch.backends.cuda.matmul
    legacy, new = torch.get_float32_matmul_precision(), matmul.fp32_precision
    fp16, bf16 = (matmul.allow_fp16_reduced_precision_reduction,
                  matmul.allow_bf16_reduced_precision_reduction)
    yield
    torch.set_float32_matmul_precision(legacy)
    matmul.fp32_precision = new
    matmul.allow_fp16_reduced_precision_reduction = fp16
    matmul.allow_bf16_reduced_precision_reduction = bf16


SETTINGS = {
    "allow_tf32=True": lambda m: setattr(m, "allow_tf32", True),
    "allow_tf32=False": lambda m: setattr(m, "allow_tf32", False),
    "precision high": lambda m: torch.set_float32_matmul_precision("high"),
    "precision highest": lambda m: torch.set_float32_matmul_precision("highest"),
    # The new API alone: torch's legacy getter allowTF32CuBLAS() throws here.
    "fp32_precision=tf32": lambda m: setattr(m, "fp32_precision", "tf32"),
    "fp32_precision=ieee": lambda m: setattr(m, "fp32_precision", "ieee"),
}


@pytest.mark.parametrize("first, then", list(itertools.product(SETTINGS, SETTINGS)))
def test_tf32_flag_is_read_as_torch_matmul_reads_it(harness, restore_flags, first, then):
    matmul = torch.backends.cuda.matmul
    SETTINGS[first](matmul)
    SETTINGS[then](matmul)
    # torch's CUDA matmul uses TF32 iff float32Precision(CUDA, MATMUL) == TF32.
    assert _math_mode(harness)[0] == int(matmul.fp32_precision == "tf32")


@pytest.mark.parametrize("flag, index", [("allow_fp16_reduced_precision_reduction", 1),
                                         ("allow_bf16_reduced_precision_reduction", 2)])
def test_reduction_option_is_read(harness, restore_flags, flag, index):
    matmul = torch.backends.cuda.matmul
    for value, option in [(True, 0), (False, 1), ((False, False), 2), ((False, True), 1)]:
        setattr(matmul, flag, value)
        assert _math_mode(harness)[index] == option, value


def test_reduction_schemes_are_torchs(harness):
    # ATen/cuda/CUDABlas.cpp (bgemm_internal_cublaslt): reduced precision allowed -> no
    # mask; disallowed -> COMPUTE_TYPE | NONE; split-K disallowed too -> NONE.
    none, inplace, compute_type, output_type = 0, 1, 2, 4
    assert harness.rtcheck_reduction_mask(0) == inplace | compute_type | output_type
    assert harness.rtcheck_reduction_mask(1) == compute_type | none
    assert harness.rtcheck_reduction_mask(2) == none
