// codegen runtime: the program's elementwise ops, as CUDA kernels that NVRTC builds at
// run time from the few lines the code generator writes for each.
//
// A pointwise computation is out[idx] = expr(in0[idx'], ..., in{n-1}[idx']). The generator
// emits only what differs between computations, PointwiseKernel::source:
//
//   using out_t = bf16;
//   using in0_t = bf16;
//   using in1_t = bf16;
//   using compute_t = float;
//   __device__ __forceinline__ compute_t expr(compute_t x0, compute_t x1) { return silu(x0) * x1; }
//
// (storage types bf16, f16, float, double, and for inputs only f8e4m3 and i8; compute_t
// float or double), and the runtime compiles, once per (text, GPU arch) in the process,
//
//   #define CG_ARITY <kernel.arity>     the number of inputs, 1..kMaxPointwiseArity
//   kPointwisePrelude                   bf16/f16 (16-bit structs converted through PTX cvt),
//                                       f8e4m3/i8 (1-byte structs decoded by hand),
//                                       load/store, silu/gelu/gelu_tanh/relu and their
//                                       _grad forms for float and double, round_bf16 and
//                                       round_f16; no includes, so NVRTC needs no include path
//   <the generated part>
//   kPointwiseEpilogue                  the kernels: load the inputs as compute_t, call
//                                       expr, store out_t
//
// into a cubin for the device's sm_XY (exact math, as torch's kernels: no fast-math), and
// loads it with cudaLibraryLoadData. NVRTC is opened with dlopen at the first compile (no
// link-time dependency): by name through the default search, then from the CUDA wheels
// next to torch's libraries (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib).
//
// The kernel ABI: one parameter, the epilogue's cg_args (the host's PointwiseArgs, of
// which the launch copies the prefix with CG_ARITY inputs), passed by value: the
// iteration shape [d0, d1, d2] -- out's shape with size-1 dims dropped and dims that every
// operand walks as one merged (a contiguous [m, n] is one dim of m * n), its densest dim
// innermost -- and, for out and each input, the data pointer and strides in elements over
// those three dims (0 where an input is broadcast). Two kernels:
//   cg_pointwise_vector   V consecutive elements of d2 per thread: one load or store of
//                         V elements (16 bytes for the widest type) per operand whose d2
//                         stride is 1, one load repeated V times where it is 0
//   cg_pointwise_strided  one element per thread, any strides
// Both walk d0 over blockIdx.z, d1 over the grid's y and d2 over its x with grid-stride
// loops and 64-bit offsets (no integer division). The kernel text also exports
// cg_pointwise_layout (V and each operand's element size), which the host reads once to
// check every call's views against the types the kernel was compiled with.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "codegen/check.h"
#include "codegen/stream.h"
#include "codegen/tensor.h"

// cudaLaunchKernel takes a cudaKernel_t cast to const void* as the function (the runtime
// header's cudaLaunchKernelEx overload for cudaKernel_t passes it so), and the runtime's
// library calls (cudaLibraryLoadData, cudaLibraryGetKernel) launch without libcuda.
static_assert(CUDART_VERSION >= 12080,
              "codegen/pointwise.h needs the CUDA 12.8 runtime or newer (cudaLibraryLoadData, "
              "cudaLaunchKernel of a cudaKernel_t)");

namespace codegen_rt {

constexpr int kMaxPointwiseArity = 8;
// Threads per block: the kernels' __launch_bounds__ in kPointwiseEpilogue.
constexpr int kPointwiseThreads = 256;

// One pointwise computation of a program: `source` is the generated part (see the top of
// this file), `arity` the number of inputs (1..kMaxPointwiseArity). Compiled by NVRTC on
// first use per (source text, GPU arch) in the process, then cached. `source` and `name`
// must live as long as the process (string literals of a program: torch never unloads an
// op library), since the compiled kernels are found by the address of `source`.
struct PointwiseKernel {
  const char* name;    // for messages, e.g. "Mul(Silu(T3_i), T4_i, out=T5_i)"
  const char* source;  // the generated part
  int arity;
};

// ---- the kernel text ----------------------------------------------------------------

inline constexpr const char kPointwisePrelude[] = R"cg(
// codegen pointwise prelude: storage types, conversions and math, before the generated part.
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };
// Quantized values, read only (dequantize's q): float8_e4m3fn (1 sign, 4 exponent bits of
// bias 7, 3 mantissa bits; no infinities, S.1111.111 is NaN) and int8 (two's complement;
// int4 values stored unpacked in it read the same).
struct f8e4m3 { unsigned char bits; };
struct i8 { unsigned char bits; };

__device__ __forceinline__ unsigned cg_float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  unsigned u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

__device__ __forceinline__ float cg_bits_float(unsigned u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

__device__ __forceinline__ unsigned long long cg_double_bits(double d) {
#ifdef __CUDA_ARCH__
  return static_cast<unsigned long long>(__double_as_longlong(d));
#else
  unsigned long long u;
  __builtin_memcpy(&u, &d, sizeof u);
  return u;
#endif
}

__device__ __forceinline__ double cg_bits_double(unsigned long long u) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  __builtin_memcpy(&d, &u, sizeof d);
  return d;
#endif
}

// bf16 is the upper half of a float: widening is exact on every arch.
__device__ __forceinline__ float to_float(bf16 v) {
  return cg_bits_float(static_cast<unsigned>(v.bits) << 16);
}

// Round to nearest even, as torch's casts.
__device__ __forceinline__ bf16 to_bf16(float f) {
  bf16 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
  // What cvt.rn.bf16.f32 computes (sm_80+), in integer arithmetic; a NaN stays a quiet NaN.
  const unsigned u = cg_float_bits(f);
  r.bits = (u & 0x7fffffffu) > 0x7f800000u
               ? static_cast<unsigned short>((u >> 16) | 0x40u)
               : static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
  return r;
}

__device__ __forceinline__ float to_float(f16 v) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#else  // the kernel text emulated on the host (tests)
  _Float16 h;
  __builtin_memcpy(&h, &v.bits, sizeof h);
  return static_cast<float>(h);
#endif
}

