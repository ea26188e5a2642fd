// codegen runtime: everything a generated program includes, in one header that the
// build precompiles once per cache (codegen/jit/precompiled.py), so a program compiles in
// about a second. One header per concern:
//   check.h      messages and the CG_CHECK macro
//   tensor.h     strided views, argument checks, allocation
//   stream.h     the caller's stream, leased worker streams, fork/join events
//   math_mode.h  torch's matmul precision flags
//   gemm.h       the program's GEMMs (cuBLAS fallback), gemm_plan.h its cuBLASLt plans
//   collective.h all-gather and reduce-scatter of a slice through torch.distributed
//   host.h       host-resident inputs and outputs: checks, pinned outputs, keep-alive
//   copy.h       host <-> GPU copies of strided slices, staging slots
//   ring.h       the thread's staging ring: copies that run ahead across calls
//   pointwise.h  elementwise kernels, compiled by NVRTC at run time
//   nvtx.h       NVTX ranges named for host-IR lines
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include "codegen/check.h"
#include "codegen/collective.h"
#include "codegen/copy.h"
#include "codegen/gemm.h"
#include "codegen/host.h"
#include "codegen/math_mode.h"
#include "codegen/nvtx.h"
#include "codegen/pointwise.h"
#include "codegen/ring.h"
#include "codegen/stream.h"
#include "codegen/tensor.h"
