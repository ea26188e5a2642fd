"""A 4-layer transformers Llama whose decoder Linear weights live in host memory.

    python -m benchmarks.offload_llama [--tokens 512,4096,1] [--rounds N]
                                       [--variants codegen,prefetch,...] [--out DIR]
                                       [--dry-run]

h 4096, i 14336, 32 heads, 8 kv heads, vocab 32000, bf16, random weights; the decoder
layers' Linear weights (1.63 GiB) in pinned host memory, embeddings, norms and lm_head on
the GPU. Every variant has its own model, built from one config with one seed (offloading
changes a model in place):

- codegen: ``codegen.nn.offload(model, slices=8, filter=<decoder Linears>)`` with its
  default settings (one compiled program per Linear call, streaming its weight in slices
  under its GEMMs; with offload()'s prefetch, the next Linear's copies queue behind this
  one's, across forwards too);
- codegen_noprefetch: the same with ``prefetch=False`` (each call stages its own slices;
  only where offload() takes ``prefetch``);
- codegen_s<N> (any N, e.g. codegen_s4): codegen with ``slices=N``;
- codegen_c<N> (any N, e.g. codegen_c64): codegen with copies of N MiB
  (``copy_size=N * 2**20``) instead of the default;
- accelerate: ``accelerate.cpu_offload`` of each decoder layer (its hooks copy each weight
  from pageable host memory when the layer runs), where accelerate is installed;
- prefetch: a hand-written layer prefetch in PyTorch (``LayerPrefetch``): two GPU buffer
  sets of one decoder layer's Linear weights each; a side stream copies layer l+1 into one
  while layer l reads the other, the last layer starts layer 0 of the next forward;
- prefetch_per_forward: the same without the copy across forwards
  (``LayerPrefetch(model, wrap=False)``), the plain form of this prefetch: the last layer
  starts no copy, so each forward waits for its first layer's copy (exposed at every
  forward);
- gpu: the model with every weight on the GPU;
- copy: the offloaded bytes copied alone from pinned memory, one copy per weight into a
  preallocated GPU buffer, back to back on one stream (the floor);
- codegen_fp8, codegen_int4: codegen with ``quantize="fp8"`` / ``"int4"`` (each weight
  streamed quantized and dequantized on the GPU as its pieces arrive);
- copy_fp8, copy_int4: the bytes that variant streams (values and scales), copied alone
  from its arena, one copy per weight, back to back (the floor of the quantized bytes).

``--tokens``: prefills of that many tokens (no KV cache); 1 is the decode step instead:
one token after a 512-token prompt, with a KV cache (``DecodeStep``: a ``DynamicCache``,
each call eager), for codegen, both prefetches, gpu, copy and the quantized rows. Where
codegen is timed, the decode step also has the row

- codegen_graph: a model offloaded as codegen's (an arena and staging of its own: an
  eager forward of a model that has been captured joins its copies at its end, so that a
  replay after it finds the next forward's first spans in place) decoding the same token
  at the same position from a CUDA graph, replayed per call (``GraphDecodeStep``). A
  graph needs a ``StaticCache`` (``codegen.nn.StaticDecodeStep``: keys and values
  preallocated for prompt + 1 positions and written in place, so the attention reads as
  many positions as the eager step's). The graph holds the copy plan of an eager forward,
  the next forward's first spans included, so replays stream back to back. The eager
  rows keep generation's ``DynamicCache``: its concatenation of the 513 positions' keys
  and values (about 8 MiB a step) is small beside the weights' copies.

``--generate N`` adds the generate step: greedy ``generate`` of N new tokens after the
512-token prompt (a ``DynamicCache``, the host reading each token between steps), for
codegen, both prefetches and gpu; ms per token is the difference between generating N + 1
and 1 tokens (the prompt's prefill), over N, and the copy floor's row is one forward's copy.

Each step times its variants in rounds after a warm-up, every variant once per round in
a rotated order, the device synchronized before each block (a variant's side-stream
copies must not run under the next variant's block), several forwards back to back per
block; ms is the median over rounds, the ratios the medians of per-round ratios to the
copy floor and to accelerate.

gpu_mib: the forward's peak GPU memory above what was allocated before it
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), plus what the
variant keeps allocated between forwards beyond its resident model (prefetch's buffer
sets, the copy floor's buffers, whatever offload() keeps); the KV cache of the decode
step's prompt is not counted. host_mib: pinned host memory the variant holds for the
offloaded weights (offload()'s registered arena plus pinned-allocator growth while the
variant was set up; accelerate's host copies are pageable, so it holds none). For
codegen_graph, gpu_mib is codegen's kept bytes plus the graph's memory pool (the GPU
memory its capture reserved) plus a replay's peak (none: a replay allocates nothing);
host_mib is codegen's arena.

Writes offload_llama.json (rows: tokens, step, kv_cache, cache, graph, variant, ms,
ratio_copy, ratio_floor (to the row's own floor: copy_<kind> for a quantized row, copy
otherwise), ratio_accelerate, over_prefetch (the prefetch row's ms over the row's: tokens/s
over the hand-written prefetch's, the one that copies across forwards), gpu_mib, host_mib;
cache is the decode step's KV cache, "dynamic" or "static", None in a prefill and for the
copy floor; graph whether the row replays a CUDA graph) to --out and prints the table.
Needs a CUDA GPU (``--dry-run`` does not: it prints what would run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib.util
import inspect
import json
import math
import re
import statistics
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import codegen.nn
from benchmarks.common import (
    RESULTS,
    Block,
    arena_copies,
    bind,
    build,
    estimate_ms,
    generate_ms,
    is_decoder_linear,
    llama_config,
    median_ratio,
    peak_mib,
    reps_for,
    rotated,
    run_rounds,
    warm_up,
)
from codegen.nn import StaticDecodeStep, cache_keyword, capture_graph

QUANTIZED = ("fp8", "int4")  # codegen_<kind>: offload(..., quantize=kind); copy_<kind>: its floor
VARIANTS = ("codegen", "codegen_noprefetch", "accelerate", "prefetch", "prefetch_per_forward",
            "gpu", "copy", *(f"{v}_{k}" for k in QUANTIZED for v in ("codegen", "copy")))
DECODE_VARIANTS = ("codegen", "prefetch", "prefetch_per_forward", "gpu", "copy",
                   *(f"{v}_{k}" for k in QUANTIZED for v in ("codegen", "copy")))
GRAPHED = {"codegen_graph": "codegen"}  # a decode row replayed from a CUDA graph: its variant
DECODE_PROMPT = 512  # tokens in the KV cache of the decode step
SEED = 0
SETS = 2  # buffer sets of the hand-written prefetch: the layer that runs, the one copied
ALIGN = 256  # bytes: where each weight starts in a buffer set (as offload()'s arena)


# ---------------------------------------------------------------------------- the model


def decoder_linears(model: Any) -> list[list[torch.nn.Linear]]:
    """Each decoder layer's Linears, in module order."""
    return [[m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
            for layer in model.model.layers]


def forward(model: Any, ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
    """A prefill forward without a KV cache; the logits (with ``logits_to_keep``, of the
    last that many positions only, as ``generate``'s prefill keeps one)."""
    keep = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
    with torch.no_grad():
        return model(ids, use_cache=False, **keep).logits


class DecodeStep:
    """One decode step per call: one token forwarded at position ``prompt`` length with a
    KV cache (a ``transformers.DynamicCache``) holding the prompt's keys and values.

    The prompt's cache is made once, untimed. Each call is a real one-token step: the
    cache appends the token's keys and values (a concatenation, as in generation) and the
    attention reads all prompt + 1 positions; then ``crop(-1)`` drops that token again (a
    view, no copy), so every call sees the same prompt-long prefix. ``crop(-1)`` removes
    the last token under both crop signatures transformers has had (``max_length``,
    negative counting from the end, and ``tokens_to_remove``); the constructor checks
    that it does."""

    def __init__(self, model: Any, prompt: torch.Tensor, token: torch.Tensor) -> None:
        import transformers

        self.model, self.token, self.length = model, token, prompt.shape[1]
        self.keyword = cache_keyword(model)
        self.cache = transformers.DynamicCache()
        with torch.no_grad():
            model(prompt, use_cache=True, **{self.keyword: self.cache})
        for _ in range(2):  # the prompt's cache, and after a step and its crop
            if self.cache.get_seq_length() != self.length:
                raise RuntimeError(f"DecodeStep: the KV cache holds "
                                   f"{self.cache.get_seq_length()} tokens, expected "
                                   f"{self.length}; DynamicCache.crop(-1) did not drop "
                                   "the decoded token in this transformers release")
            self()

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(self.token, use_cache=True, **{self.keyword: self.cache})
        self.cache.crop(-1)
        return out.logits


class GraphDecodeStep:
    """``DecodeStep``'s step replayed from a CUDA graph: a ``StaticDecodeStep`` over a
    cache of prompt + 1 positions, ``token`` at position prompt length, captured once
    (``capture_graph``: its warm-up calls write the same token at the same position) and
    replayed per call. Each replay rewrites that position, so every call sees the
    prompt-long prefix, as ``DecodeStep``'s calls do. ``pool_bytes``: the GPU memory the
    capture reserved (the graph's memory pool, kept with the graph)."""

    def __init__(self, model: Any, prompt: torch.Tensor, token: torch.Tensor) -> None:
        self.step = StaticDecodeStep(model, prompt, token, max_len=prompt.shape[1] + 1)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what stays reserved after the capture is the graph's
        reserved = torch.cuda.memory_reserved()
        self.graph, self.logits = capture_graph(self.step)
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


# ---------------------------------------------------------------------------- the prefetch


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """Where each decoder layer's Linear weights lie in a buffer set: ``offsets[l][j]``
    is the element offset of layer l's j-th weight; a set holds ``numel`` elements (the
    largest layer)."""

    numel: int
    offsets: list[list[int]]


def plan_buffers(shapes: Sequence[Sequence[tuple[int, ...]]], element_size: int,
                 align: int = ALIGN) -> BufferPlan:
    """The layout of one buffer set for weights of ``shapes[l][j]`` (layer l, Linear j):
    each layer's weights back to back from offset 0, each starting at a multiple of
    ``align`` bytes (the GEMMs read aligned operands; one alignment for every layer so
    that any layer fits any set)."""
    if align % element_size:
        raise ValueError(f"plan_buffers: align {align} is not a multiple of the element "
                         f"size {element_size}")
    step = align // element_size
    offsets, numel = [], 0
    for layer in shapes:
        at, row = 0, []
        for shape in layer:
            row.append(at)
            at += -(-math.prod(shape) // step) * step
        offsets.append(row)
        numel = max(numel, at)
    return BufferPlan(numel, offsets)


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy decoder layer ``layer``'s weights into buffer set ``buf`` on the side stream.
    ``urgent``: nothing was prefetched for the layer about to run (the first call, or a
    call out of order), so the side stream waits for all the compute stream has queued;
    otherwise it waits only for ``buf``'s release (the end of the layer that last read
    it)."""

    layer: int
    buf: int
    urgent: bool = False


@dataclasses.dataclass(frozen=True)
class Use:
    """The compute stream waits for the last copy into ``buf``; layer ``layer``'s Linears
    read their weights from ``buf``."""

    layer: int
    buf: int


@dataclasses.dataclass(frozen=True)
class Release:
    """The layer reading ``buf`` is queued: the compute stream records ``buf``'s release."""

    buf: int


class PrefetchSchedule:
    """What each decoder-layer call does in the hand-written prefetch, in plain Python:
    call c (counted over forwards) reads buffer set c % sets and, before it runs, starts
    the copy of the next layer (after the last layer, layer 0 of the next forward) into
    set (c + 1) % sets, so that copy runs under this call. With ``wrap=False`` the last
    layer starts no copy: layer 0 is copied urgently when it is called, at every forward,
    even where a set still holds it from an earlier forward. ``LayerPrefetch`` carries
    the actions out with CUDA streams and events."""

    def __init__(self, layers: int, sets: int = SETS, *, wrap: bool = True) -> None:
        if layers < 1 or sets < 2:
            raise ValueError(f"PrefetchSchedule: need layers >= 1 and sets >= 2, got "
                             f"{layers}, {sets}")
        self.layers, self.sets, self.wrap = layers, sets, wrap
        self.calls = 0
        self.holds: dict[int, int] = {}  # buffer set -> the layer last copied into it
        self.running: Use | None = None

    def before(self, layer: int) -> list[Copy | Use]:
        """The actions before decoder layer ``layer`` runs, in order."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"PrefetchSchedule: layer {layer} of {self.layers}")
        if self.running is not None:
            raise RuntimeError(f"PrefetchSchedule: layer {layer} called while layer "
                               f"{self.running.layer} runs")
        buf, nxt = self.calls % self.sets, (self.calls + 1) % self.sets
        actions: list[Copy | Use] = []
        if self.holds.get(buf) != layer or (layer == 0 and not self.wrap):
            actions.append(Copy(layer, buf, urgent=True))
        self.running = Use(layer, buf)
        actions.append(self.running)
        if self.wrap or layer + 1 < self.layers:
            actions.append(Copy((layer + 1) % self.layers, nxt))
        for a in actions:
            if isinstance(a, Copy):
                self.holds[a.buf] = a.layer
        return actions

    def after(self, layer: int) -> list[Release]:
        """The actions after decoder layer ``layer`` has been called."""
        if self.running is None or self.running.layer != layer:
            raise RuntimeError(f"PrefetchSchedule: layer {layer} ended but was not running")
        buf, self.running = self.running.buf, None
        self.calls += 1
        return [Release(buf)]


class LayerPrefetch:
    """The hand-written layer prefetch: every decoder Linear's weight goes to its own
    pinned host tensor; two GPU buffer sets hold one decoder layer's weights each
    (``plan_buffers``); forward pre-hooks on the decoder layers point each Linear's
    ``weight.data`` at its view in the set ``PrefetchSchedule`` names and start the next
    layer's copies on a side stream; forward hooks record the set's release. Events
    order each copy before the layer that reads it, and each copy after the layer that
    last read its set. ``wrap``: whether the last layer starts layer 0's copy for the next
    forward (``PrefetchSchedule``). The model itself runs unchanged. On the CPU (tests)
    the copies are synchronous and there are no streams."""

    def __init__(self, model: Any, wrap: bool = True) -> None:
        device = model.model.embed_tokens.weight.device
        self.linears = decoder_linears(model)
        dtype = self.linears[0][0].weight.dtype
        if any(m.weight.dtype != dtype for ms in self.linears for m in ms):
            raise ValueError("LayerPrefetch: the decoder Linears' weights differ in dtype")
        shapes = [[tuple(m.weight.shape) for m in ms] for ms in self.linears]
        self.plan = plan_buffers(shapes, dtype.itemsize)
        cuda = device.type == "cuda"
        self.host = [[torch.empty(m.weight.shape, dtype=dtype, pin_memory=cuda)
                      .copy_(m.weight.detach()) for m in ms] for ms in self.linears]
        self.sets = [torch.empty(self.plan.numel, dtype=dtype, device=device)
                     for _ in range(SETS)]
        self.views = [[[s[o:o + math.prod(shape)].view(shape)
                        for o, shape in zip(offsets, layer_shapes)]
                       for offsets, layer_shapes in zip(self.plan.offsets, shapes)]
                      for s in self.sets]
        for ms, views in zip(self.linears, self.views[0]):
            for m, v in zip(ms, views):
                m.weight.data = v  # the original (GPU) weight is freed here
        self.schedule = PrefetchSchedule(len(self.linears), wrap=wrap)
        self.side = torch.cuda.Stream(device) if cuda else None
        self.copied = [torch.cuda.Event() for _ in self.sets] if cuda else []
        self.released = [torch.cuda.Event() for _ in self.sets] if cuda else []
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(functools.partial(self._before, i))
            layer.register_forward_hook(functools.partial(self._after, i))

    @property
    def nbytes(self) -> int:
        """GPU bytes of the buffer sets."""
        return sum(s.numel() * s.element_size() for s in self.sets)

    def _before(self, layer: int, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook of decoder layer ``layer``: its weights, the next layer's copy."""
        for a in self.schedule.before(layer):
            if isinstance(a, Copy):
                self._copy(a)
            else:
                self._use(a)

    def _after(self, layer: int, module: torch.nn.Module, args: Any, out: Any) -> None:
        """Forward hook of decoder layer ``layer``: records the release of its set."""
        for a in self.schedule.after(layer):
            if self.side is not None:
                self.released[a.buf].record(torch.cuda.current_stream())

    def _copy(self, a: Copy) -> None:
        """Queues layer ``a.layer``'s weights into set ``a.buf`` on the side stream (on the
        CPU: copies them)."""
        dst, src = self.views[a.buf][a.layer], self.host[a.layer]
        if self.side is None:
            for d, h in zip(dst, src):
                d.copy_(h)
            return
        if a.urgent:  # the layer about to run waits anyway; layers queued may read the set
            self.side.wait_stream(torch.cuda.current_stream())
        else:
            self.side.wait_event(self.released[a.buf])
        with torch.cuda.stream(self.side):
            for d, h in zip(dst, src):
                d.copy_(h, non_blocking=True)
        self.copied[a.buf].record(self.side)

    def _use(self, a: Use) -> None:
        """Makes the compute stream wait for set ``a.buf``'s copy and points layer
        ``a.layer``'s Linears at their views in it."""
        if self.side is not None:
            torch.cuda.current_stream().wait_event(self.copied[a.buf])
        for m, v in zip(self.linears[a.layer], self.views[a.buf][a.layer]):
            m.weight.data = v


# ---------------------------------------------------------------------------- variants


def offload_takes_prefetch() -> bool:
    """Whether ``codegen.nn.offload`` has a ``prefetch`` keyword."""
    return "prefetch" in inspect.signature(codegen.nn.offload).parameters


def pinned_host_bytes() -> int:
    """Bytes the pinned host allocator owns now (0 where torch does not report it)."""
    if not hasattr(torch.cuda, "host_memory_stats"):
        return 0
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def resident_bytes(model: Any, exclude: Sequence[torch.Tensor] = ()) -> int:
    """GPU bytes of ``model``'s parameters and buffers, each storage once, leaving out
    the storages of ``exclude`` (the prefetch's buffer sets)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cuda":
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@dataclasses.dataclass
class Variant:
    """One variant, set up: its model (None for the copy floor), its call where it has no
    model, what must stay alive with it (the prefetch and its hooks), the GPU bytes it
    keeps beyond its resident model, the pinned host bytes it holds, and how far its
    logits are from the GPU-resident model's (max abs difference over max abs logit)."""

    name: str
    model: Any = None
    call: Callable[[], Any] | None = None
    keep: Any = None
    held_bytes: int = 0
    host_bytes: int = 0
    error: float | None = None


def make(name: str, config: Any, shapes: list[list[tuple[int, ...]]],
         built: dict[str, Variant]) -> Variant:
    """Variant ``name``, built (``shapes``: the decoder Linears' weight shapes, for the
    copy floor; ``built``: the variants set up before it, a quantized floor's model
    among them)."""
    if name == "copy":
        host = [torch.zeros(s, dtype=torch.bfloat16, pin_memory=True)
                for layer in shapes for s in layer]
        dev = [torch.empty_like(w, device="cuda") for w in host]

        def copies() -> None:
            """Every offloaded weight copied to its GPU buffer, back to back."""
            for w, d in zip(host, dev):
                d.copy_(w, non_blocking=True)
        return Variant(name, call=copies)
    if _quantized(name) and name.startswith("copy"):
        return copy_floor(built[f"codegen_{_quantized(name)}"])
    model = build(config)
    if name == "gpu":
        return Variant(name, model)
    if _quantized(name):
        return Variant(name, codegen.nn.offload(model, slices=8, filter=is_decoder_linear,
                                                quantize=_quantized(name)))
    if name == "codegen" or _slices(name) or _copy_mib(name) or name in GRAPHED:
        copy_mib = _copy_mib(name)
        return Variant(name, codegen.nn.offload(
            model, slices=_slices(name) or 8, filter=is_decoder_linear,
            copy_size=copy_mib * 2**20 if copy_mib else None))
    if name == "codegen_noprefetch":
        return Variant(name, codegen.nn.offload(model, slices=8, filter=is_decoder_linear,
                                                prefetch=False))
    if name == "accelerate":
        import accelerate

        for layer in model.model.layers:
            layer.cpu()
            accelerate.cpu_offload(layer, execution_device=torch.device("cuda"))
        return Variant(name, model)
    if name in ("prefetch", "prefetch_per_forward"):
        return Variant(name, model, keep=LayerPrefetch(model, wrap=name == "prefetch"))
    raise ValueError(f"unknown variant {name!r}")


def copy_floor(source: Variant) -> Variant:
    """The bytes ``source`` (a quantized variant) streams a forward, copied alone from
    its arena, each weight whole, back to back: the floor of its quantized bytes."""
    return Variant(source.name.replace("codegen", "copy", 1), call=arena_copies(source.model))


def _quantized(name: str) -> str | None:
    """The format of a ``codegen_<kind>`` or ``copy_<kind>`` variant, else None."""
    found = re.fullmatch(r"(?:codegen|copy)_(fp8|int4)", name)
    return found.group(1) if found else None


def _floor_of(name: str) -> str:
    """The copy floor row a variant's ``ratio_floor`` is taken to: its quantized bytes'
    for a quantized variant, else the bf16 weights'."""
    kind = _quantized(name)
    return f"copy_{kind}" if kind else "copy"


def _slices(name: str) -> int | None:
    """N of a ``codegen_s<N>`` variant, else None."""
    found = re.fullmatch(r"codegen_s([1-9][0-9]*)", name)
    return int(found.group(1)) if found else None


def _copy_mib(name: str) -> int | None:
    """N of a ``codegen_c<N>`` variant (copies of N MiB), else None."""
    found = re.fullmatch(r"codegen_c([1-9][0-9]*)", name)
    return int(found.group(1)) if found else None


def _codegen(name: str) -> bool:
    """Whether variant ``name`` is a model offloaded by codegen."""
    return name.startswith("codegen")


def set_up(name: str, config: Any, shapes: list[list[tuple[int, ...]]], ids: torch.Tensor,
           reference: torch.Tensor | None,
           built: dict[str, Variant]) -> tuple[Variant, torch.Tensor | None]:
    """Builds variant ``name`` and runs one prefill of ``ids`` (which also compiles and
    allocates what the first forward does); measures the GPU bytes it keeps beyond its
    resident model and the pinned host bytes it took; compares its logits with
    ``reference``. Returns the variant and its logits (None for the copy floor)."""
    gc.collect()
    torch.cuda.synchronize()
    gpu0, host0 = torch.cuda.memory_allocated(), pinned_host_bytes()
    v = make(name, config, shapes, built)
    logits, resident = None, 0
    if v.model is not None:
        logits = forward(v.model, ids)
        if reference is not None:
            v.error = ((logits.float() - reference.float()).abs().max()
                       / reference.float().abs().max()).item()
        exclude = v.keep.sets if isinstance(v.keep, LayerPrefetch) else ()
        resident = resident_bytes(v.model, exclude) + logits.numel() * logits.element_size()
    gc.collect()
    torch.cuda.synchronize()
    v.held_bytes = max(0, torch.cuda.memory_allocated() - gpu0 - resident)
    v.host_bytes = pinned_host_bytes() - host0
    if _codegen(name):  # its arena is registered, not from torch's allocator
        arena = codegen.nn.arena(v.model)
        v.host_bytes += arena.nbytes if arena.pinned else 0
    return v, logits


def timed_rounds(variants: dict[str, Callable[[], Any]], rounds: int, *,
                 block_ms: float = 40.0, warmup_s: float = 1.5) -> dict[str, list[float]]:
    """Milliseconds per call of each variant, one value per round: a warm-up of every
    variant in turn, then per variant as many calls per block as fill about ``block_ms``
    (at least 3), and ``rounds`` rounds of one block each in a rotated order, the device
    synchronized before each block (``benchmarks.common.interleaved``'s measurement, but
    a variant's trailing side-stream copies do not spill into the next block)."""
    every = list(variants.values())
    warm_up(lambda: [fn() for fn in every], warmup_s, batch=1)
    reps = {v: reps_for(estimate_ms(fn, 3), block_ms, 3, 50) for v, fn in variants.items()}
    return run_rounds({v: Block(fn, reps[v]) for v, fn in variants.items()}, rounds,
                      sync_each=True)


# ---------------------------------------------------------------------------- rows


def summarize(tokens: int, times: dict[str, list[float]], gpu_mib: dict[str, float],
              host_mib: dict[str, float]) -> list[dict[str, Any]]:
    """The rows of one step: ms is the median over rounds; ratio_copy and
    ratio_accelerate the medians of per-round ratios to the copy floor and to accelerate
    (None where that variant was not timed). ``tokens`` 1 is the decode step: cache says
    which KV cache its model step uses (``GRAPHED`` rows a static one, the others a
    dynamic one, the copy floor none), graph whether the row replays a CUDA graph."""
    rows = []
    for v, t in times.items():
        decode = tokens == 1 and not v.startswith("copy")
        rows.append({
            "tokens": tokens, "step": "decode" if tokens == 1 else "prefill",
            "kv_cache": tokens == 1,
            "cache": ("static" if v in GRAPHED else "dynamic") if decode else None,
            "graph": v in GRAPHED, "variant": v, "ms": statistics.median(t),
            "ratio_copy": median_ratio(t, times["copy"]) if "copy" in times else None,
            "ratio_floor": (median_ratio(t, times[_floor_of(v)]) if _floor_of(v) in times
                            else None),
            # tokens/s over the hand-written prefetch's: its ms over this row's, per round
            "over_prefetch": (1 / median_ratio(t, times["prefetch"]) if "prefetch" in times
                              else None),
            "ratio_accelerate": (median_ratio(t, times["accelerate"])
                                 if "accelerate" in times else None),
            "gpu_mib": gpu_mib[v], "host_mib": host_mib[v], "rounds": len(t)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table."""
    def ratio(x: float | None) -> str:
        return f"{x:9.3f}" if x is not None else f"{'-':>9}"

    lines = [f"{'step':8}{'tokens':>7} {'variant':19}{'ms':>9}{'/ copy':>9}{'/ floor':>9}"
             f"{'/ accel':>9}{'x pref':>9}{'gpu_mib':>10}{'host_mib':>10}"]
    for r in rows:
        lines.append(f"{r['step']:8}{r['tokens']:7} {r['variant']:19}{r['ms']:9.2f}"
                     f"{ratio(r['ratio_copy'])}{ratio(r.get('ratio_floor'))}"
                     f"{ratio(r['ratio_accelerate'])}{ratio(r.get('over_prefetch'))}"
                     f"{r['gpu_mib']:10.1f}{r['host_mib']:10.1f}")
    return "\n".join(lines)


def rounds_for(tokens: int, rounds: int) -> int:
    """Rounds of a step: 2 fewer for prefills over 512 tokens (each round takes longer),
    at least 2."""
    return max(2, rounds if tokens <= 512 else rounds - 2)


def steps(tokens: Sequence[int], variants: Sequence[str]) -> list[tuple[int, list[str]]]:
    """Each step's token count and variants (the decode step only has DECODE_VARIANTS)."""
    return [(t, [v for v in variants
                 if t != 1 or v in DECODE_VARIANTS or _slices(v) or _copy_mib(v)])
            for t in tokens]


def graph_rows(tokens: int, variants: Sequence[str]) -> list[str]:
    """The rows a step adds that replay a CUDA graph: in the decode step, each ``GRAPHED``
    row whose variant it times."""
    return [g for g, v in GRAPHED.items() if tokens == 1 and v in variants]


# ---------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.offload_llama", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder of offload_llama.json (default: benchmarks/results)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed rounds (2 fewer for prefills over 512 tokens; >= 2)")
    parser.add_argument("--tokens", default="512,4096,1",
                        help="prefill lengths; 1 is the decode step (one token after a "
                             f"{DECODE_PROMPT}-token prompt, with a KV cache)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="also time greedy generate of N new tokens after the "
                             f"{DECODE_PROMPT}-token prompt (0: not)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would run and the prefetch's buffer plan; no GPU")
    args = parser.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: expected comma-separated integers")
    if not args.tokens or min(args.tokens) < 1:
        parser.error("--tokens: expected positive integers")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants
               if v not in VARIANTS and not _slices(v) and not _copy_mib(v)]
    if unknown or not args.variants:
        parser.error(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)} "
                     "or codegen_s<N> or codegen_c<N>")
    if args.rounds < 1:
        parser.error("--rounds: expected a positive integer")
    return args


def decoder_shapes(config: Any) -> list[list[tuple[int, ...]]]:
    """Each decoder layer's Linear weight shapes, from a model on the meta device (no
    memory, no initialization)."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return [[tuple(m.weight.shape) for m in ms] for ms in decoder_linears(model)]


def available(variants: Sequence[str]) -> tuple[list[str], list[str]]:
    """The variants that can run here, and notes on those that cannot (or that need
    one)."""
    kept, notes = list(variants), []
    if "codegen_noprefetch" in kept and not offload_takes_prefetch():
        kept.remove("codegen_noprefetch")
        notes.append("codegen_noprefetch skipped: codegen.nn.offload() takes no prefetch=")
    if "accelerate" in kept and importlib.util.find_spec("accelerate") is None:
        kept.remove("accelerate")
        notes.append("accelerate skipped: accelerate is not installed")
    if "accelerate" in kept:
        notes.append("accelerate keeps its host copies in pageable memory: host_mib "
                     "counts pinned memory only")
    return kept, notes


def set_up_all(variants: Sequence[str], config: Any, shapes: list[list[tuple[int, ...]]],
               prompt: torch.Tensor, notes: list[str]) -> dict[str, Variant]:
    """Every variant, set up (``set_up``), the GPU-resident model first: its logits of
    ``prompt`` are the reference of the others' (a large difference is noted)."""
    # The default stream's GEMM workspace now, so that no variant's held bytes count it.
    x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(x, x)
    built: dict[str, Variant] = {}
    reference = None
    # The GPU-resident model first (the others' reference), a quantized floor after its model.
    for name in sorted(variants, key=lambda v: (v != "gpu", v.startswith("copy_"))):
        try:
            v, logits = set_up(name, config, shapes, prompt, reference, built)
        except Exception as e:  # the other variants' rows are still worth the GPU time
            traceback.print_exc()
            notes.append(f"FAILED: {name} could not be set up: {type(e).__name__}: {e}")
            continue
        built[name] = v
        if name == "gpu":
            reference = logits
        print(f"set up {name}: keeps {v.held_bytes / 2**20:.1f} MiB on the GPU beyond its "
              f"model, {v.host_bytes / 2**20:.1f} MiB pinned on the host"
              + (f"; logits vs gpu {v.error:.2e}" if v.error is not None else ""))
        if v.error is not None and v.error > 5e-2:
            notes.append(f"{name}: logits differ from the GPU-resident model's by "
                         f"{v.error:.2e} (max abs difference / max abs logit)")
            print(f"WARNING: {notes[-1]}")
    return built


GENERATE_VARIANTS = DECODE_VARIANTS


def measure_generate(built: dict[str, Variant], new_tokens: int, names: Sequence[str],
                     rounds: int, prompt: torch.Tensor) -> list[dict[str, Any]]:
    """The generate step's rows: per round and variant, greedy ``generate`` of 1 and of
    ``new_tokens`` + 1 tokens after ``prompt``, timed on the host around each call (it
    reads every token); ms per token is their difference over ``new_tokens``. The copy
    floor's row is one forward's weights copied alone (ms per call).

    Every variant first generates as many tokens as are timed: torch's
    ``scaled_dot_product_attention`` takes about 11 ms of host time per call the first
    time it sees a KV length (H100, torch 2.11; ``benchmarks.probes.offload_copy_gaps``),
    once per process, whichever model calls it: the variant timed first would pay for
    all."""
    def generate(model: Any, n: int) -> float:
        return generate_ms(model, prompt, n)

    variants = [v for v in names if v in GENERATE_VARIANTS]
    for v in variants:  # warm-up: compiles, allocates the caches, and runs torch's
        if built[v].model is not None:  # attention once at every length timed (below)
            generate(built[v].model, new_tokens + 1)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in rotated(variants, r):
            if built[v].model is None:
                floor = Block(built[v].call, 5)  # type: ignore[arg-type]
                torch.cuda.synchronize()
                floor.run()
                torch.cuda.synchronize()
                times[v].append(floor.ms())
                continue
            one = generate(built[v].model, 1)
            times[v].append((generate(built[v].model, new_tokens + 1) - one) / new_tokens)
    rows = summarize(1, times, {v: math.nan for v in variants},
                     {v: built[v].host_bytes / 2**20 for v in variants})
    for row in rows:
        row.update(step="generate", tokens=new_tokens, cache="dynamic", kv_cache=True,
                   tokens_per_s=1e3 / row["ms"])
    return rows


def measure(built: dict[str, Variant], tokens: int, names: Sequence[str], rounds: int,
            prompt: torch.Tensor, token: torch.Tensor, vocab: int,
            notes: list[str]) -> list[dict[str, Any]]:
    """One step's rows: a prefill of ``tokens`` random tokens, or for 1 the decode step
    after ``prompt`` (with its ``graph_rows``: a row that cannot be captured is noted as
    FAILED, the others still run); timed in rounds (``timed_rounds``), then one call of
    each variant for its peak memory."""
    base = {v: v for v in names}  # row -> the variant whose model (and memory) it uses
    kept = {v: built[v].held_bytes for v in names}
    if tokens == 1:
        calls = {v: built[v].call or DecodeStep(built[v].model, prompt, token)
                 for v in names}
        for row in graph_rows(tokens, names):
            v = GRAPHED[row]
            if row not in built:
                continue
            try:  # a model of its own: replays between eager steps would join their copies
                step = GraphDecodeStep(built[row].model, prompt, token)
            except Exception as e:  # the eager rows are still worth the GPU time
                traceback.print_exc()
                notes.append(f"FAILED: {row} could not be captured: {type(e).__name__}: {e}")
                continue
            calls[row], base[row] = step, row
            kept[row] = built[row].held_bytes + step.pool_bytes
            eager, replayed = calls[v]().float(), step().float()
            error = ((replayed - eager).abs().max() / eager.abs().max()).item()
            notes.append(f"{row}: replayed logits vs {v}'s eager decode step {error:.2e} "
                         "(max abs difference / max abs logit)")
            print(notes[-1])
    else:
        torch.manual_seed(SEED + tokens)
        ids = torch.randint(0, vocab, (1, tokens), device="cuda")
        calls = {v: built[v].call or bind(forward, built[v].model, ids) for v in names}
    times = timed_rounds(calls, rounds)
    gpu_mib = {v: peak_mib(fn) + kept[v] / 2**20 for v, fn in calls.items()}
    host_mib = {v: built[base[v]].host_bytes / 2**20 for v in calls}
    return summarize(tokens, times, gpu_mib, host_mib)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with --dry-run, says what it would run); the exit status."""
    args = parse(argv)
    try:
        import transformers
    except ImportError:
        print("offload_llama: needs transformers (pip install transformers)", file=sys.stderr)
        return 1
    variants, notes = available(args.variants)
    config = llama_config()
    shapes = decoder_shapes(config)
    offloaded = sum(math.prod(s) * 2 for layer in shapes for s in layer)
    plan = plan_buffers(shapes, 2)
    plan_line = (f"offloaded {offloaded / 2**30:.3f} GiB in {sum(map(len, shapes))} "
                 f"Linears; prefetch: {SETS} buffer sets of {plan.numel * 2 / 2**20:.1f} MiB")
    if args.dry_run:
        for tokens, names in steps(args.tokens, variants):
            kind = (f"decode (1 token, {DECODE_PROMPT}-token KV cache)" if tokens == 1
                    else f"prefill {tokens}")
            names = [*names, *graph_rows(tokens, names)]
            print(f"{kind}: {rounds_for(tokens, args.rounds)} rounds of {', '.join(names)}")
        for line in [plan_line, *notes]:
            print(line)
        return 0
    if not torch.cuda.is_available():
        print("offload_llama: needs a CUDA GPU (--dry-run prints what would run)",
              file=sys.stderr)
        return 1

    for note in notes:
        print(note)
    torch.manual_seed(SEED + 1)
    prompt = torch.randint(0, config.vocab_size, (1, DECODE_PROMPT), device="cuda")
    token = torch.randint(0, config.vocab_size, (1, 1), device="cuda")
    graphed = [g for g, v in GRAPHED.items() if 1 in args.tokens and v in variants]
    built = set_up_all([*variants, *graphed], config, shapes, prompt, notes)
    rows = []
    for tokens, names in steps(args.tokens, [v for v in variants if v in built]):
        try:
            rows += measure(built, tokens, names, rounds_for(tokens, args.rounds), prompt,
                            token, config.vocab_size, notes)
        except Exception as e:  # keep the other steps' rows
            traceback.print_exc()
            notes.append(f"FAILED: the {tokens}-token step: {type(e).__name__}: {e}")
    if args.generate:
        try:
            rows += measure_generate(built, args.generate, [v for v in variants if v in built],
                                     max(2, args.rounds - 2), prompt)
        except Exception as e:  # keep the other steps' rows
            traceback.print_exc()
            notes.append(f"FAILED: the generate step: {type(e).__name__}: {e}")
    for line in [table(rows), plan_line, *notes]:
        print(line)
    reports = {v: codegen.nn.report(built[v].model).as_dict()
               for v in built if _codegen(v) and built[v].model is not None}
    for v in reports:
        print(f"{v}: {codegen.nn.report(built[v].model).plan.summary()}"
              if codegen.nn.report(built[v].model).plan else v)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload_llama.json").write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "offloaded_bytes": offloaded,
        "arena_bytes": (codegen.nn.arena(built["codegen"].model).nbytes
                        if "codegen" in built else None),
        "prefetch_buffer_bytes": SETS * plan.numel * 2,
        "logits_error_vs_gpu": {v: b.error for v, b in built.items() if b.error is not None},
        "notes": notes, "rows": rows, "last_reports": reports}, indent=1) + "\n")
    return 1 if any(n.startswith("FAILED") for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