__device__ __forceinline__ f16 to_f16(float f) {
  f16 r;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
  const _Float16 h = static_cast<_Float16>(f);
  __builtin_memcpy(&r.bits, &h, sizeof h);
#endif
  return r;
}

// Exact on every arch: a normal value's fields move into a float's (exponent bias 7 ->
// 127), a subnormal one is m * 2^-9, and both NaN encodings are a quiet NaN.
__device__ __forceinline__ float to_float(f8e4m3 v) {
  const unsigned sign = (static_cast<unsigned>(v.bits) & 0x80u) << 24;
  const unsigned exponent = (v.bits >> 3) & 0xfu, mantissa = v.bits & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return cg_bits_float(sign | 0x7fc00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9
    return sign ? -magnitude : magnitude;
  }
  return cg_bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

__device__ __forceinline__ float to_float(i8 v) {
  return static_cast<float>(static_cast<int>(v.bits) - ((v.bits & 0x80) << 1));
}

// x rounded to bf16 (f16) and widened back: the value the reference computes with after
// its .to(bfloat16) (dequantize's scale in its result's dtype).
__device__ __forceinline__ float round_bf16(float x) { return to_float(to_bf16(x)); }
__device__ __forceinline__ double round_bf16(double x) {
  return to_float(to_bf16(static_cast<float>(x)));
}
__device__ __forceinline__ float round_f16(float x) { return to_float(to_f16(x)); }
__device__ __forceinline__ double round_f16(double x) {
  return to_float(to_f16(static_cast<float>(x)));
}

// Storage -> compute_t.
template <class C>
__device__ __forceinline__ C to_compute(bf16 v) { return static_cast<C>(to_float(v)); }
template <class C>
__device__ __forceinline__ C to_compute(f16 v) { return static_cast<C>(to_float(v)); }
template <class C>
__device__ __forceinline__ C to_compute(f8e4m3 v) { return static_cast<C>(to_float(v)); }
template <class C>
__device__ __forceinline__ C to_compute(i8 v) { return static_cast<C>(to_float(v)); }
template <class C>
__device__ __forceinline__ C to_compute(float v) { return static_cast<C>(v); }
template <class C>
__device__ __forceinline__ C to_compute(double v) { return static_cast<C>(v); }

// compute_t -> storage; a double reaches the 16-bit types through float, as torch's casts.
__device__ __forceinline__ void from_compute(float v, bf16& s) { s = to_bf16(v); }
__device__ __forceinline__ void from_compute(double v, bf16& s) {
  s = to_bf16(static_cast<float>(v));
}
__device__ __forceinline__ void from_compute(float v, f16& s) { s = to_f16(v); }
__device__ __forceinline__ void from_compute(double v, f16& s) {
  s = to_f16(static_cast<float>(v));
}
__device__ __forceinline__ void from_compute(float v, float& s) { s = v; }
__device__ __forceinline__ void from_compute(double v, float& s) { s = static_cast<float>(v); }
__device__ __forceinline__ void from_compute(float v, double& s) { s = v; }
__device__ __forceinline__ void from_compute(double v, double& s) { s = v; }

// One element from memory as compute_t, and back.
template <class C, class S>
__device__ __forceinline__ C load(const S* p) { return to_compute<C>(*p); }
template <class S, class C>
__device__ __forceinline__ void store(S* p, C v) { from_compute(v, *p); }

// The activations, in torch's formulas and order of operations (its CUDA kernels compute
// 16-bit inputs in float).
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ double silu(double x) { return x / (1.0 + exp(-x)); }

// 0.5 x (1 + erf(x / sqrt(2)))
__device__ __forceinline__ float gelu(float x) {
  return x * 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
}
__device__ __forceinline__ double gelu(double x) {
  return x * 0.5 * (1.0 + erf(x * 0.70710678118654752440));
}

// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))): gelu(approximate="tanh")
__device__ __forceinline__ float gelu_tanh(float x) {
  const float cube = x * x * x;
  const float inner = 0.79788456080286535588f * (x + 0.044715f * cube);
  return 0.5f * x * (1.0f + tanhf(inner));
}
__device__ __forceinline__ double gelu_tanh(double x) {
  const double cube = x * x * x;
  const double inner = 0.79788456080286535588 * (x + 0.044715 * cube);
  return 0.5 * x * (1.0 + tanh(inner));
}

// max(x, 0), and NaN for NaN (as torch.relu).
__device__ __forceinline__ float relu(float x) { return x > 0.0f || x != x ? x : 0.0f; }
__device__ __forceinline__ double relu(double x) { return x > 0.0 || x != x ? x : 0.0; }

// Their derivatives times the incoming gradient dy (torch's silu_backward and
// gelu_backward, same formulas and order).
__device__ __forceinline__ float silu_grad(float dy, float x) {
  const float s = 1.0f / (1.0f + expf(-x));
  return dy * s * (1.0f + x * (1.0f - s));
}
__device__ __forceinline__ double silu_grad(double dy, double x) {
  const double s = 1.0 / (1.0 + exp(-x));
  return dy * s * (1.0 + x * (1.0 - s));
}

// cdf + x pdf: 0.5 (1 + erf(x / sqrt(2))) + x exp(-x^2 / 2) / sqrt(2 pi)
__device__ __forceinline__ float gelu_grad(float dy, float x) {
  const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
  const float pdf = 0.39894228040143267794f * expf(x * x * -0.5f);
  return dy * (cdf + x * pdf);
}
__device__ __forceinline__ double gelu_grad(double dy, double x) {
  const double cdf = 0.5 * (1.0 + erf(x * 0.70710678118654752440));
  const double pdf = 0.39894228040143267794 * exp(x * x * -0.5);
  return dy * (cdf + x * pdf);
}

__device__ __forceinline__ float gelu_tanh_grad(float dy, float x) {
  const float k_beta = 0.79788456080286535588f, kappa = 0.044715f;
  const float x_sq = x * x, x_cube = x_sq * x;
  const float t = tanhf(k_beta * (x + kappa * x_cube));
  const float left = 0.5f * x, right = 1.0f + t;
  const float right_derivative = left * (1.0f - t * t) * k_beta * (1.0f + 3.0f * kappa * x_sq);
  return dy * (0.5f * right + right_derivative);
}
__device__ __forceinline__ double gelu_tanh_grad(double dy, double x) {
  const double k_beta = 0.79788456080286535588, kappa = 0.044715;
  const double x_sq = x * x, x_cube = x_sq * x;
  const double t = tanh(k_beta * (x + kappa * x_cube));
  const double left = 0.5 * x, right = 1.0 + t;
  const double right_derivative = left * (1.0 - t * t) * k_beta * (1.0 + 3.0 * kappa * x_sq);
  return dy * (0.5 * right + right_derivative);
}
)cg";

