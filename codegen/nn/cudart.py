"""The three CUDA runtime calls an offloaded Linear's call makes many times per forward:
record an event, make a stream wait for one, queue a host-to-device copy. Made here
directly on the CUDA runtime torch itself loaded (its streams and events are that
runtime's handles), each costs about a microsecond of host time; torch's wrappers
(``Event.record``, ``Stream.wait_event``, ``Tensor.copy_``) cost several, which a decode
step pays a dozen times per Linear.

``runtime()`` is None where that library cannot be found (torch built with the runtime
linked statically, a system without ``/proc``): the streamer then calls torch's wrappers.
"""

from __future__ import annotations

import ctypes
import functools

MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


class Runtime:
    """``cudaEventRecord``, ``cudaStreamWaitEvent`` and ``cudaMemcpyAsync`` (host to
    device), on raw handles (ints: ``Event.cuda_event``, ``Stream.cuda_stream``, data
    pointers); a call that fails raises ``RuntimeError`` with CUDA's message."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        for f in (lib.cudaEventRecord, lib.cudaStreamWaitEvent, lib.cudaMemcpyAsync):
            f.restype = ctypes.c_int
        self._record, self._wait, self._copy = (
            lib.cudaEventRecord, lib.cudaStreamWaitEvent, lib.cudaMemcpyAsync)

    def _failed(self, what: str, status: int) -> RuntimeError:
        self.lib.cudaGetLastError()  # cleared: torch checks it after its own launches
        message = self.lib.cudaGetErrorString(status).decode(errors="replace")
        return RuntimeError(f"codegen.nn.offload: {what} failed: {message} (CUDA error "
                            f"{status})")

    def record(self, event: int, stream: int) -> None:
        status = self._record(event, stream)
        if status:
            raise self._failed("cudaEventRecord", status)

    def wait(self, stream: int, event: int) -> None:
        status = self._wait(stream, event, 0)
        if status:
            raise self._failed("cudaStreamWaitEvent", status)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        status = self._copy(dst, src, nbytes, MEMCPY_HOST_TO_DEVICE, stream)
        if status:
            raise self._failed(f"cudaMemcpyAsync of {nbytes} bytes", status)


def loaded_library(maps: str) -> str | None:
    """The path of the one ``libcudart.so`` mapped in a process whose ``/proc/self/maps``
    reads ``maps``; None where there is none, or more than one."""
    fields = (line.split(None, 5) for line in maps.splitlines() if "/libcudart.so" in line)
    paths = {f[5].strip() for f in fields if len(f) == 6}  # the sixth field: the path
    return paths.pop() if len(paths) == 1 else None


@functools.cache
def runtime() -> Runtime | None:
    """The CUDA runtime torch loaded (importing torch maps it), or None (see the module)."""
    try:
        with open("/proc/self/maps") as f:
            path = loaded_library(f.read())
        return Runtime(ctypes.CDLL(path)) if path is not None else None
    except (OSError, AttributeError):
        return None
