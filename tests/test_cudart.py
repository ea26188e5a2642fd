"""codegen.nn.cudart: finding the CUDA runtime torch loaded, and its calls' errors."""

import pytest
import torch  # noqa: F401 - maps the CUDA runtime, as in any process that offloads

from codegen.nn import cudart


def test_the_one_mapped_libcudart_is_found():
    line = ("7f01a2c00000-7f01a2c2a000 r--p 00000000 fd:01 1234  "
            "/site-packages/nvidia/cu13/lib/libcudart.so.13")
    other = "7f01a2e00000-7f01a2e2a000 r-xp 00000000 fd:01 99  /usr/lib/libc.so.6"
    assert cudart.loaded_library("\n".join([line, line.replace("r--p", "r-xp"), other])) == (
        "/site-packages/nvidia/cu13/lib/libcudart.so.13")
    assert cudart.loaded_library(other) is None
    assert cudart.loaded_library("\n".join([line, line.replace("cu13", "cu12")])) is None
    anonymous = "7f01a2c00000-7f01a2c2a000 rw-p 00000000 00:00 0"
    assert cudart.loaded_library(anonymous) is None


def test_a_failed_call_raises_with_cudas_message():
    rt = cudart.runtime()
    if rt is None:
        pytest.skip("this torch links the CUDA runtime statically (no libcudart.so mapped)")
    # No event (a null handle) on any machine: no GPU, or an invalid handle.
    with pytest.raises(RuntimeError, match=r"codegen.nn.offload: cudaEventRecord failed: "
                                           r".+ \(CUDA error \d+\)"):
        rt.record(0, 0)
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync of 8 bytes failed"):
        rt.copy(0, 0, 8, 0)