inline constexpr const char kPointwiseEpilogue[] = R"cg(
// codegen pointwise epilogue: the kernels around the generated expr.
#ifndef CG_ARITY
#error "CG_ARITY (the number of inputs) must be defined before the kernel text"
#endif

template <int... I> struct cg_seq {};
template <int N, int... I> struct cg_seq_of {
  using type = typename cg_seq_of<N - 1, N - 1, I...>::type;
};
template <int... I> struct cg_seq_of<0, I...> { using type = cg_seq<I...>; };
using cg_inputs = typename cg_seq_of<CG_ARITY>::type;

// Input k's storage type.
template <int K> struct cg_in;
template <> struct cg_in<0> { using type = in0_t; };
#if CG_ARITY > 1
template <> struct cg_in<1> { using type = in1_t; };
#endif
#if CG_ARITY > 2
template <> struct cg_in<2> { using type = in2_t; };
#endif
#if CG_ARITY > 3
template <> struct cg_in<3> { using type = in3_t; };
#endif
#if CG_ARITY > 4
template <> struct cg_in<4> { using type = in4_t; };
#endif
#if CG_ARITY > 5
template <> struct cg_in<5> { using type = in5_t; };
#endif
#if CG_ARITY > 6
template <> struct cg_in<6> { using type = in6_t; };
#endif
#if CG_ARITY > 7
template <> struct cg_in<7> { using type = in7_t; };
#endif

// The parameter (codegen_rt::PointwiseArgs on the host, with CG_ARITY inputs).
struct cg_operand {
  char* data;
  long long strides[3];  // elements, over the iteration dims
};
struct cg_args {
  long long sizes[3];  // the iteration shape [d0, d1, d2]
  cg_operand out;
  cg_operand in[CG_ARITY];
};
static_assert(sizeof(cg_operand) == 32 && sizeof(long long) == 8, "the host's PointwiseOperand");

// Elements per thread of cg_pointwise_vector: 16 bytes of the widest operand type.
template <int... I> constexpr int cg_widest(cg_seq<I...>) {
  const int sizes[] = {static_cast<int>(sizeof(typename cg_in<I>::type))...};
  int widest = static_cast<int>(sizeof(out_t));
  for (int s : sizes) widest = s > widest ? s : widest;
  return widest;
}
constexpr int cg_vector = 16 / cg_widest(cg_inputs{});

// What the host checks the views against (codegen_rt::PointwiseLayout).
struct cg_layout {
  int vector_width;
  int arity;
  int itemsizes[1 + CG_ARITY];  // out, then the inputs
};
template <int... I> constexpr cg_layout cg_layout_of(cg_seq<I...>) {
  return {cg_vector, CG_ARITY,
          {static_cast<int>(sizeof(out_t)), static_cast<int>(sizeof(typename cg_in<I>::type))...}};
}
extern "C" {
__device__ cg_layout cg_pointwise_layout = cg_layout_of(cg_inputs{});
}

template <class T>
__device__ __forceinline__ T* cg_at(const cg_operand& o, long long z, long long y, long long x) {
  return reinterpret_cast<T*>(o.data) + (z * o.strides[0] + y * o.strides[1] + x * o.strides[2]);
}

template <int... I>
__device__ __forceinline__ void cg_element(const cg_args& a, long long z, long long y,
                                           long long x, cg_seq<I...>) {
  const compute_t r =
      expr(load<compute_t>(cg_at<const typename cg_in<I>::type>(a.in[I], z, y, x))...);
  store(cg_at<out_t>(a.out, z, y, x), r);
}

// cg_vector elements of T as one load or store of 4, 8 or 16 bytes: a word of 32-bit
// lanes, taken apart and put together with shifts. Loads of CUDA's vector types stay
// whole; the stores are written in PTX, since the compiler splits a uint4 store whose
// lanes it packed from 16-bit halves into four 32-bit stores. (st.global takes the
// generic address: global memory has the same address in both, as CUTLASS's stores rely
// on.)
template <int Bytes> struct cg_word;
template <> struct cg_word<16> {
  unsigned lanes[4];
  __device__ __forceinline__ void load(const void* p) {
    const uint4 w = *static_cast<const uint4*>(p);
    lanes[0] = w.x, lanes[1] = w.y, lanes[2] = w.z, lanes[3] = w.w;
  }
  __device__ __forceinline__ void store(void* p) const {
#ifdef __CUDA_ARCH__
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(lanes[0]),
                 "r"(lanes[1]), "r"(lanes[2]), "r"(lanes[3]) : "memory");
#else
    *static_cast<uint4*>(p) = uint4{lanes[0], lanes[1], lanes[2], lanes[3]};
#endif
  }
};
template <> struct cg_word<8> {
  unsigned lanes[2];
  __device__ __forceinline__ void load(const void* p) {
    const uint2 w = *static_cast<const uint2*>(p);
    lanes[0] = w.x, lanes[1] = w.y;
  }
  __device__ __forceinline__ void store(void* p) const {
#ifdef __CUDA_ARCH__
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(lanes[0]), "r"(lanes[1])
                 : "memory");
#else
    *static_cast<uint2*>(p) = uint2{lanes[0], lanes[1]};
#endif
  }
};
template <> struct cg_word<4> {
  unsigned lanes[1];
  __device__ __forceinline__ void load(const void* p) {
    lanes[0] = *static_cast<const unsigned*>(p);
  }
  __device__ __forceinline__ void store(void* p) const { *static_cast<unsigned*>(p) = lanes[0]; }
};
// Two 1-byte elements (an int8 input where the widest type is 8 bytes).
template <> struct cg_word<2> {
  unsigned lanes[1];
  __device__ __forceinline__ void load(const void* p) {
    lanes[0] = *static_cast<const unsigned short*>(p);
  }
  __device__ __forceinline__ void store(void* p) const {
    *static_cast<unsigned short*>(p) = static_cast<unsigned short>(lanes[0]);
  }
};
template <class T> using cg_word_of = cg_word<static_cast<int>(sizeof(T)) * cg_vector>;

