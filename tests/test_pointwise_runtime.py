"""codegen/pointwise.h without a GPU: its kernel text compiles with NVRTC for every storage
type, arity and compute type; the header builds with the programs' toolchain and compiles
a kernel through NVRTC from C++; the kernels, compiled as host C++, run over many layouts
with the launch the host plans (test_pointwise_emulate.cpp); the activations match torch."""

import concurrent.futures
import ctypes
import functools
import itertools
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_copy import TESTS, cxx

from codegen.backend.renderer import include_dir
from codegen.jit import build_library

HEADER = include_dir() / "codegen" / "pointwise.h"
STORAGE = {"bf16": 2, "f16": 2, "float": 4, "double": 8}
# Storage types kernels only read (dequantize's q): float8_e4m3fn and int8.
QUANTIZED = {"f8e4m3": 1, "i8": 1}
# An expression per arity that uses every activation and both operators.
BODIES = {
    1: "relu(x0) + gelu_tanh(x0) * gelu(x0) + silu(x0)",
    2: "silu(x0) * x1",
    3: "gelu(x0) + x1 * relu(x2) + gelu_tanh(x1)",
    8: "silu(x0) * x1 + gelu(x2) * gelu_tanh(x3) + relu(x4) + x5 * x6 * x7",
}


def kernel_text(name: str) -> str:
    """A raw string of the header: kPointwisePrelude or kPointwiseEpilogue."""
    found = re.search(rf'{name}\[\] = R"cg\((.*?)\)cg";', HEADER.read_text(), re.S)
    assert found, f"{name} is not a raw string literal in {HEADER}"
    return found.group(1)


def generated_part(out: str, inputs: list[str], compute: str, body: str,
                   count_calls: bool = False) -> str:
    """What the code generator writes for one pointwise computation."""
    params = ", ".join(f"compute_t x{k}" for k in range(len(inputs)))
    count = "++expr_calls; " if count_calls else ""
    return "\n".join([
        f"using out_t = {out};",
        *(f"using in{k}_t = {t};" for k, t in enumerate(inputs)),
        f"using compute_t = {compute};",
        f"__device__ __forceinline__ compute_t expr({params}) {{ {count}return {body}; }}",
    ])


def full_source(generated: str, arity: int) -> str:
    return (f"#define CG_ARITY {arity}\n{kernel_text('kPointwisePrelude')}{generated}\n"
            f"{kernel_text('kPointwiseEpilogue')}")


# ---------------------------------------------------------------------------- NVRTC


