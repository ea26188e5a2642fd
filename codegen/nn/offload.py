"""Offload a model's Linear weights to host memory in one line.

    import codegen.nn
    model = codegen.nn.offload(model, slices=8)    # in place; returns the model
    model(x)                                         # or model.generate(...)
    codegen.nn.report(model)                         # what the last forward moved

Every module of class exactly ``nn.Linear`` (``filter`` may narrow that; subclasses and
shared weights stay) keeps its weight and bias in one pinned host arena of exactly their
size (one allocation registered with ``cudaHostRegister``, not one pinned tensor per
weight: PyTorch's pinned allocator rounds each block up to a power of two): the biases
first, then the weights in the order the modules are registered. The rest of the model
(embeddings, norms, attention math, and Linears the filter leaves out) moves to the GPU.
The modules stay ``nn.Linear`` (their class becomes :class:`OffloadedLinear`, a
subclass), so transformers models work unchanged, ``generate()`` included.

Inference (no gradients needed) streams the arena by a copy plan (``plan.py``, run by
``streamer.py``): each forward copies it in spans of about ``copy_size`` bytes, across
Linear boundaries, into a GPU staging ring of ``staging`` bytes (by default half of the
largest decoder layer's offloaded weights; with ``optimize_for="prefill"`` all of them),
and each Linear's GEMM runs in pieces, one
per span its rows lie in, each waiting only for its span's copy. A copy is queued as soon
as the readers of the ring bytes it overwrites have been queued, so the copy engine runs
ahead of the GEMMs by up to the ring, across Linears, and at the end of a forward into
the first spans of the next one. The plan follows the order of the Linear calls, learnt
again when a forward calls them in another order. ``report(model).plan`` prints it as
host IR. A forward captured in a CUDA graph holds the same plan, the next forward's
first spans included, so replays stream back to back.

Calls that need gradients run one compiled host program per Linear dtype instead,
``linear(x, w, bias)`` with ``w`` in host memory, whose row blocks (``slices`` of them)
are copied into the thread's staging ring (``lower(..., staging="ring")``,
codegen/backend/include/codegen/ring.h) under the GEMMs of the slices before them.

Backward: the compiled programs have one (``codegen.runtime.autograd``), so an offloaded model
trains; a host weight gets its gradient in host memory.

Each Parameter stays the same object (its data moves into the arena: an optimizer made
before offloading still steps the weights the forward reads), each weight has a storage of
its own over its bytes of the arena (``torch.save`` writes each once, in any dtype), device
moves leave the weights in the arena and dtype changes are refused, and under
``torch.autocast`` a Linear computes in the autocast dtype: streamed where that is its
weight's, else with its weight copied whole and cast on the device (docs/offload.md,
"Working with an offloaded model").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import NoGPUError, ScheduleError
from ..frontend import ir, ops
from ..interp.evaluator import evaluate
from ..jit import CompiledOp, compile
from ..transforms.lowering import check_pool_size, lower
from . import program
from .plan import (
    ALIGN,
    Layout,
    Resident,
    StreamPlan,
    arena_row_bytes,
    parse_bytes,
    place,
    plan_stream,
    round_up,
)
from .quantize import FP8, check_format, pack_rows, quantize_weight, unsupported
from .quantize import row_bytes as quantized_row_bytes
from .streamer import SCRATCH_BYTES, ForwardCopies, Streamer

Filter = Callable[[str, nn.Linear], bool]


@dataclasses.dataclass
class Arena:
    """One host allocation holding the offloaded weights and biases, pinned (page-locked,
    registered with CUDA) where there is a GPU: ``nbytes`` is the sum of the tensors'
    bytes rounded up to ``ALIGN`` each, not a power of two."""

    storage: torch.Tensor  # uint8 [nbytes]
    pinned: bool

    @property
    def nbytes(self) -> int:
        return self.storage.numel()

    def tensor(self, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A tensor over the arena's bytes from ``offset``, with a storage of its own
        (exactly its bytes) that keeps the arena's memory alive: saving a weight writes its
        bytes, not the arena's, and weights of two dtypes share no storage (``torch.save``
        refuses that), where views of ``storage`` would do both. Made by DLPack from a
        view, so the storage's deleter is torch's C++ one, releasing the view (never Python
        code, which a holder freed at thread exit could not run)."""
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = count * dtype.itemsize
        view = self.storage[offset:offset + nbytes].view(dtype).view(shape)
        return torch.from_dlpack(view)


def _pin(storage: torch.Tensor) -> bool:
    """Registers ``storage``'s pages with CUDA (exact size), unregistered when it is freed."""
    if not torch.cuda.is_available() or storage.numel() == 0:
        return False
    cudart = torch.cuda.cudart()
    ptr = storage.data_ptr()
    status = cudart.cudaHostRegister(ptr, storage.numel(), 0)
    if int(status) != 0:
        raise RuntimeError(f"codegen.nn.offload: cudaHostRegister of {storage.numel()} bytes "
                           f"failed ({status}); is the host memory limit (ulimit -l) too low?")
    weakref.finalize(storage, cudart.cudaHostUnregister, ptr)
    return True