template <class T> __device__ __forceinline__ unsigned long long cg_bits(T v) { return v.bits; }
template <> __device__ __forceinline__ unsigned long long cg_bits(float v) {
  return cg_float_bits(v);
}
template <> __device__ __forceinline__ unsigned long long cg_bits(double v) {
  return cg_double_bits(v);
}
template <class T> __device__ __forceinline__ T cg_of_bits(unsigned long long b) {
  return T{static_cast<decltype(T::bits)>(b)};
}
template <> __device__ __forceinline__ float cg_of_bits(unsigned long long b) {
  return cg_bits_float(static_cast<unsigned>(b));
}
template <> __device__ __forceinline__ double cg_of_bits(unsigned long long b) {
  return cg_bits_double(b);
}

// Element e of a word of T.
template <class T>
__device__ __forceinline__ T cg_unpack(const cg_word_of<T>& w, int e) {
  if constexpr (sizeof(T) == 8) {
    const unsigned long long high = w.lanes[2 * e + 1];
    return cg_of_bits<T>(w.lanes[2 * e] | high << 32);
  } else {
    constexpr int per_lane = 4 / sizeof(T);
    constexpr unsigned mask = sizeof(T) == 1 ? 0xffu : sizeof(T) == 2 ? 0xffffu : 0xffffffffu;
    const unsigned lane = w.lanes[e / per_lane] >> (8 * sizeof(T) * (e % per_lane));
    return cg_of_bits<T>(lane & mask);
  }
}

template <class T>
__device__ __forceinline__ void cg_pack(cg_word_of<T>& w, int e, T v) {
  const unsigned long long b = cg_bits(v);
  if constexpr (sizeof(T) == 8) {
    w.lanes[2 * e] = static_cast<unsigned>(b);
    w.lanes[2 * e + 1] = static_cast<unsigned>(b >> 32);
  } else {
    constexpr int per_lane = 4 / sizeof(T);
    if (e % per_lane == 0) w.lanes[e / per_lane] = 0;
    w.lanes[e / per_lane] |= static_cast<unsigned>(b) << (8 * sizeof(T) * (e % per_lane));
  }
}

template <class T>
__device__ __forceinline__ void cg_load_vector(const cg_operand& o, long long z, long long y,
                                               long long x, compute_t (&v)[cg_vector]) {
  const T* p = cg_at<const T>(o, z, y, x);
  if (o.strides[2] == 0) {  // broadcast along d2: one element for all
    const compute_t c = load<compute_t>(p);
    for (int e = 0; e < cg_vector; ++e) v[e] = c;
  } else {
    cg_word_of<T> word;
    word.load(p);
    for (int e = 0; e < cg_vector; ++e) v[e] = to_compute<compute_t>(cg_unpack<T>(word, e));
  }
}

template <int... I>
__device__ __forceinline__ void cg_vector_step(const cg_args& a, long long z, long long y,
                                               long long x, cg_seq<I...>) {
  compute_t v[CG_ARITY][cg_vector];
  (cg_load_vector<typename cg_in<I>::type>(a.in[I], z, y, x, v[I]), ...);
  cg_word_of<out_t> word;
  for (int e = 0; e < cg_vector; ++e) {
    out_t r;
    from_compute(expr(v[I][e]...), r);
    cg_pack<out_t>(word, e, r);
  }
  word.store(cg_at<out_t>(a.out, z, y, x));
}