class Nvrtc:
    """NVRTC from the CUDA wheel that torch depends on, through ctypes."""

    def __init__(self, folder: Path):
        builtins = sorted(p for p in folder.glob("libnvrtc-builtins.so.*") if ".alt." not in p.name)
        for b in builtins:  # NVRTC opens it by name at each compile
            ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(str(next(folder.glob("libnvrtc.so.*"))))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def compile(self, source: str, arch: str) -> tuple[int, str, bytes]:
        """(status, log, PTX for compute_XY or a cubin for sm_XY)."""
        lib, program = self.lib, ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"pointwise.cu",
                                      0, None, None) == 0
        options = [f"--gpu-architecture={arch}".encode(), b"-default-device", b"--std=c++17"]
        status = lib.nvrtcCompileProgram(program, len(options),
                                         (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        output = b""
        if status == 0:
            get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if arch.startswith("sm_")
                             else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
            get_size(program, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            get(program, buffer)
            output = buffer.raw
        lib.nvrtcDestroyProgram(ctypes.byref(program))
        return status, log.value.decode(errors="replace"), output


@functools.cache
def _nvrtc() -> Nvrtc | None:
    for entry in sys.path:
        for folder in sorted(Path(entry).glob("nvidia/*/lib")):
            if any(folder.glob("libnvrtc.so.*")):
                return Nvrtc(folder)
    return None


@pytest.fixture(scope="module")
def nvrtc() -> Nvrtc:
    found = _nvrtc()
    if found is None:
        pytest.skip("needs NVRTC from torch's CUDA wheels (nvidia/*/lib/libnvrtc.so.*)")
    return found


def compiled(nvrtc: Nvrtc, generated: str, arity: int, arch: str = "compute_90") -> str:
    status, log, ptx = nvrtc.compile(full_source(generated, arity), arch)
    assert status == 0, f"NVRTC failed ({status}) for\n{generated}\n{log}"
    return ptx.rstrip(b"\0").decode()


def ptx_layout(ptx: str) -> list[int]:
    """cg_pointwise_layout's ints from the PTX initializer (trailing zero bytes omitted)."""
    found = re.search(r"cg_pointwise_layout\[(\d+)\] = \{([^}]*)\}", ptx)
    assert found, "no cg_pointwise_layout in the PTX"
    data = [int(b) for b in found.group(2).split(",")]
    data += [0] * (int(found.group(1)) - len(data))
    return list(struct.unpack(f"<{len(data) // 4}i", bytes(data)))


def entry(ptx: str, name: str) -> str:
    """The PTX of kernel `name`."""
    start = ptx.index(f".entry {name}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end >= 0 else len(ptx)]


def variants(arity: int):
    """(out, inputs, compute) covering every storage type for out and for each input."""
    types = list(STORAGE)
    for compute, out, shift in itertools.product(("float", "double"), types, range(4)):
        yield out, [types[(k + shift) % 4] for k in range(arity)], compute


@pytest.mark.parametrize("arity", sorted(BODIES))
def test_kernel_text_compiles_for_every_type(nvrtc, arity):
    """Every storage type as out and as each input, compute_t float and double: the text
    compiles to PTX, has both kernels, and exports the layout the host checks views
    against (16 bytes of the widest type per thread, the element sizes)."""
    cases = list(variants(arity))

    def one(case):
        out, inputs, compute = case
        return case, compiled(nvrtc, generated_part(out, inputs, compute, BODIES[arity]), arity)

    workers = os.cpu_count() or 2
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for (out, inputs, compute), ptx in pool.map(one, cases):
            sizes = [STORAGE[out], *(STORAGE[t] for t in inputs)]
            assert ptx_layout(ptx) == [16 // max(sizes), arity, *sizes], (out, inputs, compute)
            assert ".visible .entry cg_pointwise_vector(" in ptx
            assert ".visible .entry cg_pointwise_strided(" in ptx


@pytest.mark.parametrize("compute", ["float", "double"])
def test_kernel_text_compiles_for_quantized_inputs(nvrtc, compute):
    """A 1-byte quantized input against every output type and a scale of every type, as
    a dequantize's kernel reads them: the layout counts its 1-byte elements, and the
    vector width is 16 bytes of the widest type (2 of an int8 where out is double)."""
    cases = [(out, [q, scale]) for out in STORAGE for q in QUANTIZED for scale in STORAGE]
    for out, inputs in cases:
        body = "x0 * round_bf16(x1)" if out == "bf16" else "x0 * round_f16(x1)"
        ptx = compiled(nvrtc, generated_part(out, inputs, compute, body), 2)
        sizes = [STORAGE[out], QUANTIZED[inputs[0]], STORAGE[inputs[1]]]
        assert ptx_layout(ptx) == [16 // max(sizes), 2, *sizes], (out, inputs, compute)


def test_vector_kernel_moves_16_bytes_per_operand(nvrtc):
    ptx = compiled(nvrtc, generated_part("bf16", ["bf16", "bf16"], "float", BODIES[2]), 2)
    vector = entry(ptx, "cg_pointwise_vector")
    assert vector.count("ld.global.v4.u32") >= 2  # both inputs
    assert vector.count("st.global.v4.u32") >= 1
    for kernel in (vector, entry(ptx, "cg_pointwise_strided")):  # no integer division
        assert not re.search(r"\b(div|rem)\.[su](32|64)", kernel)


def test_math_is_exact_and_16_bit_conversions_use_cvt(nvrtc):
    """No fast math (torch's kernels use the accurate expf/erff/tanhf), and sm_80+ rounds to
    bf16 with cvt.rn; older archs take the integer rounding (test_conversions_match_torch)."""
    generated = generated_part("bf16", ["f16"], "float", BODIES[1])
    new = compiled(nvrtc, generated, 1, "compute_90")
    assert "cvt.rn.bf16.f32" in new and "cvt.f32.f16" in new
    assert "tanh.approx" not in new
    old = compiled(nvrtc, generated, 1, "compute_75")
    assert "cvt.rn.bf16.f32" not in old and "cvt.f32.f16" in old


def test_kernel_text_compiles_to_a_cubin(nvrtc):
    status, log, cubin = nvrtc.compile(
        full_source(generated_part("bf16", ["bf16", "bf16"], "float", BODIES[2]), 2), "sm_90")
    assert status == 0, log
    assert cubin.startswith(b"\x7fELF")
    for name in (b"cg_pointwise_vector", b"cg_pointwise_strided", b"cg_pointwise_layout"):
        assert name in cubin


def test_kernel_text_needs_its_arity(nvrtc):
    status, log, _ = nvrtc.compile(
        kernel_text("kPointwisePrelude") + generated_part("float", ["float"], "float", "x0")
        + kernel_text("kPointwiseEpilogue"), "compute_90")
    assert status != 0 and "CG_ARITY" in log


# ---------------------------------------------------------------------------- the header


HARNESS = r"""
#include "codegen/runtime.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#define EXPORT extern "C" __attribute__((visibility("default")))
namespace rt = codegen_rt;

EXPORT void* rtpw_pointwise() { return reinterpret_cast<void*>(&rt::pointwise); }

// Compiles `generated` for sm_<arch> as pointwise() does: returns the cubin's size (copied
// into `cubin` if it fits) and NVRTC's path in `message`, or -1 and the error.
EXPORT long long rtpw_compile(const char* generated, int arity, int arch, char* cubin,
                              size_t cubin_cap, char* message, size_t cap) {
  try {
    static const rt::Nvrtc api = rt::open_nvrtc("rtpw", "Silu(T0)");
    const std::string out = rt::nvrtc_compile(api, rt::pointwise_source(generated, arity),
                                              arch, "rtpw", "Silu(T0)", generated);
    if (out.size() <= cubin_cap) std::memcpy(cubin, out.data(), out.size());
    std::snprintf(message, cap, "%s", api.path.c_str());
    return static_cast<long long>(out.size());
  } catch (const std::exception& e) {
    std::snprintf(message, cap, "%s", e.what());
    return -1;
  }
}

EXPORT void rtpw_candidates(char* out, size_t cap) {
  std::string all;
  for (const std::string& c : rt::nvrtc_candidates(rt::torch_library_dir())) all += c + "\n";
  std::snprintf(out, cap, "%s", all.c_str());
}

// The kernels of the GPU tests.
static const rt::PointwiseKernel kGpuKernels[] = {
    {"Mul(Silu(x), y)", R"cg(using out_t = bf16;
using in0_t = bf16;
using in1_t = bf16;
using compute_t = float;
__device__ __forceinline__ compute_t expr(compute_t x0, compute_t x1) { return silu(x0) * x1; })cg",
     2},
    {"Add(x, bias)", R"cg(using out_t = float;
using in0_t = float;
using in1_t = float;
using compute_t = float;
__device__ __forceinline__ compute_t expr(compute_t x0, compute_t x1) { return x0 + x1; })cg",
     2},
    {"Gelu(x, tanh) to f16", R"cg(using out_t = f16;
using in0_t = float;
using compute_t = float;
__device__ __forceinline__ compute_t expr(compute_t x0) { return gelu_tanh(x0); })cg",
     1},
    {"Relu(x) + Gelu(y) * z in double", R"cg(using out_t = double;
using in0_t = double;
using in1_t = double;
using in2_t = double;
using compute_t = double;
__device__ __forceinline__ compute_t expr(compute_t x0, compute_t x1, compute_t x2) {
  return relu(x0) + gelu(x1) * x2;
})cg",
     3},
    {"Mul(x, 2) first called under capture", R"cg(using out_t = float;
using in0_t = float;
using compute_t = float;
__device__ __forceinline__ compute_t expr(compute_t x0) { return x0 * 2.0f; })cg",
     1},
};

// A view from 9 int64s: data pointer, rank, itemsize, sizes[3], strides[3].
static rt::View view_at(const int64_t* v) {
  rt::View view;
  view.data = reinterpret_cast<char*>(v[0]);
  view.dim = static_cast<int>(v[1]);
  view.itemsize = v[2];
  for (int d = 0; d < rt::kMaxDims; ++d) {
    view.sizes[d] = v[3 + d];
    view.strides[d] = v[6 + d];
  }
  return view;
}

// pointwise() of kGpuKernels[which] on `views` (out, then the inputs), `iterations` times
// on `stream`: 0 and the host time per call in `us`, or 1 and the error.
EXPORT int rtpw_run(int which, const int64_t* views, void* stream, int iterations, double* us,
                    char* message, size_t cap) {
  try {
    const rt::PointwiseKernel& kernel = kGpuKernels[which];
    rt::Stream s;
    s.handle = static_cast<cudaStream_t>(stream);
    const rt::View out = view_at(views);
    rt::View in[3];
    for (int k = 0; k < kernel.arity; ++k) in[k] = view_at(views + 9 * (1 + k));
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) {
      if (kernel.arity == 1) rt::pointwise(kernel, out, {in[0]}, s, "rtpw");
      if (kernel.arity == 2) rt::pointwise(kernel, out, {in[0], in[1]}, s, "rtpw");
      if (kernel.arity == 3) rt::pointwise(kernel, out, {in[0], in[1], in[2]}, s, "rtpw");
    }
    const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
    *us = took.count() / iterations;
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(message, cap, "%s", e.what());
    return 1;
  }
}

// pointwise() on host memory (no GPU here): 0 if it returned, 1 with the error.
EXPORT int rtpw_call(int which, char* message, size_t cap) {
  static const rt::PointwiseKernel kernel{"Mul(T3_i, T4_i, out=T5_i)",
                                          "using out_t = float; /* ... */", 2};
  static float data[64];
  const auto view = [](int64_t rows, int64_t cols) {
    rt::View v;
    v.data = reinterpret_cast<char*>(data);
    v.dim = 2;
    v.itemsize = 4;
    v.sizes[0] = rows;
    v.sizes[1] = cols;
    v.strides[0] = cols;
    v.strides[1] = 1;
    return v;
  };
  rt::Stream stream;
  try {
    if (which == 0) rt::pointwise(kernel, view(0, 8), {view(0, 8), view(1, 8)}, stream, "rtpw");
    if (which == 1) rt::pointwise(kernel, view(4, 8), {view(4, 8), view(4, 7)}, stream, "rtpw");
    if (which == 2) rt::pointwise(kernel, view(4, 8), {view(4, 8)}, stream, "rtpw");
    if (which == 3) rt::pointwise(kernel, view(4, 8), {view(4, 8), view(1, 8)}, stream, "rtpw");
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(message, cap, "%s", e.what());
    return 1;
  }
}
"""


@pytest.fixture(scope="module")
def harness(cache_dir):
    lib = ctypes.CDLL(str(build_library("rtcheck_pointwise", HARNESS)))
    lib.rtpw_pointwise.restype = ctypes.c_void_p
    lib.rtpw_compile.restype = ctypes.c_longlong
    lib.rtpw_compile.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                                 ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    lib.rtpw_candidates.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.rtpw_call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.rtpw_run.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p,
                             ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p,
                             ctypes.c_size_t]
    return lib


def compile_in_cpp(harness, generated: str, arity: int, arch: int) -> tuple[int, bytes, str]:
    cubin = ctypes.create_string_buffer(1 << 20)
    message = ctypes.create_string_buffer(1 << 16)
    size = harness.rtpw_compile(generated.encode(), arity, arch, cubin, len(cubin), message,
                                len(message))
    return size, cubin.raw[:max(size, 0)], message.value.decode()


@pytest.mark.build
def test_header_builds_with_the_program_toolchain(harness):
    assert harness.rtpw_pointwise()


@pytest.mark.build
def test_header_compiles_a_kernel_through_nvrtc(harness):
    """The C++ side end to end short of the GPU: NVRTC found and opened by the header,
    its builtins reachable, the source assembled with CG_ARITY, a cubin for sm_90."""
    if _nvrtc() is None:
        pytest.skip("needs NVRTC from torch's CUDA wheels")
    generated = generated_part("bf16", ["bf16", "bf16"], "float", BODIES[2])
    size, cubin, path = compile_in_cpp(harness, generated, 2, 90)
    assert size > 0, path
    assert cubin.startswith(b"\x7fELF") and b"cg_pointwise_vector" in cubin
    assert "libnvrtc.so" in path


@pytest.mark.build
def test_nvrtc_is_looked_for_beside_torch(harness):
    """By name first (torch's CUDA library links NVRTC, so a process has it loaded), then
    in the CUDA wheels that sit beside torch in site-packages."""
    out = ctypes.create_string_buffer(1 << 14)
    harness.rtpw_candidates(out, len(out))
    candidates = out.value.decode().splitlines()
    assert candidates[:3] == ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    site = Path(torch.__file__).resolve().parent.parent
    beside = [Path(c).resolve() for c in candidates[3:5]]
    assert beside == [site / "nvidia/cu13/lib/libnvrtc.so.13",
                      site / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"]
    assert candidates[5:] == ["/usr/local/cuda/lib64/libnvrtc.so"]


@pytest.mark.build
def test_compile_error_names_op_kernel_and_log(harness):
    if _nvrtc() is None:
        pytest.skip("needs NVRTC from torch's CUDA wheels")
    broken = generated_part("bf16", ["bf16"], "float", "silu(x0) * undefined_name")
    size, _, message = compile_in_cpp(harness, broken, 1, 90)
    assert size == -1
    assert message.startswith("rtpw: compiling pointwise kernel Silu(T0) for sm_90 with NVRTC")
    assert 'undefined_name' in message and "generated(" in message  # the log, in its lines
    assert broken in message


@pytest.mark.build
def test_unsupported_arch_is_an_error(harness):
    if _nvrtc() is None:
        pytest.skip("needs NVRTC from torch's CUDA wheels")
    size, _, message = compile_in_cpp(harness, generated_part("float", ["float"], "float", "x0"),
                                      1, 11)
    assert size == -1 and "for sm_11" in message


def call(harness, which: int) -> str | None:
    message = ctypes.create_string_buffer(4096)
    return message.value.decode() if harness.rtpw_call(which, message, len(message)) else None


@pytest.mark.build
def test_pointwise_of_an_empty_output_queues_nothing(harness):
    assert call(harness, 0) is None  # no CUDA call: it would fail here


@pytest.mark.build
def test_pointwise_size_mismatch_names_op_kernel_input_and_shapes(harness):
    assert call(harness, 1) == (
        "rtpw: pointwise kernel Mul(T3_i, T4_i, out=T5_i): input 1 has shape [4, 7], which "
        "does not broadcast to the output's shape [4, 8] (a bug in codegen)")


@pytest.mark.build
def test_pointwise_arity_mismatch(harness):
    assert call(harness, 2) == ("rtpw: pointwise kernel Mul(T3_i, T4_i, out=T5_i) takes 2 "
                                "inputs, got 1 (a bug in codegen)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
@pytest.mark.build
def test_pointwise_without_a_gpu_fails_clearly(harness):
    assert call(harness, 3).startswith("rtpw: cudaGetDevice failed: ")


# ---------------------------------------------------------------------------- emulation


# (arity, generated part): widths 8, 2, 4 and 2 elements per thread.
EMULATED = {
    "bf16, silu(x0) * x1": (2, ["bf16"], ["bf16", "bf16"], "float", "silu(x0) * x1"),
    # 1-byte inputs: 8 of them per 8-byte word, and 2 per 2-byte word beside a double.
    "fp8 dequantize to bf16": (2, ["bf16"], ["f8e4m3", "bf16"], "float",
                               "x0 * round_bf16(x1)"),
    "int8 times double": (2, ["double"], ["i8", "float"], "double", "x0 * x1"),
    "mixed types, double compute": (3, ["f16"], ["float", "double", "bf16"], "double",
                                    "gelu(x0) + x1 * relu(x2)"),
    "8 float inputs": (8, ["float"], ["float"] * 8, "float",
                       "x0 + x1 * x2 - x3 + relu(x4) * x5 + x6 * x7"),
    "bf16 in, double out": (1, ["double"], ["bf16"], "float", "gelu_tanh(x0)"),
}


@pytest.mark.parametrize("name", list(EMULATED))
@pytest.mark.build
def test_kernels_emulated_on_the_host(tmp_path, name):
    """The kernel text as host C++ over ~20 layouts, each through the planned kernel,
    the other one where it applies, and one tiny block that makes every loop iterate."""
    arity, (out,), inputs, compute, body = EMULATED[name]
    generated = generated_part(out, inputs, compute, body, count_calls=True)
    text = tmp_path / "kernel.cu"
    text.write_text(full_source(generated, arity))
    binary = cxx(TESTS / "test_pointwise_emulate.cpp", tmp_path / "emulate",
                 f'-DKERNEL_TEXT="{text}"')
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    width = 16 // max({**STORAGE, **QUANTIZED}[t] for t in [out, *inputs])
    assert run.returncode == 0 and run.stdout.startswith("ok:"), run.stdout + run.stderr
    assert f"vector width {width}" in run.stdout


# ---------------------------------------------------------------------------- math


MATH = r"""
#include <math.h>
#include <stdio.h>
#define __device__
#define __forceinline__ inline
#include KERNEL_TEXT

int main() {
  float x;
  while (scanf("%a", &x) == 1) {
    const double d = x;
    printf("%a %a %a %a %a %a %a %a %04x %04x\n", silu(x), gelu(x), gelu_tanh(x), relu(x),
           silu(d), gelu(d), gelu_tanh(d), relu(d), to_bf16(x).bits, to_f16(x).bits);
  }
}
"""


@pytest.mark.build
def test_activations_and_conversions_match_torch(tmp_path):
    """The prelude's formulas (compiled for the host) against torch's CPU ops in float and
    double, and its 16-bit rounding (the integer bf16 path of archs before sm_80) against
    torch's casts, bit for bit, ties, NaN and overflow included."""
    prelude = tmp_path / "prelude.h"
    prelude.write_text(kernel_text("kPointwisePrelude"))
    source = tmp_path / "math.cpp"
    source.write_text(MATH)
    binary = cxx(source, tmp_path / "math", f'-DKERNEL_TEXT="{prelude}"')
    xs = torch.cat([
        torch.linspace(-9, 9, 721),
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 88.0, -100.0, 65504.0, 65520.0,
                      3.0e38, math.inf, -math.inf, math.nan]),
        # bf16 ties (the dropped half is exactly 0x8000) with an even and an odd kept bit.
        torch.tensor(struct.unpack("<5f", struct.pack(
            "<5I", 0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x00008000))),
    ])
    stdin = "".join(f"{float(x).hex()}\n" for x in xs)
    run = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()]
    assert len(rows) == len(xs)
    got = torch.tensor([[float.fromhex(v) for v in r[:8]] for r in rows], dtype=torch.float64)
    # torch's vectorized CPU kernels lose huge inputs (gelu(3e38) is NaN there): compare
    # where they are accurate; the GPU kernels use the formulas here.
    moderate = xs.abs() < 1e4
    x32, x64 = xs[moderate], xs[moderate].double()
    for col, (f32, f64) in enumerate([
        (F.silu(x32), F.silu(x64)),
        (F.gelu(x32), F.gelu(x64)),
        (F.gelu(x32, approximate="tanh"), F.gelu(x64, approximate="tanh")),
        (F.relu(x32), F.relu(x64)),
    ]):
        torch.testing.assert_close(got[moderate, col].float(), f32, rtol=4e-6, atol=1e-6,
                                   msg=lambda m, c=col: f"float column {c}: {m}")
        torch.testing.assert_close(got[moderate, col + 4], f64, rtol=1e-13, atol=1e-15,
                                   msg=lambda m, c=col: f"double column {c}: {m}")
    assert torch.isnan(got[xs.isnan(), 3]).all() and torch.isnan(got[xs.isnan(), 7]).all()
    assert (got[xs == math.inf] == math.inf).all()
    bf16 = torch.tensor([int(r[8], 16) for r in rows], dtype=torch.int32)
    f16 = torch.tensor([int(r[9], 16) for r in rows], dtype=torch.int32)
    nan = xs.isnan()
    want_bf16 = xs.bfloat16().view(torch.int16).int() & 0xFFFF
    want_f16 = xs.half().view(torch.int16).int() & 0xFFFF
    assert torch.equal(bf16[~nan], want_bf16[~nan])
    assert torch.equal(f16[~nan], want_f16[~nan])
    assert (bf16[nan] & 0x7FC0 == 0x7FC0).all()  # a quiet NaN


DECODE = r"""
#include <math.h>
#include <stdio.h>
#define __device__
#define __forceinline__ inline
#include KERNEL_TEXT

int main() {
  for (unsigned b = 0; b < 256; ++b) {
    const unsigned char bits = static_cast<unsigned char>(b);
    printf("%a %a\n", to_compute<float>(f8e4m3{bits}), to_compute<double>(i8{bits}));
  }
}
"""


@pytest.mark.build
def test_quantized_inputs_decode_as_torch(tmp_path):
    """The prelude's decoding of every float8_e4m3fn and int8 bit pattern (compiled for
    the host, as the GPU runs it: no PTX) against torch's: equal, signed zeros included,
    NaN where torch gives NaN."""
    prelude = tmp_path / "prelude.h"
    prelude.write_text(kernel_text("kPointwisePrelude"))
    source = tmp_path / "decode.cpp"
    source.write_text(DECODE)
    binary = cxx(source, tmp_path / "decode", f'-DKERNEL_TEXT="{prelude}"')
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()]
    assert len(rows) == 256
    bits = torch.arange(256, dtype=torch.uint8)
    fp8 = torch.tensor([float.fromhex(r[0]) for r in rows], dtype=torch.float32)
    want = bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(fp8.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    finite = ~want.isnan()
    assert torch.equal(fp8[finite], want[finite])
    assert torch.equal(fp8[finite].signbit(), want[finite].signbit())  # -0.0 at 0x80
    int8 = torch.tensor([float.fromhex(r[1]) for r in rows], dtype=torch.float64)
    assert torch.equal(int8, bits.view(torch.int8).double())


# ---------------------------------------------------------------------------- on the GPU


SILU_MUL, ADD, GELU_TANH_F16, DOUBLE3, UNDER_CAPTURE = range(5)


def run(harness, which: int, out: torch.Tensor, *inputs: torch.Tensor,
        iterations: int = 1) -> tuple[str | None, float]:
    """rtpw_run on the current stream: (error or None, host microseconds per call)."""
    data = []
    for t in (out, *inputs):
        pad = [0] * (3 - t.dim())
        data += [t.data_ptr(), t.dim(), t.element_size(), *t.shape, *pad, *t.stride(), *pad]
    message = ctypes.create_string_buffer(4096)
    us = ctypes.c_double()
    status = harness.rtpw_run(which, (ctypes.c_int64 * len(data))(*data),
                              torch.cuda.current_stream().cuda_stream, iterations,
                              ctypes.byref(us), message, len(message))
    return (message.value.decode() if status else None), us.value


def checked(harness, which, out, *inputs):
    error, _ = run(harness, which, out, *inputs)
    assert error is None, error
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.build
def test_gpu_swiglu_matches_torch(harness):
    x, y = torch.randn(2, 1024, 11008, device="cuda", dtype=torch.bfloat16)
    out = checked(harness, SILU_MUL, torch.empty_like(x), x, y)
    torch.testing.assert_close(out, (F.silu(x.float()) * y.float()).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("start, width", [(0, 1376), (1376, 1376), (8, 13), (1, 64)])
@pytest.mark.build
def test_gpu_column_slices_write_only_their_columns(harness, start, width):
    """Column blocks of row-major [m, 11008] buffers (row stride 11008): aligned ones take
    the vector kernel, a ragged or misaligned one the tail or the strided kernel."""
    x, y = torch.randn(2, 300, 11008, device="cuda", dtype=torch.bfloat16)
    buffer = torch.full_like(x, math.nan)
    cols = slice(start, start + width)
    checked(harness, SILU_MUL, buffer[:, cols], x[:, cols], y[:, cols])
    torch.testing.assert_close(buffer[:, cols], (F.silu(x[:, cols].float())
                                                 * y[:, cols].float()).bfloat16())
    rest = torch.ones(11008, dtype=torch.bool, device="cuda")
    rest[cols] = False
    assert buffer[:, rest].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [(4096,), (1, 4096), (300, 1)])
@pytest.mark.build
def test_gpu_broadcast_inputs(harness, bias_shape):
    x = torch.randn(300, 4096, device="cuda")
    bias = torch.randn(bias_shape, device="cuda")
    out = checked(harness, ADD, torch.empty_like(x), x, bias)
    torch.testing.assert_close(out, x + bias, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.build
def test_gpu_strided_input_and_in_place(harness):
    x = torch.randn(512, 300, device="cuda").t()  # [300, 512], column-major
    out = checked(harness, GELU_TANH_F16, torch.empty(300, 512, device="cuda",
                                                      dtype=torch.float16), x)
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh").half())
    y = torch.randn(300, 4096, device="cuda")
    want = y + y
    checked(harness, ADD, y, y, y)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.build
def test_gpu_three_dims_and_doubles(harness):
    a = torch.randn(3, 70, 33, device="cuda", dtype=torch.float64)
    b = torch.randn(70, 1, device="cuda", dtype=torch.float64)
    c = torch.randn(3, 1, 33, device="cuda", dtype=torch.float64)
    out = torch.empty(3, 71, 40, device="cuda", dtype=torch.float64)[:, :70, :33]
    checked(harness, DOUBLE3, out, a, b, c)
    torch.testing.assert_close(out, F.relu(a) + F.gelu(b) * c)


@pytest.mark.gpu
@pytest.mark.build
def test_gpu_graph_capture_needs_a_first_call_and_then_replays(harness):
    x = torch.randn(64, 256, device="cuda")
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="call the op once before capturing it"):
        with torch.cuda.graph(graph):
            error, _ = run(harness, UNDER_CAPTURE, out, x)
            raise RuntimeError(error)
    checked(harness, UNDER_CAPTURE, out, x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        error, _ = run(harness, UNDER_CAPTURE, out, x)
    assert error is None, error
    x.copy_(torch.randn_like(x))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
