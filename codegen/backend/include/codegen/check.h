// codegen runtime: error messages and the one error-check macro.
//
// Messages are formatted here with snprintf into one std::string; nothing goes
// through an ostringstream: inserting a number into one crashed the process (SIGSEGV)
// in extensions built with GCC 13 against torch 2.11 on the H200 machine, which is
// also why STD_TORCH_CHECK (it streams __LINE__) is not used. A failed check throws
// std::runtime_error, which torch raises in Python as RuntimeError.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace codegen_rt {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, int64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  s += buf;
}
inline void append(std::string& s, int v) { append(s, static_cast<int64_t>(v)); }

// A shape or stride list: [2, 3].
struct Dims {
  const int64_t* data;
  int64_t size;
};
inline void append(std::string& s, Dims dims) {
  s += "[";
  for (int64_t d = 0; d < dims.size; ++d) {
    if (d > 0) s += ", ";
    append(s, dims.data[d]);
  }
  s += "]";
}

template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

[[noreturn]] inline void fail(const std::string& message) { throw std::runtime_error(message); }

// CG_CHECK(cond, parts...): throws with msg(parts...) when cond is false; the parts are
// only formatted on failure.
#define CG_CHECK(cond, ...)                                          \
  do {                                                               \
    if (!(cond)) ::codegen_rt::fail(::codegen_rt::msg(__VA_ARGS__)); \
  } while (0)

inline void check_cuda(cudaError_t status, const char* op, const char* what) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state of this thread
    fail(msg(op, ": ", what, " failed: ", cudaGetErrorString(status)));
  }
}

}  // namespace codegen_rt