extern "C" __global__ void __launch_bounds__(256) cg_pointwise_vector(const cg_args a) {
  const long long n = a.sizes[2];
  const long long step_y = static_cast<long long>(gridDim.y) * blockDim.y;
  const long long step_x = static_cast<long long>(gridDim.x) * blockDim.x * cg_vector;
  for (long long z = blockIdx.z; z < a.sizes[0]; z += gridDim.z) {
    for (long long y = static_cast<long long>(blockIdx.y) * blockDim.y + threadIdx.y;
         y < a.sizes[1]; y += step_y) {
      for (long long x =
               (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * cg_vector;
           x < n; x += step_x) {
        if (x + cg_vector <= n) {
          cg_vector_step(a, z, y, x, cg_inputs{});
        } else {  // the row's last elements, fewer than cg_vector
          for (long long e = x; e < n; ++e) cg_element(a, z, y, e, cg_inputs{});
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(256) cg_pointwise_strided(const cg_args a) {
  const long long step_y = static_cast<long long>(gridDim.y) * blockDim.y;
  const long long step_x = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long z = blockIdx.z; z < a.sizes[0]; z += gridDim.z) {
    for (long long y = static_cast<long long>(blockIdx.y) * blockDim.y + threadIdx.y;
         y < a.sizes[1]; y += step_y) {
      for (long long x = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
           x < a.sizes[2]; x += step_x) {
        cg_element(a, z, y, x, cg_inputs{});
      }
    }
  }
}
)cg";

// The text NVRTC compiles for `kernel` (see the top of this file); #line directives make
// NVRTC's messages point into the generated part.
inline std::string pointwise_source(const char* generated, int arity) {
  return msg("#define CG_ARITY ", arity, "\n#line 1 \"pointwise prelude\"", kPointwisePrelude,
             "#line 1 \"generated\"\n", generated, "\n#line 1 \"pointwise epilogue\"",
             kPointwiseEpilogue);
}

// ---- the launch, on the host (no GPU needed to plan it) -----------------------------

// The kernels' parameter: see the top of this file.
struct PointwiseOperand {
  char* data = nullptr;
  int64_t strides[kMaxDims] = {0, 0, 0};  // elements, over the iteration dims
};
struct PointwiseArgs {
  int64_t sizes[kMaxDims] = {1, 1, 1};  // the iteration shape [d0, d1, d2]
  PointwiseOperand out;
  PointwiseOperand in[kMaxPointwiseArity];
};
static_assert(sizeof(PointwiseOperand) == 32 && offsetof(PointwiseArgs, out) == 24,
              "the layout of kPointwiseEpilogue's cg_args");

// What the compiled kernel reads, from its cg_pointwise_layout.
struct PointwiseLayout {
  int vector_width = 1;
  int arity = 0;
  int itemsizes[1 + kMaxPointwiseArity] = {};  // out, then the inputs
};

// The strides at which input `in` is read at each index of `out`, over out's dims padded
// to kMaxDims at the front: numpy broadcasting, dims aligned at the end; a dim `in` lacks
// or has of size 1 is read with stride 0. A shape that does not broadcast is an error.
inline void broadcast_strides(const View& out, const View& in, int index, const char* op,
                              const char* name, int64_t strides[kMaxDims]) {
  const auto mismatch = [&] {
    fail(msg(op, ": pointwise kernel ", name, ": input ", index, " has shape ", in.shape(),
             ", which does not broadcast to the output's shape ", out.shape(),
             " (a bug in codegen)"));
  };
  if (in.dim > out.dim) mismatch();
  for (int d = 0; d < kMaxDims; ++d) {
    const int o = d - (kMaxDims - out.dim);  // out's dim, or < 0 where padded
    const int i = d - (kMaxDims - in.dim);   // in's dim, or < 0 where it has none
    const int64_t size = o < 0 ? 1 : out.sizes[o];
    strides[d] = 0;
    if (i < 0 || in.sizes[i] == 1) continue;
    if (in.sizes[i] != size) mismatch();
    strides[d] = in.strides[i];
  }
}

// The kernel parameter for out = expr(inputs...) before the choice of kernel: each input
// broadcast to out's shape, size-1 dims dropped, the dims ordered by out's strides
// (densest innermost) and merged where every operand walks two as one.
inline PointwiseArgs pointwise_args(const View& out, const View* inputs, int arity,
                                    const char* op, const char* name) {
  CG_CHECK(out.dim >= 0 && out.dim <= kMaxDims, op, ": pointwise kernel ", name,
           ": an output of rank ", out.dim, " (a bug in codegen)");
  CG_CHECK(arity >= 1 && arity <= kMaxPointwiseArity, op, ": pointwise kernel ", name,
           " with ", arity, " inputs (1 to ", kMaxPointwiseArity, " supported; a bug in codegen)");
  const int operands = 1 + arity;
  int64_t sizes[kMaxDims];
  int64_t strides[1 + kMaxPointwiseArity][kMaxDims];
  for (int d = 0; d < kMaxDims; ++d) {
    const int o = d - (kMaxDims - out.dim);
    sizes[d] = o < 0 ? 1 : out.sizes[o];
    strides[0][d] = o < 0 || sizes[d] == 1 ? 0 : out.strides[o];
    CG_CHECK(strides[0][d] != 0 || sizes[d] <= 1, op, ": pointwise kernel ", name,
             ": the output (shape ", out.shape(), ", strides ", Dims{out.strides, out.dim},
             ") has elements that share memory (a bug in codegen)");
  }
  for (int k = 0; k < arity; ++k) {
    CG_CHECK(inputs[k].dim >= 0 && inputs[k].dim <= kMaxDims, op, ": pointwise kernel ", name,
             ": input ", k, " of rank ", inputs[k].dim, " (a bug in codegen)");
    broadcast_strides(out, inputs[k], k, op, name, strides[1 + k]);
  }
  // The dims that matter, outermost first, innermost = out's smallest stride.
  int order[kMaxDims];
  int n = 0;
  for (int d = 0; d < kMaxDims; ++d) {
    if (sizes[d] != 1) order[n++] = d;
  }
  for (int k = 1; k < n; ++k) {  // a stable insertion sort (std::stable_sort may allocate)
    for (int j = k; j > 0 && std::abs(strides[0][order[j - 1]]) < std::abs(strides[0][order[j]]);
         --j) {
      std::swap(order[j - 1], order[j]);
    }
  }
  // Merge, from the innermost out: dim `d` joins the dims inside it where every operand's
  // stride in d is one step past the end of those.
  int64_t merged_sizes[kMaxDims];
  int64_t merged_strides[1 + kMaxPointwiseArity][kMaxDims];
  int m = 0;  // merged dims, innermost first
  for (int k = n; k-- > 0;) {
    const int d = order[k];
    bool joins = m > 0;
    for (int t = 0; joins && t < operands; ++t) {
      joins = strides[t][d] == merged_strides[t][m - 1] * merged_sizes[m - 1];
    }
    if (joins) {
      merged_sizes[m - 1] *= sizes[d];
      continue;
    }
    merged_sizes[m] = sizes[d];
    for (int t = 0; t < operands; ++t) merged_strides[t][m] = strides[t][d];
    ++m;
  }
  PointwiseArgs a;
  a.out.data = out.data;
  for (int k = 0; k < arity; ++k) a.in[k].data = inputs[k].data;
  for (int j = 0; j < m; ++j) {
    const int d = kMaxDims - 1 - j;
    a.sizes[d] = merged_sizes[j];
    a.out.strides[d] = merged_strides[0][j];
    for (int k = 0; k < arity; ++k) a.in[k].strides[d] = merged_strides[1 + k][j];
  }
  return a;
}

inline bool pointwise_empty(const PointwiseArgs& a) {
  return a.sizes[0] == 0 || a.sizes[1] == 0 || a.sizes[2] == 0;
}

// Whether cg_pointwise_vector can take `a`: at least V elements along d2, and every
// operand that is contiguous there (d2 stride 1; out must be) starts V-element aligned and
// steps across d0 and d1 by multiples of V, so each thread's V elements are one aligned
// load; an operand broadcast along d2 (stride 0) is read one element at a time.
inline bool pointwise_vectorizable(const PointwiseArgs& a, int arity,
                                   const PointwiseLayout& layout) {
  const int64_t v = layout.vector_width;
  if (v < 2 || a.sizes[2] < v || a.out.strides[2] != 1) return false;
  for (int t = 0; t <= arity; ++t) {
    const PointwiseOperand& o = t == 0 ? a.out : a.in[t - 1];
    if (o.strides[2] == 0) continue;
    if (o.strides[2] != 1 || o.strides[0] % v != 0 || o.strides[1] % v != 0) return false;
    if (reinterpret_cast<uintptr_t>(o.data) % (v * layout.itemsizes[t]) != 0) return false;
  }
  return true;
}

inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// A launch of at most `threads` per block covering d2 in steps of `per_thread` elements
// along the grid's x, d1 along y and d0 along z, each clamped to the device's limits (the
// kernels loop over the rest). A block spans a row in whole warps (172 steps: 192 threads,
// where a power of two would idle 84), or several rows where a row needs less than a warp.
struct PointwiseGrid {
  dim3 grid, block;
};

inline PointwiseGrid pointwise_grid(const PointwiseArgs& a, int64_t per_thread, int threads) {
  const int64_t columns = ceil_div(a.sizes[2], per_thread);
  const int64_t bx = columns >= 32 ? std::min<int64_t>(threads, ceil_div(columns, 32) * 32)
                                   : pow2_at_least(columns);
  const int64_t by = std::min<int64_t>(threads / bx, pow2_at_least(a.sizes[1]));
  PointwiseGrid g;
  g.block = dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by), 1);
  g.grid = dim3(static_cast<unsigned>(std::min<int64_t>(ceil_div(columns, bx), 2147483647)),
                static_cast<unsigned>(std::min<int64_t>(ceil_div(a.sizes[1], by), 65535)),
                static_cast<unsigned>(std::min<int64_t>(a.sizes[0], 65535)));
  return g;
}

// Views of other element sizes than the kernel's types would be read as the wrong type.
inline void check_itemsizes(const PointwiseLayout& layout, const View& out, const View* inputs,
                            int arity, const char* op, const char* name) {
  CG_CHECK(layout.arity == arity, op, ": pointwise kernel ", name, " was compiled for ",
           layout.arity, " inputs, called with ", arity, " (a bug in codegen)");
  CG_CHECK(out.itemsize == layout.itemsizes[0], op, ": pointwise kernel ", name,
           " stores out_t of ", layout.itemsizes[0], " bytes into an output of ",
           out.itemsize, "-byte elements (a bug in codegen)");
  for (int k = 0; k < arity; ++k) {
    CG_CHECK(inputs[k].itemsize == layout.itemsizes[1 + k], op, ": pointwise kernel ", name,
             " reads in", k, "_t of ", layout.itemsizes[1 + k], " bytes from input ", k,
             " of ", inputs[k].itemsize, "-byte elements (a bug in codegen)");
  }
}

// ---- NVRTC --------------------------------------------------------------------------

// The NVRTC entry points used here, declared by hand so that building needs no nvrtc.h
// (nvrtcResult is an enum, nvrtcProgram a pointer).
struct Nvrtc {
  using Program = void*;
  int (*version)(int*, int*) = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*create_program)(Program*, const char*, const char*, int, const char* const*,
                        const char* const*) = nullptr;
  int (*compile_program)(Program, int, const char* const*) = nullptr;
  int (*get_program_log_size)(Program, size_t*) = nullptr;
  int (*get_program_log)(Program, char*) = nullptr;
  int (*get_cubin_size)(Program, size_t*) = nullptr;
  int (*get_cubin)(Program, char*) = nullptr;
  int (*destroy_program)(Program*) = nullptr;
  std::string path;  // the library loaded
};

// The folder of torch's libraries (libtorch_cpu.so defines the shim), or "".
inline std::string torch_library_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&aoti_torch_empty_strided), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

