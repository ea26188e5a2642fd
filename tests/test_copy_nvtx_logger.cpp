// A minimal NVTX injection library for the tests: with NVTX_INJECTION64_PATH pointing at
// it, every NVTX range pushed in the process (codegen's "codegen" domain included) is
// appended to the file named by $CODEGEN_NVTX_LOG as "push <name>" or "pop". Nsight
// Systems attaches the same way; this one records what it would show.
#include <nvtx3/nvToolsExt.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace {

std::mutex mutex;

void log_line(const char* kind, const char* name) {
  const std::lock_guard<std::mutex> lock(mutex);
  static FILE* out = std::fopen(std::getenv("CODEGEN_NVTX_LOG"), "a");
  if (out == nullptr) return;
  std::fprintf(out, name ? "%s %s\n" : "%s\n", kind, name);
  std::fflush(out);
}

nvtxDomainHandle_t domain_create(const char*) {
  static int domain = 0;
  return reinterpret_cast<nvtxDomainHandle_t>(&domain);
}

int domain_push(nvtxDomainHandle_t, const nvtxEventAttributes_t* attributes) {
  const bool ascii = attributes->messageType == NVTX_MESSAGE_TYPE_ASCII;
  log_line("push", ascii ? attributes->message.ascii : "(not ascii)");
  return 0;
}

int domain_pop(nvtxDomainHandle_t) {
  log_line("pop", nullptr);
  return 0;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjectionNvtx2(
    NvtxGetExportTableFunc_t get_export_table) {
  const auto* callbacks =
      static_cast<const NvtxExportTableCallbacks*>(get_export_table(NVTX_ETID_CALLBACKS));
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (callbacks == nullptr ||
      !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) ||
      size <= NVTX_CBID_CORE2_DomainCreateA) {
    return 0;
  }
  *table[NVTX_CBID_CORE2_DomainCreateA] = reinterpret_cast<NvtxFunctionPointer>(&domain_create);
  *table[NVTX_CBID_CORE2_DomainRangePushEx] = reinterpret_cast<NvtxFunctionPointer>(&domain_push);
  *table[NVTX_CBID_CORE2_DomainRangePop] = reinterpret_cast<NvtxFunctionPointer>(&domain_pop);
  return 1;
}