def _size(nbytes: int) -> str:
    """``nbytes`` in the unit that fits it, decimal like the line's GB/s: B, KB, MB or GB."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass
class Report:
    """What one forward of an offloaded model moved, and how close to the copy floor it ran.
    ``bytes_moved``: the offloaded bytes its Linear calls read; ``copies``: the copies that
    brought them (spans of the arena, or whole weights where a call ran unplanned);
    ``copy_floor_ms``: ``bytes_moved`` at the bandwidth of one pinned copy measured at
    ``offload`` time; ``floor_share``: that over the forward's time (1.0 = the forward took
    no longer than copying its weights alone); ``beyond_floor_ms``: the time the forward
    took beyond the copy floor; ``exposed_copy_ms``: how long the GPU's compute waited for
    copies (timed around each wait; 0 on the CPU and in a captured forward);
    ``staging_bytes``: the GPU memory the copies go through; ``unplanned_calls``: calls
    that ran off the copy plan (each weight copied whole: the first forward of a new call
    order, a call that needs gradients, a second thread's forward); ``restart``: why the
    copy stream started over at this forward's start, dropping what it had copied ahead
    (None where it read the copies queued during the forward before). ``quantize``: the
    weights' format in the arena (``bytes_moved`` counts their quantized bytes and
    scales); ``logits_error``: where ``report`` was given a reference model and inputs,
    max |logits - reference logits| / max |reference logits|. ``plan``: the copy plan
    (``print(report.plan)`` shows it as host IR), None without prefetch."""

    linears: int
    bytes_moved: int
    forward_ms: float
    gbps: float
    copy_floor_ms: float
    copy_gbps: float
    floor_share: float
    beyond_floor_ms: float
    copies: int = 0
    mean_copy_bytes: float = 0.0
    exposed_copy_ms: float = 0.0
    staging_bytes: int = 0
    unplanned_calls: int = 0
    restart: str | None = None
    quantize: str | None = None
    logits_error: float | None = None
    plan: StreamPlan | None = dataclasses.field(default=None, repr=False, compare=False)

    def line(self) -> str:
        copies = (f" in {self.copies} copies (mean {_size(self.mean_copy_bytes)})"
                  if self.copies else "")
        if self.quantize is not None:
            copies = f" as {self.quantize}{copies}"
        if math.isnan(self.copy_floor_ms):  # on the CPU: no copy floor
            return (f"codegen.nn.offload: {self.linears} Linear calls read "
                    f"{_size(self.bytes_moved)} of host weights{copies} in "
                    f"{self.forward_ms:.2f} ms (on the CPU: no copy floor)")
        return (f"codegen.nn.offload: {self.linears} Linear calls moved "
                f"{_size(self.bytes_moved)}{copies} in {self.forward_ms:.2f} ms "
                f"({self.gbps:.1f} GB/s); copy floor {self.copy_floor_ms:.2f} ms at "
                f"{self.copy_gbps:.1f} GB/s: {100 * self.floor_share:.0f}% of it, "
                f"{self.beyond_floor_ms:.2f} ms beyond, {self.exposed_copy_ms:.2f} ms "
                f"waiting for copies; staging {_size(self.staging_bytes)}")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "plan"}


@dataclasses.dataclass
class _Forward:
    """The counters and clocks of one forward of the root module."""

    started: float  # time.perf_counter() at its start
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None  # GPU events around it
    calls: int = 0
    bytes: int = 0
    ended: float = math.nan
    copies: ForwardCopies | None = None  # what the streamer counted, with prefetch
    program_copies: int = 0  # slices the compiled programs copied (calls with gradients)


class _State:
    """Per offloaded model: the arena, the programs, the measured copy bandwidth, the
    forward in flight in this thread (``current``: between the root's pre-hook and hook;
    Linears called outside it, such as the recomputed forwards of gradient checkpointing,
    are not counted), and the last ended forward not yet reported, of any thread
    (``pending``): a forward that raises never ends, and leaves the report at the last one
    that did."""

    def __init__(self, arena: Arena, device: torch.device, slices: int, pool_size: int,
                 prefetch: bool, verbose: bool) -> None:
        self.arena = arena
        self.device = device
        self.slices = slices
        self.pool_size = pool_size
        self.prefetch = prefetch
        self.verbose = verbose
        self.ops: dict[tuple[torch.dtype, bool, str], CompiledOp] = {}
        self.programs: dict[tuple[torch.dtype, bool], Any] = {}
        self.copy_gbps = 0.0
        self._local = threading.local()
        self.lock = threading.Lock()  # pending and last, which every thread's forwards set
        self.pending: _Forward | None = None
        self.last: Report | None = None
        self.streamer: Streamer | None = None  # with prefetch: the copy plan's runner
        self.index_of: dict[int, int] = {}  # id(weight) -> its Linear's index in the plan
        self.watched: list[torch.Tensor] = []  # the offloaded weights and biases
        self.versions: list[int] = []  # their version counters at the last forward's start
        self.placement: StreamPlan | None = None  # without a streamer: the resident Linears
        self.quantize: str | None = None
        self.quantized: dict[int, str] = {}  # id(weight) -> the name of a quantized Linear

    @property
    def plan(self) -> StreamPlan | None:
        """The copy plan now (learnt again when the call order changes), with the Linears a
        GPU budget keeps resident."""
        return self.streamer.plan if self.streamer is not None else self.placement

    @property
    def current(self) -> _Forward | None:
        """This thread's forward in flight: threads running forwards of the model at once
        each count their own Linear calls."""
        return getattr(self._local, "forward", None)

    @current.setter
    def current(self, forward: _Forward | None) -> None:
        self._local.forward = forward

    def __deepcopy__(self, memo: dict[int, Any]) -> _State:
        # A copy would share the hooks (they call this state) and hold its weights in a
        # second arena that no program of the copy knows; refuse it by name instead.
        raise ValueError("codegen.nn.offload: an offloaded model cannot be deep-copied (its "
                         "Linears share one pinned arena and one set of programs, and its "
                         "hooks are this model's); deep-copy the model before offloading it, "
                         "and offload the copy")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("codegen.nn.offload: an offloaded model cannot be pickled (as "
                        "torch.save(model) does): its Linears run programs of this process "
                        "over one pinned arena; save model.state_dict() (its weights are "
                        "plain tensors) and load it into a model offloaded again")

    def fusion(self, dtype: torch.dtype, bias: bool) -> ir.Fusion:
        name = f"offload_linear_{ir.DTYPE_NAMES[dtype]}{'_bias' if bias else ''}_s{self.slices}"
        return program.offload_linear(dtype, self.slices, bias, name=name)

    def run(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        key = (w.dtype, b is not None)
        args = [x, w] + ([b] if b is not None else [])
        name = self.quantized.get(id(w))
        if self.current is not None:  # a quantized weight moves its values and scales
            self.current.calls += 1
            self.current.bytes += (b.numel() * b.element_size() if b is not None else 0) + (
                self.streamer.plan.layouts[self.index_of[id(w)]].weight_bytes  # type: ignore[union-attr]
                if name is not None else w.numel() * w.element_size())
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in args)
        if name is not None:
            return self._run_quantized(x, w, b, name, needs_grad)
        if self.streamer is not None and not needs_grad:
            # The copy plan: spans of the arena copied ahead, GEMM pieces reading them.
            out = self.streamer.call(self.index_of[id(w)], x)
            return out if out is not None else self.streamer.unplanned(x, w, b)
        if self.current is not None:  # the program copies the weight's slices, the bias whole
            self.current.program_copies += min(self.slices, w.shape[0]) + (b is not None)
        if self.device.type == "cpu":  # the evaluator runs the same host program
            if key not in self.programs:
                self.programs[key] = lower(self.fusion(*key), pool_size=self.pool_size)
            return evaluate(self.programs[key], args)[0]
        # Gradients: the compiled program, which has a backward. Its staging ring's copies
        # run ahead of the caller's stream, across calls: eagerly only; a graph captures
        # the program with per-call staging slots instead.
        with torch.cuda.device(x.device):  # the stream of the device the op runs on
            capturing = torch.cuda.is_current_stream_capturing()
        staging = "ring" if self.prefetch and not capturing else "slots"
        if (*key, staging) not in self.ops:
            self.ops[(*key, staging)] = compile(self.fusion(*key), pool_size=self.pool_size,
                                                staging=staging)
        return self.ops[(*key, staging)](*args)

    def _run_quantized(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       name: str, needs_grad: bool) -> torch.Tensor:
        """A quantized Linear's call: by the copy plan (its pieces dequantized on the
        device as they arrive), or its arena rows copied whole and dequantized. Its weight
        has no gradient; a backward through the call is refused by name (``_NoBackward``)."""
        assert self.streamer is not None  # quantize needs prefetch
        index = self.index_of[id(w)]
        with torch.no_grad():
            out = self.streamer.call(index, x)
            if out is None:
                out = self.streamer.unplanned(x, w, b, index)
        if needs_grad:  # the bias too: a backward that reaches it is refused as well
            out = _NoBackward.apply(out, x, b, f"codegen.nn.offload: {name}", self.quantize)
        return out

    def run_cast(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
        """``F.linear`` in ``dtype`` (autocast's), where the weight is in another: the
        programs run in their weight's dtype, so the weight (and bias) is copied whole to
        ``x``'s device in its own dtype and cast there, not streamed by slices. The casts
        are torch's: gradients reach the host weight in its dtype."""
        if self.current is not None:
            self.current.calls += 1
            self.current.bytes += sum(t.numel() * t.element_size() for t in (w, b)
                                      if t is not None)

        def on_device(t: torch.Tensor) -> torch.Tensor:
            # Queued on the caller's stream (the arena is pinned), after any write there.
            return t.to(x.device, non_blocking=True).to(dtype)

        return F.linear(x, on_device(w), on_device(b) if b is not None else None)

    # -- the report around one forward of the root module (its pre-hook and hook)
    def begin(self, module: nn.Module, args: Any) -> None:
        self.order_host_writes()
        timing = None
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        if self.streamer is not None:
            self.streamer.begin()
        self.current = _Forward(started=time.perf_counter(), timing=timing)

    def order_host_writes(self) -> None:
        """Waits for the caller's stream before a forward whose offloaded weights or biases
        were written in place since the last one (an optimizer step, load_state_dict,
        ``w.copy_(src, non_blocking=True)`` under no_grad: each bumps the tensor's version
        counter). The ring's copies are not ordered after the caller's stream, and would
        read the bytes before a write queued there had finished. One version check per
        tensor; a synchronization only where one changed."""
        if not self.prefetch:  # per-call staging is forked from the caller's stream
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # a captured forward stages per call; the next eager one checks
        versions = [t._version for t in self.watched]
        if versions != self.versions:
            self.versions = versions
            self._synchronize()

    def _synchronize(self) -> None:
        """Waits for the current stream of the model's device (on the CPU, the evaluator
        has finished every write already)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def end(self, module: nn.Module, args: Any, output: Any) -> None:
        copies = self.streamer.end() if self.streamer is not None else None
        forward, self.current = self.current, None
        if forward is None or (self.device.type == "cuda" and forward.timing is None):
            return  # captured into a graph: nothing to time
        if forward.timing is not None:
            forward.timing[1].record()
        forward.ended = time.perf_counter()
        forward.copies = copies
        with self.lock:
            self.pending = forward
        if self.verbose:
            print(self.finish().line())  # type: ignore[union-attr]

    def finish(self) -> Report | None:
        with self.lock:  # held throughout: a forward that ends meanwhile is reported next
            return self._finish()

    def _finish(self) -> Report | None:
        forward, self.pending = self.pending, None
        if forward is None:
            return self.last
        if forward.timing is not None:
            forward.timing[1].synchronize()
            ms = forward.timing[0].elapsed_time(forward.timing[1])
        else:
            ms = (forward.ended - forward.started) * 1e3
        floor = forward.bytes / (self.copy_gbps * 1e6) if self.copy_gbps else math.nan
        copies = forward.copies
        plan = self.plan
        count = forward.program_copies + (copies.copies if copies is not None else 0)
        self.last = Report(
            linears=forward.calls, bytes_moved=forward.bytes, forward_ms=ms,
            gbps=forward.bytes / (ms * 1e6) if ms > 0 else math.nan, copy_floor_ms=floor,
            copy_gbps=self.copy_gbps, floor_share=floor / ms if ms > 0 else math.nan,
            beyond_floor_ms=ms - floor, copies=count,
            mean_copy_bytes=forward.bytes / count if count else 0.0,
            exposed_copy_ms=copies.exposed_ms() if copies is not None else 0.0,
            staging_bytes=plan.staging_bytes if plan is not None else 0,
            unplanned_calls=copies.unplanned_calls if copies is not None else 0,
            restart=copies.restart if copies is not None else None,
            quantize=self.quantize, plan=plan)
        return self.last


class OffloadedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight (and bias) live in the model's pinned host arena and
    whose forward runs the compiled program that streams them (see the module docstring).
    Under ``torch.autocast`` it computes in the autocast dtype (the input is cast, as
    autocast would), streaming its weight where that is the weight's dtype, else copying
    the weight whole and casting it on the device (fp32 master weights under bf16
    autocast); moving the model between devices leaves the weight in the arena, and a
    change of its dtype is refused."""

    _codegen: _State
    _codegen_name: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise ValueError(f"{self._where()}: the input must have at least one dim")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self._where()}: the input's last dim is {x.shape[-1]}, the Linear "
                             f"takes in_features = {self.in_features} (input shape "
                             f"{tuple(x.shape)}, weight shape {tuple(self.weight.shape)})")
        compute = self._codegen.device.type
        dtype = self._dtype()
        quantized = dtype is not self.weight.dtype
        out_dtype = None  # under autocast, a quantized Linear's output in autocast's dtype
        if torch.is_autocast_enabled(compute) and x.is_floating_point():
            autocast = torch.get_autocast_dtype(compute)
            if quantized:  # it computes in its weights' original dtype
                x, out_dtype = x.to(dtype), autocast
            elif autocast != dtype:  # fp32 master weights under bf16 autocast
                return self._codegen.run_cast(x.to(autocast), self.weight, self.bias, autocast)
            else:
                x = x.to(autocast)
        if x.dtype != dtype:
            raise ValueError(f"{self._where()}: the weight is {dtype}"
                             + (f" (streamed as {self._codegen.quantize})" if quantized else "")
                             + f", the input {x.dtype}; cast the input (as the model would "
                             "for a GPU-resident weight)")
        flat = x.flatten(0, -2) if x.dim() > 1 else x.unsqueeze(0)
        out = self._codegen.run(flat, self.weight, self.bias)
        out = out.to(out_dtype) if out_dtype is not None else out
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _where(self) -> str:
        return f"codegen.nn.offload: {self._codegen_name}"

    def _dtype(self) -> torch.dtype:
        """The dtype the Linear computes in: its weight's, or a quantized weight's
        original."""
        return self.__dict__.get("_codegen_dtype", self.weight.dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor],
               recurse: bool = True) -> OffloadedLinear:
        # model.to(device), .cuda(), .cpu(): the weight stays in the arena, streamed to
        # the device the model runs on. A new dtype would take it out of the arena.
        self._check_conversion(fn)
        return self

    def _check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Refuses ``fn`` (a Module._apply conversion) where it changes a dtype, tried on
        an empty tensor of each of this Linear's dtypes."""
        for key in ("weight", "bias"):
            t = getattr(self, key)
            dtype = self._dtype() if key == "weight" else t.dtype if t is not None else None
            converted = fn(torch.empty(0, dtype=dtype)) if t is not None else None
            if converted is not None and converted.dtype != dtype:
                raise ValueError(
                    f"{self._where()}.{key} is {dtype} in the offloaded model's pinned "
                    f"arena; converting it to {converted.dtype} would take it out; convert "
                    "the model before offloading it")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], *args: Any) -> None:
        # load_state_dict(assign=True) would put the loaded tensors in place of the arena's;
        # an offloaded weight takes the values into the arena instead.
        local_metadata = {**local_metadata, "assign_to_params_buffers": False}
        key = prefix + "weight"
        loaded = state_dict.get(key)
        if "weight_scale" not in self._buffers or not isinstance(loaded, torch.Tensor):
            super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)
            return
        # A quantized weight. Its own state dict (values and scales) loads as it is; the
        # unquantized weight of a checkpoint is quantized into the arena; anything else is
        # refused before any byte is written.
        dtype, kind = self._dtype(), self._codegen.quantize
        if loaded.dtype == self.weight.dtype and loaded.shape == self.weight.shape:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)
            return
        if loaded.dtype != dtype or tuple(loaded.shape) != (self.out_features,
                                                            self.in_features):
            raise ValueError(
                f"{self._where()}.weight is stored quantized to {kind}: it loads its own "
                f"state dict ({self.weight.dtype} {tuple(self.weight.shape)} with "
                f"weight_scale) or an unquantized weight ({dtype} "
                f"{(self.out_features, self.in_features)}), which it quantizes; got "
                f"{loaded.dtype} {tuple(loaded.shape)}")
        rest = {k: v for k, v in state_dict.items() if k not in (key, prefix + "weight_scale")}
        missing = args[1]  # (strict, missing_keys, unexpected_keys, error_msgs)
        before = len(missing)
        super()._load_from_state_dict(rest, prefix, local_metadata, *args)
        missing[before:] = [k for k in missing[before:]
                            if k not in (key, prefix + "weight_scale")]
        q, scale = quantize_weight(loaded.to(self.weight_scale.device), kind)
        values = pack_rows(q, scale, kind)[:, :self.weight.shape[1]]
        with torch.no_grad():  # through the Parameter and buffer: their versions move
            self.weight.copy_(values.view(self.weight.dtype))
            self.weight_scale.copy_(scale.view(self.weight_scale.shape))