// Where NVRTC is looked for, in order: by name through the default search (which also
// finds one the process has loaded already), then in the CUDA wheels beside torch's
// (site-packages/torch/lib -> site-packages/nvidia/...), then the CUDA toolkit.
inline std::vector<std::string> nvrtc_candidates(const std::string& torch_lib) {
  std::vector<std::string> paths = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  if (!torch_lib.empty()) {
    paths.push_back(torch_lib + "/../../nvidia/cu13/lib/libnvrtc.so.13");
    paths.push_back(torch_lib + "/../../nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
  }
  paths.push_back("/usr/local/cuda/lib64/libnvrtc.so");
  return paths;
}

inline std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// NVRTC, opened once per process by the cache below (it is never closed). The builtins
// library beside it is loaded first into the global namespace: NVRTC opens it by name at
// each compile and fails with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE where the default
// search does not reach that folder.
inline Nvrtc open_nvrtc(const char* op, const char* name) {
  std::string tried;
  for (const std::string& candidate : nvrtc_candidates(torch_library_dir())) {
    void* lib = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      tried += msg("\n  ", candidate, ": ", why != nullptr ? why : "not found");
      continue;
    }
    Nvrtc api;
    bool complete = true;
    const auto bind = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      complete = complete && fn != nullptr;
    };
    bind(api.version, "nvrtcVersion");
    bind(api.error_string, "nvrtcGetErrorString");
    bind(api.create_program, "nvrtcCreateProgram");
    bind(api.compile_program, "nvrtcCompileProgram");
    bind(api.get_program_log_size, "nvrtcGetProgramLogSize");
    bind(api.get_program_log, "nvrtcGetProgramLog");
    bind(api.get_cubin_size, "nvrtcGetCUBINSize");
    bind(api.get_cubin, "nvrtcGetCUBIN");
    bind(api.destroy_program, "nvrtcDestroyProgram");
    if (!complete) {
      tried += msg("\n  ", candidate, ": lacks an NVRTC function (too old)");
      dlclose(lib);
      continue;
    }
    Dl_info info{};
    api.path = dladdr(reinterpret_cast<void*>(api.version), &info) != 0 && info.dli_fname
                   ? info.dli_fname
                   : candidate;
    int major = 0, minor = 0;
    if (api.version(&major, &minor) == 0) {
      const std::string builtins =
          msg(folder_of(api.path), "/libnvrtc-builtins.so.", major, ".", minor);
      (void)dlopen(builtins.c_str(), RTLD_NOW | RTLD_GLOBAL);  // else NVRTC searches itself
    }
    return api;
  }
  fail(msg(op, ": pointwise kernel ", name, " is compiled at run time by NVRTC "
           "(libnvrtc.so.13 or .12), which was not found; tried:", tried,
           "\nInstall the CUDA build of torch (its nvidia-* wheels ship NVRTC) or put the "
           "folder of libnvrtc.so on LD_LIBRARY_PATH"));
}

