"""A small C++ library of our own: torch's autograd-not-implemented kernel, one op at a time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

from ..backend.renderer import (
    NAMESPACE,
)
from . import extension
from .process import BuildError

# Build messages: INFO what is built and how long it took, WARNING a slower fallback taken.
log = logging.getLogger("codegen.jit")



# torch's C++ kernel for ops without a derivative (autograd_not_implemented_fallback.h),
# registered for one op at a time at the Autograd key. It runs the op below autograd and,
# where an input requires grad, gives the outputs a node whose backward raises "derivative
# for codegen::<op> is not implemented". The Python alternative
# (torch.library.register_autograd) costs a trip through Python on every call: 20 us of
# host time per call on the H200 machine (benchmarks/host_cost.py), more than the GEMM.
NO_BACKWARD_SOURCE = """\
// codegen: torch's autograd-not-implemented kernel for one codegen op at a time.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <exception>
#include <memory>
#include <mutex>
#include <vector>

// 0 when `name` (an op of the codegen namespace, without it) has the kernel now.
extern "C" __attribute__((visibility("default"))) int codegen_register_no_backward(
    const char* name) {
  static std::mutex mutex;
  static auto* fragments = new std::vector<std::unique_ptr<torch::Library>>();  // kept
  try {
    std::lock_guard<std::mutex> lock(mutex);
    auto fragment = std::make_unique<torch::Library>(
        torch::Library::IMPL, "NAMESPACE", c10::DispatchKey::Autograd, __FILE__, __LINE__);
    fragment->impl(name, torch::autograd::autogradNotImplementedFallback());
    fragments->push_back(std::move(fragment));
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}
"""


@functools.cache
def _no_backward() -> Callable[[bytes], int] | None:
    """The registration function of NO_BACKWARD_SOURCE, built once per cache and torch;
    None (with a note on stderr) where it cannot be built."""
    try:
        library = extension.build_library("codegen_no_backward",
                                NO_BACKWARD_SOURCE.replace("NAMESPACE", NAMESPACE),
                                full_torch=True)
        register = ctypes.CDLL(str(library)).codegen_register_no_backward
    except (BuildError, OSError, AttributeError) as e:  # not built, not loaded, no symbol
        log.warning("ops get a Python autograd kernel instead (%s)", e)
        return None
    register.argtypes, register.restype = [ctypes.c_char_p], ctypes.c_int
    return register