class _NoBackward(torch.autograd.Function):
    """The output of a quantized Linear's call where gradients are on: the same values,
    and a backward that raises, naming the Linear (its weight has no gradient to give,
    and the input's would need the dequantized weight kept)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None,
                where: str, kind: str) -> torch.Tensor:
        ctx.where, ctx.kind = where, kind
        return out.clone()  # not a view: what follows may write it in place (ReLU(inplace))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"{ctx.where}: backward through a weight quantized to {ctx.kind} "
                           "is not supported (offload with quantize=None to train through "
                           "it, or run the forward under torch.no_grad())")


def _checked_apply(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                   recurse: bool = True) -> nn.Module:
    """``_apply`` of a module holding offloaded Linears: a dtype change they refuse is
    refused before any module is converted (not half-way through the model)."""
    if recurse:
        for m in module.modules():
            if isinstance(m, OffloadedLinear):
                m._check_conversion(fn)
    return type(module)._apply(module, fn, recurse)

def _bytes_of(t: torch.Tensor) -> tuple[str, int, int] | None:
    """The device and the byte range ``[start, end)`` that ``t``'s elements span, or None
    where it has no bytes to share (empty, on the meta device, not strided)."""
    if t.numel() == 0 or t.is_meta or t.layout != torch.strided:
        return None
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return str(t.device), start, start + (last + 1) * t.element_size()


def _shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    """The parameters (and buffers) that offloading one of would untie, each with the names
    of those it is shared with (its own included): one that two or more modules hold (a
    tied embedding, two tied Linears), and tensors whose bytes overlap
    (``b.weight = nn.Parameter(a.weight.data)``: two Parameters over one storage), found
    by the bytes they span, not by identity. Disjoint views of one storage share nothing."""
    names: dict[int, list[str]] = {}
    spans: list[tuple[str, int, int, int]] = []
    for prefix, m in model.named_modules():
        for key, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is None:
                continue
            if id(t) not in names:
                names[id(t)] = []
                span = _bytes_of(t)
                if span is not None:
                    spans.append((*span, id(t)))
            names[id(t)].append(f"{prefix}.{key}" if prefix else key)
    linked: dict[int, set[int]] = {k: set() for k in names}
    spans.sort()
    active: list[tuple[int, int]] = []  # (end, tensor) of the spans begun before this one
    for i, (device, start, end, k) in enumerate(spans):
        if i > 0 and spans[i - 1][0] != device:
            active = []
        active = [(e, j) for e, j in active if e > start]  # those still open overlap it
        for _, j in active:
            linked[k].add(j)
            linked[j].add(k)
        active.append((end, k))
    return {k: names[k] + [n for j in sorted(linked[k]) for n in names[j]]
            for k in names if len(names[k]) > 1 or linked[k]}


def _measure_copy_gbps(arena: Arena, device: torch.device, limit: int | None = None) -> float:
    """GB/s of one pinned copy of (up to 256 MiB, and up to ``limit`` bytes, of) the arena
    to the GPU, best of three."""
    if device.type != "cuda" or not arena.pinned:
        return 0.0
    n = min(arena.nbytes, 256 * 2**20, limit if limit else arena.nbytes)
    src = arena.storage[:n]
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    best = math.inf
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return n / (best * 1e6)


_ABSENT = object()


def _restorer(namespace: dict[str, Any], key: str) -> Callable[[], None]:
    """What puts ``namespace[key]`` back as it is now (absent included)."""
    previous = namespace.get(key, _ABSENT)

    def restore() -> None:
        if previous is _ABSENT:
            namespace.pop(key, None)
        else:
            namespace[key] = previous

    return restore


def _dotted(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _integer(value: Any, otherwise: Any = None) -> Any:
    """``value`` as an int where it is an integer of any type (numpy's included: a size
    computed with numpy) other than a bool, else ``otherwise``. The programs take plain
    ints (their digests have no form for numpy's)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return otherwise
    return int(value)


def offload(model: nn.Module, slices: int = 8, *, filter: Filter | None = None,  # noqa: A002
            device: str | torch.device = "cuda", pool_size: int = 4, prefetch: bool = True,
            staging: int | str | None = None, copy_size: int | str | None = None,
            gpu_budget: int | str | None = None, quantize: str | None = None,
            optimize_for: str = "decode", verbose: bool = False) -> nn.Module:
    """Offloads ``model``'s Linear weights to one pinned host arena and moves the rest to
    ``device``, in place; returns ``model``.

    ``slices``: stream slices of each weight (its output features); ``pool_size``: worker
    streams (and staging slots); ``filter(name, linear)`` says which Linears to offload
    (default: every one whose weight and bias share no memory with another module's,
    e.g. not a tied lm_head);
    ``device="cpu"`` runs every offloaded Linear on the CPU (the reference semantics, for
    tests). ``prefetch`` (the default): forwards stream the arena by a copy plan
    (``codegen/nn/plan.py``): copies of about ``copy_size`` bytes (default
    ``DEFAULT_COPY_BYTES``) across Linear boundaries, into a GPU staging ring of
    ``staging`` bytes (default: ``default_staging``, half of the largest decoder layer's
    offloaded weights; quantized, at least four of its largest weights),
    run ahead of the GEMM pieces that read them, into the next forward too (a forward
    whose offloaded weights were written in place since the last one first orders its
    copies after the caller's stream: docs/offload.md); calls that
    need gradients run the compiled programs, whose copies also run ahead (the thread's
    staging ring of ``pool_size + 1`` slices). ``prefetch=False``: every call runs its
    compiled program with staging of its own, forked from the caller's stream.
    ``gpu_budget`` (bytes, or a string such as ``"6GiB"``) bounds the GPU memory of the
    offloadable weights: the Linears it keeps resident (plain ``nn.Linear`` on
    ``device``, not in the arena) and the staging; the rest are streamed (``place`` in
    ``codegen/nn/plan.py`` says what the split optimizes; ``offload_plan(model)`` prints
    it). The rest of the model, activations and caches are not counted.
    ``staging``, ``copy_size`` and ``gpu_budget`` take bytes or strings such as
    ``"256MiB"``. ``optimize_for`` sizes the default staging for the step that matters:
    ``"decode"`` (the default: half a layer, the least that keeps the copies running, so
    that the fewest bytes are streamed and a decode step, bound by its copies, is
    fastest) or ``"prefill"`` (a whole layer: long prefills keep the copy engine running
    through the forward's tail and resident stretches; under a ``gpu_budget`` the larger
    ring is taken from the resident weights, so every step streams its extra bytes,
    without one it only takes more GPU memory; ``default_staging`` gives the
    measurements);
    ``staging=`` sets the ring itself instead. ``quantize`` (``"fp8"`` or ``"int4"``,
    ``codegen/nn/quantize.py``) stores each streamed weight quantized in the arena,
    quantized on the GPU one weight at a time, and dequantizes each run of pieces on the
    device after its copies; the weight Parameter then holds the quantized values (and
    ``weight_scale`` the scales), and a backward through it is refused. ``verbose`` prints
    :func:`report`'s line after each forward; :func:`report` returns it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"codegen.nn.offload expects an nn.Module, got {type(model).__name__}")
    if _integer(slices) is None or slices < 1:
        raise ScheduleError(f"codegen.nn.offload: slices must be an int >= 1, got {slices!r}")
    slices = int(slices)
    pool_size = _integer(pool_size, pool_size)
    check_pool_size("codegen.nn.offload", pool_size)
    if not isinstance(prefetch, bool):
        raise TypeError(f"codegen.nn.offload: prefetch must be True or False, got {prefetch!r}")
    staging_bytes = None if staging is None else parse_bytes("codegen.nn.offload: staging",
                                                             staging)
    copy_bytes = (None if copy_size is None else
                  parse_bytes("codegen.nn.offload: copy_size", copy_size))
    budget = (None if gpu_budget is None else
              parse_bytes("codegen.nn.offload: gpu_budget", gpu_budget))
    quantize = check_format(quantize)
    if optimize_for not in OPTIMIZE_FOR:
        raise ValueError(f"codegen.nn.offload: optimize_for must be 'decode' or 'prefill', "
                         f"got {optimize_for!r}")
    if optimize_for != "decode" and staging is not None:
        raise ValueError(f"codegen.nn.offload: staging={staging!r} sets the ring that "
                         f"optimize_for={optimize_for!r} would size; give one of them")
    if optimize_for != "decode" and not prefetch:
        raise ValueError(f"codegen.nn.offload: optimize_for={optimize_for!r} needs "
                         "prefetch=True (it sizes the copy plan's staging, which "
                         "prefetch=False does not use)")
    if quantize is not None and not prefetch:
        raise ValueError("codegen.nn.offload: quantize needs prefetch=True (the copy plan "
                         "dequantizes the pieces it streams; prefetch=False runs compiled "
                         "programs)")
    if budget is not None and not prefetch:
        raise ValueError("codegen.nn.offload: gpu_budget needs prefetch=True (the budget "
                         "bounds the copy plan's staging, which prefetch=False does not use)")
    if copy_bytes is not None and copy_bytes < 1:
        raise ValueError("codegen.nn.offload: copy_size must be at least 1 byte, got "
                         f"{copy_size!r}")
    if getattr(model, "_codegen_offload", None) is not None:
        raise ValueError("codegen.nn.offload: this model is offloaded already")
    for n, m in model.named_modules():
        if isinstance(m, OffloadedLinear) or getattr(m, "_codegen_offload", None) is not None:
            raise ValueError(f"codegen.nn.offload: {n} is offloaded already (offload was "
                             "called on a part of this model); offload a model once, from "
                             "its root, and narrow it with filter=")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cuda", "cpu"):
        raise ValueError(f"codegen.nn.offload: device must be 'cuda' (or 'cuda:<index>') or "
                         f"'cpu' (the evaluator), got {device!r}")
    device = parsed
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NoGPUError("codegen.nn.offload: device='cuda' needs a CUDA GPU; pass "
                           "device='cpu' to run the offloaded Linears through the evaluator")
    # Exactly nn.Linear: a subclass may have a forward of its own, and a Linear inside
    # nn.MultiheadAttention (a subclass) is never called: attention reads its weight.
    candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    shared = _shared_parameters(model)
    chosen = [(n, m) for n, m in candidates
              if (filter(n, m) if filter is not None else
                  type(m) is nn.Linear and id(m.weight) not in shared
                  and (m.bias is None or id(m.bias) not in shared))]
    if not chosen:
        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
        raise ValueError(
            f"codegen.nn.offload: no Linear of this {type(model).__name__} to offload: it has "
            f"{len(candidates)} nn.Linear module(s), "
            + ("the filter kept none" if filter is not None else
               "none of class exactly nn.Linear with a weight of its own")
            + ("; its Conv1D modules (transformers' GPT-2 style) are not nn.Linear"
               if conv1d else ""))
    for n, m in chosen:
        if type(m) is not nn.Linear:
            raise ValueError(f"codegen.nn.offload: {n} is a {type(m).__name__}, not an "
                             "nn.Linear: its forward (or the module that reads its weight) "
                             "would not run the offloaded program; leave it out with filter=")
        for key in ("weight", "bias"):
            t = getattr(m, key)
            if t is not None and id(t) in shared:
                others = ", ".join(x for x in shared[id(t)] if x != f"{n}.{key}")
                raise ValueError(
                    f"codegen.nn.offload: {n}.{key} is shared with another module ({others}: "
                    "a tied embedding or Linear, or a tensor over the same memory), which "
                    f"offloading it would untie; leave {n} out with filter=")
        meta = [k for k in ("weight", "bias")
                if getattr(m, k) is not None and getattr(m, k).is_meta]
        if meta:
            raise ValueError(f"codegen.nn.offload: {n}.{meta[0]} is on the meta device (no "
                             "values yet); load or initialize the model's weights before "
                             "offloading it")
        if m.weight.dtype not in ops.FLOAT_DTYPES:
            floats = ", ".join(ir.DTYPE_NAMES[d] for d in ops.FLOAT_DTYPES)
            raise ValueError(f"codegen.nn.offload: {n}.weight is {m.weight.dtype}; offloaded "
                             f"weights must be one of {floats}")
        if m.weight.dim() != 2 or tuple(m.weight.shape) != (m.out_features, m.in_features):
            raise ValueError(f"codegen.nn.offload: {n}.weight has shape "
                             f"{tuple(m.weight.shape)}; the Linear's out_features and "
                             f"in_features say ({m.out_features}, {m.in_features})")
        if m.bias is not None and tuple(m.bias.shape) != (m.out_features,):
            raise ValueError(f"codegen.nn.offload: {n}.bias has shape {tuple(m.bias.shape)}; "
                             f"the Linear's out_features say ({m.out_features},)")
        if m.bias is not None and m.bias.dtype != m.weight.dtype:
            # The program reads the bias in the weight's dtype: refused here, not at every
            # forward by the program's own argument check.
            raise ValueError(f"codegen.nn.offload: {n}.bias is {m.bias.dtype}, and an offloaded "
                             f"Linear needs it in its weight's dtype ({m.weight.dtype}); convert "
                             f"it before offloading ({n}.bias.data = {n}.bias.data.to("
                             f"{m.weight.dtype})), or leave {n} out with filter=")
    # Under a budget, the Linears it keeps stay plain nn.Linear and move to the device with
    # the rest of the model; the others are streamed.
    # Quantized where the format takes the weight; the others streamed as they are.
    quant = {id(m): quantize if quantize and unsupported(
        quantize, m.in_features, m.weight.dtype) is None else None for _, m in chosen}
    resident: list[tuple[str, nn.Linear]] = []
    if budget is not None:
        candidates = [_resident(n, m, quant[id(m)]) for n, m in chosen]
        keep, staging_bytes = place(candidates, budget, staging_bytes,
                                    default_staging(candidates, optimize_for))
        resident = [c for i, c in enumerate(chosen) if i in keep]
        chosen = [c for i, c in enumerate(chosen) if i not in keep]
    offloaded = {id(t) for _, m in chosen for t in (m.weight, m.bias) if t is not None}
    for prefix, module in model.named_modules():  # checked before anything changes
        for key, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and id(t) not in offloaded and t.is_meta:
                raise ValueError(
                    f"codegen.nn.offload: {_dotted(prefix, key)} is on the meta device (no "
                    f"values yet), and would move to {device} with the rest of the model; "
                    "load or initialize the model's weights and buffers before offloading it")
    # The arena: every bias first (one block, copied whole each forward), then the
    # weights in the order of ``chosen`` (the forward's order where it is registration's),
    # each at a multiple of ALIGN.
    tensors = ([(name, m, "bias") for name, m in chosen if m.bias is not None]
               + [(name, m, "weight") for name, m in chosen])
    def arena_bytes(m: nn.Linear, key: str) -> int:
        if key == "weight":  # rows of values, or of quantized values and their scales
            return m.out_features * arena_row_bytes(quant[id(m)], m.in_features, m.weight.dtype)
        return m.bias.numel() * m.bias.element_size()

    total = sum(round_up(arena_bytes(m, key), ALIGN) for _, m, key in tensors)
    arena = Arena(torch.empty(total, dtype=torch.uint8), pinned=False)
    arena.pinned = _pin(arena.storage) if device.type == "cuda" else False
    state = _State(arena, device, slices, pool_size, prefetch, verbose)
    # Each change to the model is recorded with what undoes it: where a step fails (a CUDA
    # out-of-memory error moving the rest of the model), the model is put back as it was,
    # its original tensors included, which are kept until the whole conversion has
    # succeeded. On the host that costs no peak memory with a GPU: the pinned arena is
    # resident from its registration, with every original still held. Originals on the
    # GPU are freed at the end instead of one by one, after the rest has moved there.
    undo: list[Callable[[], None]] = []
    step = f"measuring the copy bandwidth to {device}"
    try:
        # First, before anything changes: it allocates up to 256 MiB on the GPU.
        state.copy_gbps = _measure_copy_gbps(arena, device, limit=staging_bytes)
        offset = 0
        for name, m, key in tensors:
            t = getattr(m, key)
            step = f"copying {_dotted(name, key)} into the host arena"
            nbytes = arena_bytes(m, key)
            kind = quant[id(m)] if key == "weight" else None
            if kind is not None:
                step = f"quantizing {_dotted(name, key)} to {kind} into the host arena"
                held, scale = _quantized_into(arena, offset, t, kind, device,
                                              staging_bytes or QUANTIZE_BLOCK_BYTES)
                offloaded.add(id(scale))  # stays in the arena, not moved below
                undo += [functools.partial(t.requires_grad_, t.requires_grad),
                         _restorer(m._buffers, "weight_scale"),
                         _restorer(m.__dict__, "_codegen_dtype")]
                t.requires_grad_(False)
                m._buffers["weight_scale"] = scale
                m._codegen_dtype = t.dtype  # type: ignore[assignment]
            else:
                held = arena.tensor(offset, t.dtype, t.shape)
                held.copy_(t.detach())
            offset += round_up(nbytes, ALIGN)
            # The same Parameter, its data in the arena: an optimizer, hooks or a .grad
            # made before offloading still refer to the weight the forward reads.
            undo.append(functools.partial(setattr, t, "data", t.data))
            t.data = held
        for name, m in chosen:
            undo += [functools.partial(setattr, m, "__class__", type(m)),
                     _restorer(m.__dict__, "_codegen"), _restorer(m.__dict__, "_codegen_name")]
            m.__class__ = OffloadedLinear
            m._codegen = state  # type: ignore[attr-defined]
            m._codegen_name = name or "the model"  # type: ignore[attr-defined]
        for prefix, module in model.named_modules():
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) not in offloaded:
                    step = f"moving {_dotted(prefix, key)} to {device}"
                    undo.append(functools.partial(setattr, p, "data", p.data))
                    p.data = p.data.to(device)
            for key, b in list(module._buffers.items()):
                if b is not None and id(b) not in offloaded:
                    step = f"moving {_dotted(prefix, key)} to {device}"
                    undo.append(functools.partial(module._buffers.__setitem__, key, b))
                    module._buffers[key] = b.to(device)
        step = "setting up the offloaded model"
        above = {".".join(name.split(".")[:k]) for name, _ in chosen if name
                 for k in range(name.count(".") + 1)}  # "" is the root
        for name, module in model.named_modules():
            if name in above:
                undo.append(_restorer(module.__dict__, "_apply"))
                module._apply = types.MethodType(_checked_apply, module)  # type: ignore[method-assign]
        placed = tuple(_resident(n, m) for n, m in resident)
        state.quantize = quantize
        state.quantized = {id(m.weight): name or "the model" for name, m in chosen
                           if quant[id(m)] is not None}
        if prefetch and chosen:
            step = f"planning the copies and allocating their staging on {device}"
            state.streamer = _streamer(chosen, arena, device, staging_bytes, copy_bytes, quant,
                                       exact=budget is not None, resident=placed,
                                       budget=budget, copy_gbps=state.copy_gbps,
                                       optimize_for=optimize_for)
            state.index_of = {id(m.weight): i for i, (_, m) in enumerate(chosen)}
        else:
            state.placement = StreamPlan((), (), (), 0, 0, 0, placed, budget, state.copy_gbps,
                                         optimize_for)
        state.watched = [t for _, m in chosen
                         for t in (m.weight, m.bias, m._buffers.get("weight_scale"))
                         if t is not None]
        state.versions = [t._version for t in state.watched]  # filled by blocking copies
        undo.append(_restorer(model.__dict__, "_codegen_offload"))
        model._codegen_offload = state  # type: ignore[attr-defined]
        undo.append(model.register_forward_pre_hook(state.begin).remove)
        undo.append(model.register_forward_hook(state.end).remove)
    except BaseException as error:
        for action in reversed(undo):
            action()
        if not isinstance(error, Exception):  # KeyboardInterrupt: undone, and raised as is
            raise
        oom = isinstance(error, torch.cuda.OutOfMemoryError)
        raise (torch.cuda.OutOfMemoryError if oom else RuntimeError)(
            f"codegen.nn.offload: {step} failed ({type(error).__name__}: {error}); the model "
            "is as it was before the call (nothing offloaded, every tensor where it was); "
            + ("free GPU memory (or keep more of the model in host memory: offload more of "
               "its Linears) and offload it again" if oom else
               "offload it again once that is fixed")) from error
    return model


# GPU bytes the temporaries of quantizing a block of a weight's rows may take, where no
# staging bounds them (a budget's staging does).
QUANTIZE_BLOCK_BYTES = 256 * 2**20

# The copy size of the plan by default. On the H200, the 4-layer Llama of
# benchmarks/offload_llama.py ran its prefill of 512 tokens at 1.014 / 1.005 / 1.008 x the
# copy floor with copies of 16 / 32 / 64 MiB, and its decode step at 1.010 / 1.005 / 1.005
# (benchmarks/RESULTS.md, "Offload at the copy floor"); 32 MiB leaves a ring of half a
# decoder layer (208 MiB there) room for six copies in flight.
DEFAULT_COPY_BYTES = 32 * 2**20
# The steps a plan's default staging can be sized for (``default_staging``).
OPTIMIZE_FOR = ("decode", "prefill")


def _layer_of(name: str) -> str:
    """The decoder layer a module name belongs to: its name up to its first numeric part
    (``model.layers.3`` of ``model.layers.3.mlp.up_proj``); "" where there is none."""
    parts = name.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return ""


def _resident(name: str, m: nn.Linear, quant: str | None = None) -> Resident:
    return Resident(name or "the model", m.weight.dtype, m.out_features, m.in_features,
                    m.bias is not None, quant)


def _quantized_into(arena: Arena, offset: int, w: torch.Tensor, kind: str,
                    device: torch.device, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes weight ``w`` on ``device`` (the GPU where there is one: an 8B model in
    seconds) and writes its rows, values then scales, into the arena from ``offset``;
    returns the values (float8_e4m3fn [out, in], or int4 packed two a byte, uint8 [out,
    in / 2]) and the scales ([out], or [out, in / 128]), views of those rows. Rows go to
    the device in blocks whose temporaries (about 16 bytes an element) stay under
    ``limit`` bytes: scales are per row or per group of a row, so blocks of rows quantize
    exactly as the whole weight."""
    out, inp = w.shape
    row = quantized_row_bytes(kind, inp, w.dtype)
    raw = arena.storage[offset:offset + out * row].view(out, row)
    block = max(1, min(out, limit // (16 * max(inp, 1))))
    for r in range(0, out, block):
        q, scale = quantize_weight(w.detach()[r:r + block].to(device), kind)
        raw[r:r + block].copy_(pack_rows(q, scale, kind))
    n = inp if kind == "fp8" else inp // 2
    values = torch.from_dlpack(raw[:, :n])  # storages of their own (see Arena.tensor)
    scales = torch.from_dlpack(raw[:, n:]).view(w.dtype)
    if kind == "fp8":
        return values.view(FP8), scales.view(out)
    return values, scales


def default_staging(layouts: list[Layout] | list[Resident], optimize_for: str = "decode") -> int:
    """Half of the largest layer's offloaded bytes (layers named as ``_layer_of`` finds them; a
    model without numbered layers is one layer), and no more than a lap;
    ``optimize_for="prefill"``: the whole layer. A decode step is bound by its copies, so
    the least ring that keeps them running is fastest. A long prefill under a budget where
    the copies take about as long as the GEMMs is not: with half a layer the copy engine
    fills the ring and stops wherever the forward computes without streamed reads for longer
    than the ring's copy time (the tail: lm_head over every position, about 6 ms at 4096
    tokens of an 8B model; and resident stretches). Measured on the 8B-shaped model at a 50%
    budget (H100, four runs): prefill 4096 1.010-1.028x its bound with a whole layer
    against 1.044-1.075x with half, 0.3-2.7% faster; its decode step streams the 208 MiB
    more, 3-6% slower. A quantized model's floors below may exceed a whole layer already
    (the 8B model's: four weights, 224 MiB in fp8, 128 MiB in int4), and then both steps get
    the same ring. But at least four copies of ``DEFAULT_COPY_BYTES`` where a lap streams
    four times that: the layers of a quantized model are a half or a quarter of their bf16
    bytes, and half of one (54 MiB for an 8B model in int4) would cut the copies to 13 MiB,
    which the copy engine moves more slowly, each with a GEMM piece's host time (measured:
    the 8B model's int4 decode step at 2.7x its copy floor with a 54 MiB ring). And where
    weights are quantized, at least four of the largest (no more than a lap), each counted
    up to the quantized rows of one scratch (``SCRATCH_BYTES`` dequantized: an lm_head's
    128256 rows run as several GEMMs): a prefill's GEMM reads its scratch whole,
    dequantized, so its copies must all be in, and the ring holds the next ones meanwhile
    (measured: the 8B model's fp8 4096-token prefill 0.981x of a GEMM per piece with a 192
    or 256 MiB ring, 0.999x with 128 MiB)."""
    if optimize_for not in OPTIMIZE_FOR:
        raise ValueError(f"default_staging: optimize_for must be one of {OPTIMIZE_FOR}, got "
                         f"{optimize_for!r}")
    layers: dict[str, int] = {}
    for lay in layouts:  # each weight as it is streamed (quantized, where it is)
        key = _layer_of(lay.name)
        layers[key] = layers.get(key, 0) + round_up(lay.streamed_weight_bytes, ALIGN)
    lap = sum(layers.values())
    share = 1 if optimize_for == "prefill" else 2  # a whole layer, or half of one
    by_layer = min(max(layers.values(), default=0) // share, lap)
    least = 4 * DEFAULT_COPY_BYTES if lap >= 16 * DEFAULT_COPY_BYTES else 0
    whole = min(4 * max((round_up(_scratch_rows(lay) * lay.streamed_weight_bytes
                                  // lay.out_features, ALIGN)
                         for lay in layouts if lay.quant is not None), default=0), lap)
    return max(round_up(max(by_layer, least, whole), ALIGN), ALIGN)


def _scratch_rows(lay: Layout | Resident) -> int:
    """How many of ``lay``'s rows one scratch of a prefill's quantized call holds (all of
    them, or ``SCRATCH_BYTES`` of them dequantized)."""
    return max(min(lay.out_features, SCRATCH_BYTES // (lay.in_features * lay.dtype.itemsize)),
               1)


def default_copy_bytes(ring: int, widest: int, copies: int) -> int:
    """The copy size where ``copy_size`` is not given: ``DEFAULT_COPY_BYTES``, or less
    where a ring of ``ring`` bytes would hold fewer than ``copies`` of them in flight;
    at least one row of ``widest`` bytes."""
    return min(DEFAULT_COPY_BYTES, max(widest, (ring - ALIGN) // copies))


def _streamer(chosen: list[tuple[str, nn.Linear]], arena: Arena, device: torch.device,
              staging: int | None, copy_bytes: int | None,
              quant: dict[int, str | None] | None = None, *, exact: bool = False,
              resident: tuple[Resident, ...] = (), budget: int | None = None,
              copy_gbps: float = 0.0, optimize_for: str = "decode") -> Streamer:
    """The copy plan of ``chosen`` in their order, and its runner. Without ``copy_bytes``:
    ``DEFAULT_COPY_BYTES``, or less where the ring would hold fewer than four (two for a
    ``staging`` the user gave); without ``staging``: ``default_staging``, and at least a
    copy and a row more. ``exact``: ``staging`` is a budget's, held to (four copies in
    it where it can)."""
    base = arena.storage.data_ptr()
    layouts = [Layout(name or "the model", m._dtype() if isinstance(m, OffloadedLinear)
                      else m.weight.dtype, m.out_features, m.in_features,
                      m.weight.data_ptr() - base,
                      None if m.bias is None else m.bias.data_ptr() - base,
                      (quant or {}).get(id(m)))
               for name, m in chosen]
    bias_bytes = round_up(max((lay.bias_offset + lay.bias_bytes for lay in layouts
                               if lay.bias_offset is not None), default=0), ALIGN)
    ring = default_staging(layouts, optimize_for) if staging is None else staging
    widest = max((lay.row_bytes for lay in layouts), default=1)
    if copy_bytes is None:
        copy_bytes = default_copy_bytes(ring, widest, 4 if staging is None or exact else 2)
    if staging is None:
        ring = max(ring, max(copy_bytes, 1) + widest + ALIGN)
    plan = dataclasses.replace(
        plan_stream(layouts, list(range(len(layouts))), ring, copy_bytes, bias_bytes),
        resident=resident, budget=budget, copy_gbps=copy_gbps, optimize_for=optimize_for)
    return Streamer(plan, arena.storage, device,  # a quantized weight's scales are watched too
                    [(m.weight, m.bias, m._buffers.get("weight_scale")) for _, m in chosen])


def report(model: nn.Module, *, reference: nn.Module | None = None,
           inputs: Any = None) -> Report:
    """The report of ``model``'s last forward (waits for it to finish on the GPU). Given a
    ``reference`` model (the model before offloading or quantizing, wherever it runs) and
    ``inputs`` (a tensor, or a tuple of positional arguments), it first runs both on
    them under ``torch.no_grad()`` and reports that forward, with ``logits_error``: how
    far the offloaded model's output (its ``.logits`` where it has them) is from the
    reference's, max absolute difference over max absolute value."""
    state = getattr(model, "_codegen_offload", None)
    if state is None:
        raise ValueError("codegen.nn.report: this model was not offloaded with "
                         "codegen.nn.offload")
    if (reference is None) != (inputs is None):
        raise ValueError("codegen.nn.report: give both reference= (the unquantized model) "
                         "and inputs= to measure the logits' error, or neither")
    error = None
    if reference is not None:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        with torch.no_grad():
            got = _logits(model(*args)).float()
            first = next(iter(reference.parameters()), None)  # where the reference runs
            want = _logits(reference(*(a.to(first.device) if isinstance(a, torch.Tensor)
                                       and first is not None else a
                                       for a in args))).float().to(got.device)
        error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
    result = state.finish()
    if result is not None and error is not None:
        result = state.last = dataclasses.replace(result, logits_error=error)
    if result is None:
        raise ValueError("codegen.nn.report: the offloaded model has not run a forward yet")
    return result


def _logits(output: Any) -> torch.Tensor:
    """A model's output as one tensor: its ``.logits`` (transformers), its first element,
    or itself."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"codegen.nn.report: cannot read logits from a {type(output).__name__}")


def offload_plan(model: nn.Module) -> StreamPlan:
    """``model``'s copy plan now, before any forward too: which offloadable Linears are
    resident and which streamed, their bytes, the expected time of a forward
    (``plan.expected_ms(tokens)``, ``print(plan.placement())``), and the copies."""
    state = getattr(model, "_codegen_offload", None)
    if state is None:
        raise ValueError("codegen.nn.offload_plan: this model was not offloaded with "
                         "codegen.nn.offload")
    if state.plan is None:
        raise ValueError("codegen.nn.offload_plan: this model was offloaded with "
                         "prefetch=False: its calls run compiled programs, not a copy plan")
    return state.plan


def arena(model: nn.Module) -> Arena:
    """The pinned host arena of an offloaded model."""
    state = getattr(model, "_codegen_offload", None)
    if state is None:
        raise ValueError("codegen.nn.arena: this model was not offloaded")
    return state.arena