// `source` compiled by NVRTC into a cubin for sm_<arch> (e.g. 90), or an error naming
// the op and the kernel with NVRTC's log.
inline std::string nvrtc_compile(const Nvrtc& api, const std::string& source, int arch,
                                 const char* op, const char* name, const char* generated) {
  Nvrtc::Program program = nullptr;
  int status = api.create_program(&program, source.c_str(), "codegen_pointwise.cu", 0,
                                  nullptr, nullptr);
  CG_CHECK(status == 0, op, ": pointwise kernel ", name, ": nvrtcCreateProgram failed: ",
           api.error_string(status));
  const std::string gpu = msg("--gpu-architecture=sm_", arch);
  const char* options[] = {gpu.c_str(), "-default-device", "--std=c++17"};
  status = api.compile_program(program, 3, options);
  std::string log;
  size_t log_size = 0;
  if (api.get_program_log_size(program, &log_size) == 0 && log_size > 1) {
    log.resize(log_size);
    if (api.get_program_log(program, log.data()) != 0) log.clear();
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  }
  std::string cubin;
  size_t size = 0;
  if (status == 0 && (status = api.get_cubin_size(program, &size)) == 0) {
    cubin.resize(size);
    status = api.get_cubin(program, cubin.data());
  }
  (void)api.destroy_program(&program);
  if (status != 0) {
    fail(msg(op, ": compiling pointwise kernel ", name, " for sm_", arch, " with NVRTC (",
             api.path, ") failed: ", api.error_string(status),
             status == 7 ? msg(" (libnvrtc-builtins.so was not found beside ", api.path, ")")
                         : std::string(),
             log.empty() ? std::string() : msg("\n", log), "\nthe generated part:\n",
             generated));
  }
  return cubin;
}

// ---- the process's kernels ----------------------------------------------------------

// One kernel text compiled for one arch and loaded: a cudaLibrary_t serves every device
// of that arch (the runtime loads it into a device's context on first use; here that is
// made to happen outside graph capture, see PointwiseCache::load).
struct PointwiseLibrary {
  cudaLibrary_t library = nullptr;
  cudaKernel_t vector = nullptr, strided = nullptr;
  PointwiseLayout layout;
  std::vector<int32_t> devices;  // whose contexts have it loaded
  int threads = kPointwiseThreads;
};

// What a launch needs, for one `source` address on one device; immutable once published.
struct PointwiseEntry {
  const char* source = nullptr;
  int arity = 0;
  int32_t device = -1;
  cudaKernel_t vector = nullptr, strided = nullptr;
  PointwiseLayout layout;
  int threads = kPointwiseThreads;
};

// Every pointwise kernel of the process, never freed (bounded by the number of kernel
// texts times devices). The compile cache is keyed by the whole text and arch, so two
// programs with the same computation share one build; a call finds its entry by the
// address of its kernel's source without locking (an insert-only open-addressed table of
// pointers; an entry that finds no free slot is found under the lock instead).
class PointwiseCache {
 public:
  const PointwiseEntry* find(const char* source, int arity, int32_t device) const {
    const size_t start = slot(source, device);
    for (size_t probe = 0; probe < kProbes; ++probe) {
      const PointwiseEntry* e = slots_[(start + probe) % kSlots].load(std::memory_order_acquire);
      if (e == nullptr) return nullptr;
      if (e->source == source && e->device == device && e->arity == arity) return e;
    }
    return nullptr;
  }

