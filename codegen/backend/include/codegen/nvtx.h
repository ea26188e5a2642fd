// codegen runtime: NVTX ranges named for host-IR lines, so that Nsight Systems maps the
// GPU work of a slice back to the program ("stream_weights: i=3 Copy(T1_i, out=T1_s)").
//
// NVTX3 is header-only (nvtx3/nvToolsExt.h in the CUDA toolkit). Without a tool attached
// its calls are no-ops behind a function pointer, and nvtxDomainCreateA returns null; the
// domain is created once per library, so a range costs one load and a branch when no
// profiler is attached, and the name is formatted only when one is. Built without the
// NVTX headers, a range does nothing.
#pragma once

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#endif

#include <cstdint>
#include <cstdio>

namespace codegen_rt {

#if __has_include(<nvtx3/nvToolsExt.h>)

// The "codegen" domain, or null when no NVTX tool (nsys, ncu) is attached.
inline nvtxDomainHandle_t nvtx_domain() {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("codegen");
  return domain;
}

// One range on this thread for the lifetime of the object: "<op>: <text>" or
// "<op>: <index>=<value> <text>".
class Range {
 public:
  Range(const char* op, const char* text) {
    if (nvtx_domain() == nullptr) return;
    char name[256];
    std::snprintf(name, sizeof name, "%s: %s", op, text);
    push(name);
  }
  Range(const char* op, const char* index, int64_t value, const char* text) {
    if (nvtx_domain() == nullptr) return;
    char name[256];
    std::snprintf(name, sizeof name, "%s: %s=%lld %s", op, index,
                  static_cast<long long>(value), text);
    push(name);
  }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;
  ~Range() {
    if (pushed_) nvtxDomainRangePop(nvtx_domain());
  }

 private:
  void push(const char* name) {
    nvtxEventAttributes_t attributes = {};
    attributes.version = NVTX_VERSION;
    attributes.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attributes.messageType = NVTX_MESSAGE_TYPE_ASCII;
    attributes.message.ascii = name;  // copied by the tool
    nvtxDomainRangePushEx(nvtx_domain(), &attributes);
    pushed_ = true;
  }
  bool pushed_ = false;
};

#else

class Range {
 public:
  Range(const char*, const char*) {}
  Range(const char*, const char*, int64_t, const char*) {}
};

#endif

}  // namespace codegen_rt