  // The entry of `kernel` on `device` (the current device), compiled and loaded now if
  // it is not yet; that is refused during graph capture of `stream`.
  const PointwiseEntry& load(const PointwiseKernel& kernel, int32_t device, cudaStream_t stream,
                             const char* op) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto key = std::make_tuple(kernel.source, kernel.arity, device);
    if (auto it = entries_.find(key); it != entries_.end()) return *it->second;
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), op,
               "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), op,
               "cudaDeviceGetAttribute");
    const int arch = major * 10 + minor;
    const std::string text = pointwise_source(kernel.source, kernel.arity);
    const std::string text_key = msg("sm_", arch, "\n", text);
    auto found = libraries_.find(text_key);
    PointwiseLibrary* lib = found == libraries_.end() ? nullptr : found->second.get();
    const bool ready =
        lib != nullptr && std::find(lib->devices.begin(), lib->devices.end(), device) !=
                              lib->devices.end();
    if (!ready) {
      CG_CHECK(!capturing(stream, op), op, ": pointwise kernel ", kernel.name,
               " is not yet compiled and loaded on cuda:", device,
               ", which cannot happen during CUDA graph capture: call the op once before "
               "capturing it");
      if (lib == nullptr) lib = build(text_key, text, arch, kernel, stream, op);
      // Loads the module into this device's context now (not lazily at a first launch,
      // which may be under capture), and reads what the kernels can run with.
      for (cudaKernel_t k : {lib->vector, lib->strided}) {
        cudaFuncAttributes attributes{};
        check_cuda(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(k)), op,
                   msg("loading pointwise kernel ", kernel.name).c_str());
        while (lib->threads > attributes.maxThreadsPerBlock && lib->threads > 32) {
          lib->threads /= 2;
        }
      }
      lib->devices.push_back(device);
    }
    auto entry = std::make_unique<PointwiseEntry>();
    entry->source = kernel.source;
    entry->arity = kernel.arity;
    entry->device = device;
    entry->vector = lib->vector;
    entry->strided = lib->strided;
    entry->layout = lib->layout;
    entry->threads = lib->threads;
    const PointwiseEntry* published = entry.get();
    entries_.emplace(key, std::move(entry));
    const size_t start = slot(kernel.source, device);
    for (size_t probe = 0; probe < kProbes; ++probe) {
      auto& s = slots_[(start + probe) % kSlots];
      if (s.load(std::memory_order_relaxed) == nullptr) {
        s.store(published, std::memory_order_release);
        break;
      }
    }
    return *published;
  }

 private:
  static constexpr size_t kSlots = 1024;
  static constexpr size_t kProbes = 8;

  static size_t slot(const char* source, int32_t device) {
    const uint64_t h = (reinterpret_cast<uintptr_t>(source) >> 3) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>((h >> 32) + static_cast<uint64_t>(device)) % kSlots;
  }

  // Compiles and loads `text` for sm_<arch>, and reads its layout (on the current device,
  // from `stream`, which is not capturing).
  PointwiseLibrary* build(const std::string& key, const std::string& text, int arch,
                          const PointwiseKernel& kernel, cudaStream_t stream, const char* op) {
    if (!nvrtc_) nvrtc_ = std::make_unique<Nvrtc>(open_nvrtc(op, kernel.name));
    const std::string cubin = nvrtc_compile(*nvrtc_, text, arch, op, kernel.name, kernel.source);
    auto lib = std::make_unique<PointwiseLibrary>();
    const std::string what = msg("loading pointwise kernel ", kernel.name);
    check_cuda(cudaLibraryLoadData(&lib->library, cubin.data(), nullptr, nullptr, 0, nullptr,
                                   nullptr, 0),
               op, what.c_str());
    struct Unload {  // on an error below; kept once the library is in the cache
      cudaLibrary_t library;
      ~Unload() {
        if (library != nullptr) (void)cudaLibraryUnload(library);
      }
    } unload{lib->library};
    check_cuda(cudaLibraryGetKernel(&lib->vector, lib->library, "cg_pointwise_vector"), op,
               what.c_str());
    check_cuda(cudaLibraryGetKernel(&lib->strided, lib->library, "cg_pointwise_strided"), op,
               what.c_str());
    void* layout = nullptr;
    size_t bytes = 0;
    check_cuda(cudaLibraryGetGlobal(&layout, &bytes, lib->library, "cg_pointwise_layout"), op,
               what.c_str());
    const size_t expected =
        offsetof(PointwiseLayout, itemsizes) + sizeof(int) * (1 + kernel.arity);
    CG_CHECK(bytes == expected, op, ": pointwise kernel ", kernel.name, ": its layout has ",
             static_cast<int64_t>(bytes), " bytes, expected ", static_cast<int64_t>(expected),
             " (a bug in codegen)");
    check_cuda(cudaMemcpyAsync(&lib->layout, layout, bytes, cudaMemcpyDeviceToHost, stream), op,
               what.c_str());
    check_cuda(cudaStreamSynchronize(stream), op, what.c_str());
    PointwiseLibrary* raw = lib.get();
    libraries_.emplace(key, std::move(lib));
    unload.library = nullptr;
    return raw;
  }

  std::atomic<const PointwiseEntry*> slots_[kSlots] = {};
  std::mutex mutex_;
  std::unique_ptr<Nvrtc> nvrtc_;
  std::unordered_map<std::string, std::unique_ptr<PointwiseLibrary>> libraries_;
  std::map<std::tuple<const char*, int, int32_t>, std::unique_ptr<PointwiseEntry>> entries_;
};

// One cache for every program in the process (see lease_pool in stream.h for how the
// programs' libraries share it).
inline namespace CODEGEN_RT_ABI {

__attribute__((visibility("default"))) inline PointwiseCache& pointwise_cache() {
  static PointwiseCache* cache = new PointwiseCache();  // never destroyed: CUDA may be gone
  return *cache;
}

}  // namespace CODEGEN_RT_ABI

// ---- the op's call ------------------------------------------------------------------

// The launch of `kernel` for out = expr(inputs...): which kernel, its grid and its
// parameter (pointwise() without the GPU, for tests).
struct PointwisePlan {
  PointwiseArgs args;
  bool vector = false;
  PointwiseGrid launch;
};

inline PointwisePlan plan_pointwise(const PointwiseArgs& args, int arity,
                                    const PointwiseLayout& layout, int threads) {
  PointwisePlan p;
  p.args = args;
  p.vector = pointwise_vectorizable(args, arity, layout);
  p.launch = pointwise_grid(args, p.vector ? layout.vector_width : 1, threads);
  return p;
}

// out[idx] = expr(in0[idx'], ..., in{n-1}[idx']) for every element of `out`, queued on
// `stream.handle` (the current device's). Inputs broadcast to out's shape numpy-style
// (dims aligned at the end; a missing leading dim or a size-1 dim is read with stride 0:
// a bias [n] against out [m, n]); any strides. `out` may be one of the inputs with the
// same layout (in place). An empty out queues nothing. The first call per kernel text and
// GPU arch compiles (about 0.1 s), the first per device loads; both are refused during
// graph capture, later calls are a launch.
inline void pointwise(const PointwiseKernel& kernel, const View& out,
                      std::initializer_list<View> inputs, const Stream& stream, const char* op) {
  const int arity = static_cast<int>(inputs.size());
  CG_CHECK(arity == kernel.arity, op, ": pointwise kernel ", kernel.name, " takes ",
           kernel.arity, " inputs, got ", arity, " (a bug in codegen)");
  const PointwiseArgs args = pointwise_args(out, inputs.begin(), arity, op, kernel.name);
  if (pointwise_empty(args)) return;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  PointwiseCache& cache = pointwise_cache();
  const PointwiseEntry* entry = cache.find(kernel.source, arity, device);
  if (entry == nullptr) entry = &cache.load(kernel, device, stream.handle, op);
  check_itemsizes(entry->layout, out, inputs.begin(), arity, op, kernel.name);
  PointwisePlan plan = plan_pointwise(args, arity, entry->layout, entry->threads);
  void* params[] = {&plan.args};
  const cudaError_t status = cudaLaunchKernel(
      reinterpret_cast<const void*>(plan.vector ? entry->vector : entry->strided),
      plan.launch.grid, plan.launch.block, params, 0, stream.handle);
  if (status != cudaSuccess) {
    check_cuda(status, op, msg("launching pointwise kernel ", kernel.name).c_str());
  }
}

}  // namespace codegen_rt
