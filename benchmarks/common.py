"""What the benchmarks and probes share: interleaved measurement (round orders, repetition
counts, medians of per-round ratios), GPU timing (timed blocks of calls, host time per call
with the GPU kept busy, warm-up, CUDA-graph capture, peak memory) and the hand-written
PyTorch baselines the generated ops are measured against.

Why interleaved: the H200 power-caps within about a second of sustained GEMMs, and then
drifts by a few percent from block to block, so a variant timed after another one is
timed on a different card. Each round times every variant once (in a rotated order), and
each ratio is taken inside a round, between neighbours in time, before its median over
the rounds.

Imports without a GPU; the pure-Python functions (``rotated`` to ``parse_ints``) and the
Llama builders run anywhere, every other function needs a GPU when called.
``codegen.timing.cuda_time_ms`` is the package's own one-line timer (for
``python -m codegen demo``); the benchmarks use the blocks here.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import io
import math
import pstats
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"  # where every benchmark writes by default


# ---------------------------------------------------------------------------- pure Python


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """The order of round ``round_index``: ``items`` rotated left by the round index, so
    over ``len(items)`` rounds every item runs once in every position.

    >>> rotated("abc", 1)
    ['b', 'c', 'a']
    """
    if not items:
        return []
    r = round_index % len(items)
    return list(items[r:]) + list(items[:r])


def reps_for(estimate_ms: float, block_ms: float, min_reps: int, max_reps: int) -> int:
    """Calls per timed block so that one block lasts about ``block_ms`` of GPU time,
    within [min_reps, max_reps]."""
    if min_reps < 1 or max_reps < min_reps:
        raise ValueError(f"reps_for: need 1 <= min_reps <= max_reps, got {min_reps}, {max_reps}")
    if not estimate_ms > 0 or math.isinf(estimate_ms):
        return min_reps
    return max(min_reps, min(max_reps, math.ceil(block_ms / estimate_ms)))


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(q1, median, q3) with linear interpolation between order statistics; for one value,
    that value three times."""
    if not values:
        raise ValueError("quartiles: no values")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of ``values``."""
    q1, med, q3 = quartiles(values)
    return {"median": med, "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def per_round_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """``num[i] / den[i]`` for each round i (both timed in round i)."""
    if len(num) != len(den):
        raise ValueError(f"per_round_ratios: {len(num)} numerator rounds but {len(den)} "
                         "denominator rounds; both must come from the same rounds")
    if any(d <= 0 for d in den):
        raise ValueError("per_round_ratios: a denominator time is <= 0")
    return [n / d for n, d in zip(num, den)]


def ratio_fields(name: str, num: Sequence[float], den: Sequence[float]) -> dict[str, object]:
    """Row fields of one ratio: ``name`` is the median of per-round ratios (NOT the ratio of
    medians), ``name_iqr`` [q1, q3] and ``name_range`` [min, max] their spread.

    >>> ratio_fields("op_ratio", [2.0, 3.0, 4.0], [1.0, 1.0, 2.0])["op_ratio"]
    2.0
    """
    s = spread(per_round_ratios(num, den))
    return {name: s["median"], f"{name}_iqr": [s["q1"], s["q3"]],
            f"{name}_range": [s["min"], s["max"]]}


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """The median over rounds of the per-round ratio ``num / den`` (``ratio_fields``'s)."""
    return spread(per_round_ratios(num, den))["median"]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"8192"`` -> (8192, 8192, 8192); ``"16384x8192x1024"`` -> (16384, 8192, 1024)."""
    parts = text.lower().replace("^3", "").replace("³", "").split("x")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"shape {text!r}: expected N or MxNxK with integers") from None
    if len(dims) == 1:
        dims *= 3
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"shape {text!r}: expected N or MxNxK with positive integers")
    return dims[0], dims[1], dims[2]


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); positive integers only."""
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected a comma-separated list of integers") \
            from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} {text!r}: expected positive integers")
    return values


# ---------------------------------------------------------------------------- GPU timing

# torch.cuda._sleep spins for a number of GPU clock cycles; at 2 GHz or less (the H200
# runs 1.4-1.98 GHz) this many cycles last at least a millisecond.
CYCLES_PER_MS = 2_000_000


@dataclasses.dataclass
class Busy:
    """Set by ``gpu_busy`` on exit: ``drained`` is True when the GPU had finished the sleep
    before the timed block ended (the block may then have waited for the GPU)."""

    drained: bool = False


@contextlib.contextmanager
def gpu_busy(ms: float) -> Iterator[Busy]:
    """Queues about ``ms`` of a sleep kernel on the current stream, so that the host calls
    made inside the block are only queued, never waited for; synchronizes on exit."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(ms * CYCLES_PER_MS))
    marker = torch.cuda.Event()
    marker.record()
    state = Busy()
    try:
        yield state
    finally:
        state.drained = marker.query()
        torch.cuda.synchronize()


def python_profile(fn: Callable[[], T], rows: int = 18,
                   orders: Sequence[str] = ("tottime",)) -> tuple[T, str]:
    """``fn()`` under cProfile (where the host's time goes in Python; the torch profiler
    sees only torch's ops and CUDA calls): its result, and the ``rows`` functions that
    took longest by each of ``orders`` (pstats' sort keys), as pstats prints them."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = fn()
    finally:
        profiler.disable()
    text = io.StringIO()
    for order in orders:
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(rows)
    return result, "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def host_sample(fn: Callable[[], Any], calls: int = 10, busy_ms: float = 15.0) -> float:
    """Host microseconds per call of ``fn``: the wall time of ``calls`` back-to-back Python
    calls (until the last returns) while a sleep kernel queued ahead keeps the GPU busy, so
    the launches are only queued, never waited for. If the sleep ran out before the calls
    were done, the sample is taken again with a sleep twice as long (twice at most)."""
    sleep = busy_ms
    for _attempt in range(3):
        with gpu_busy(sleep) as busy:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - start
        if not busy.drained:
            break
        sleep *= 2
    return elapsed / calls * 1e6


def warm_up(fn: Callable[[], Any], seconds: float, batch: int = 10) -> int:
    """Calls ``fn`` in batches of ``batch`` until ``seconds`` of wall time have passed (GPU
    work included); returns the number of calls."""
    calls = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        calls += batch
        torch.cuda.synchronize()
        if time.perf_counter() - start >= seconds:
            return calls


class Block:
    """One timed block of a variant, reusable round after round: one untimed lead-in call
    (so the timed calls start in steady state: queued behind it when the GPU bounds the
    time, launched as fast as the host can when the host does), then ``reps`` calls
    between two CUDA events on the current stream. ``ms()`` is the time per call."""

    def __init__(self, fn: Callable[[], Any], reps: int) -> None:
        self.fn = fn
        self.reps = reps
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def run(self) -> None:
        """Queues the block; the caller synchronizes before ``ms()``."""
        self.fn()
        self.start.record()
        for _ in range(self.reps):
            self.fn()
        self.end.record()

    def ms(self) -> float:
        return self.start.elapsed_time(self.end) / self.reps


def estimate_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """A rough time per call (one short block), to choose repetition counts."""
    block = Block(fn, calls)
    torch.cuda.synchronize()
    block.run()
    torch.cuda.synchronize()
    return block.ms()


def run_rounds(blocks: dict[str, Block], rounds: int, *, sync_each: bool = False,
               after_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Times every block once per round, in an order rotated by one each round (``rotated``)
    and reads the times after the round; per block, ms per call, one value per round.
    ``sync_each``: the device is synchronized before each block too; ``after_round(r)``
    runs after round r's times are read."""
    names = list(blocks)
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        for v in rotated(names, r):
            if sync_each:
                torch.cuda.synchronize()
            blocks[v].run()
        torch.cuda.synchronize()
        for v in names:
            times[v].append(blocks[v].ms())
        if after_round is not None:
            after_round(r)
    return times


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int, *, block_ms: float = 40.0,
                min_reps: int = 3, max_reps: int = 50, warmup_s: float = 1.5,
                per_variant_reps: bool = False) -> dict[str, list[float]]:
    """Milliseconds per call of each variant, one value per round (``run_rounds``), after a
    warm-up of ``warmup_s`` seconds of calls of every variant in turn. Calls per block
    (``reps_for``: a block lasts about ``block_ms``): by default one count for all variants,
    from the first variant's time after the warm-up; with ``per_variant_reps``, one count
    per variant, from a 3-call estimate of each taken before the warm-up."""
    every = list(variants.values())
    if per_variant_reps:
        reps = {v: reps_for(estimate_ms(fn, 3), block_ms, min_reps, max_reps)
                for v, fn in variants.items()}
        warm_up(lambda: [fn() for fn in every], warmup_s, batch=1)
    else:
        warm_up(lambda: [fn() for fn in every], warmup_s, batch=1)
        shared = reps_for(estimate_ms(every[0]), block_ms, min_reps, max_reps)
        reps = dict.fromkeys(variants, shared)
    return run_rounds({v: Block(fn, reps[v]) for v, fn in variants.items()}, rounds)


def bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``fn`` with its arguments bound: a variant for ``interleaved``."""
    return lambda: fn(*args)


def peak_mib(fn: Callable[[], Any]) -> float:
    """Peak device memory of one call of ``fn`` above what was allocated before it, MiB
    (the result is dropped after the measurement)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


# ---------------------------------------------------------------------------- baselines
# The hand-written PyTorch stream code that users write today: what the generated ops
# replace. Keep it idiomatic, not deliberately slow.

POOL = 4  # streams of the hand-written pipelines, as the ops' default pool


class _StreamRows:
    """The rows of an output in ``slices`` slices, slice i on stream i % pool."""

    def __init__(self, slices: int, pool: int = POOL) -> None:
        self.slices = slices
        self.streams = [torch.cuda.Stream() for _ in range(min(slices, pool))]

    def run(self, m: int, gemm: Callable[[slice], object]) -> None:
        """Forks the streams from the caller's, calls ``gemm(rows)`` for each slice on its
        stream, and joins them back."""
        chunk = -(-m // self.slices)
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)
        for i in range(self.slices):
            with torch.cuda.stream(self.streams[i % len(self.streams)]):
                gemm(slice(i * chunk, min((i + 1) * chunk, m)))
        for s in self.streams:
            main.wait_stream(s)


class PythonStreamLoop(_StreamRows):
    """``out = a @ b`` with the rows of ``out`` in ``slices`` slices on a pool of streams,
    forked from and joined back to the caller's stream."""

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)
        self.run(a.shape[0], lambda rows: torch.matmul(a[rows], b, out=out[rows]))
        return out


class PythonStreamLinear(_StreamRows):
    """``out = x @ w.T + bias`` (``F.linear``) with the rows of ``out`` in ``slices`` slices
    on a pool of streams; each slice is one ``torch.addmm`` (what ``F.linear`` calls for
    2-D inputs) into its rows of the output."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        wt = w.t()
        self.run(x.shape[0], lambda rows: torch.addmm(bias, x[rows], wt, out=out[rows]))
        return out


class PythonCopyPipeline:
    """``x @ w`` with w in pinned host memory, as a user writes it with PyTorch streams:
    the column blocks of w are split once into contiguous pinned chunks (copying a strided
    host slice would go through a pageable temporary), and per call slice i's chunk is
    copied into its stream's staging buffer and multiplied into its output columns, on
    stream i % pool, forked from and joined back to the caller's stream."""

    def __init__(self, w_host: torch.Tensor, slices: int, pool: int = POOL) -> None:
        k, n = w_host.shape
        self.n = n
        self.chunk = -(-n // slices)
        self.chunks = [w_host[:, i:i + self.chunk].contiguous().pin_memory()
                       for i in range(0, n, self.chunk)]
        self.streams = [torch.cuda.Stream() for _ in range(min(len(self.chunks), pool))]
        self.staging = [torch.empty(k, self.chunk, device="cuda", dtype=w_host.dtype)
                        for _ in self.streams]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.n, device=x.device, dtype=x.dtype)
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)
        for i, chunk in enumerate(self.chunks):
            p = i % len(self.streams)
            width = chunk.shape[1]
            with torch.cuda.stream(self.streams[p]):
                slot = self.staging[p][:, :width]
                slot.copy_(chunk, non_blocking=True)
                start = i * self.chunk
                torch.matmul(x, slot, out=out[:, start:start + width])
        for s in self.streams:
            main.wait_stream(s)
        return out


class PythonCopyStreamPipeline(PythonCopyPipeline):
    """The same pipeline with every copy on one copy stream, in slice order: slice i's
    GEMM (on stream i % pool) waits for its copy's event, and the copy into a staging
    buffer waits for the event of the GEMM that last read it, so only one copy is ever
    eligible to run (``probes/copy_contention.py``, part 3)."""

    def __init__(self, w_host: torch.Tensor, slices: int, pool: int = POOL) -> None:
        super().__init__(w_host, slices, pool)
        self.copier = torch.cuda.Stream()
        self.copied = [torch.cuda.Event() for _ in self.chunks]
        self.read = [torch.cuda.Event() for _ in self.chunks]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.n, device=x.device, dtype=x.dtype)
        main = torch.cuda.current_stream()
        self.copier.wait_stream(main)
        for s in self.streams:
            s.wait_stream(main)
        pool = len(self.streams)
        for i, chunk in enumerate(self.chunks):
            p = i % pool
            width = chunk.shape[1]
            slot = self.staging[p][:, :width]
            with torch.cuda.stream(self.copier):
                if i >= pool:
                    self.copier.wait_event(self.read[i - pool])
                slot.copy_(chunk, non_blocking=True)
                self.copied[i].record()
            with torch.cuda.stream(self.streams[p]):
                self.streams[p].wait_event(self.copied[i])
                start = i * self.chunk
                torch.matmul(x, slot, out=out[:, start:start + width])
                self.read[i].record()
        for s in self.streams:
            main.wait_stream(s)
        return out


def balanced_m(w_host: torch.Tensor, w_dev: torch.Tensor) -> tuple[int, float, float]:
    """m (a multiple of 256) for which one GEMM [m, k] @ w [k, n] takes about as long as
    copying w (pinned, ``w_host``) to the GPU (``w_dev``); with the copy time and the
    GEMM time at m = 8192 it was derived from (ms)."""
    k = w_dev.shape[0]
    copy = estimate_ms(lambda: w_dev.copy_(w_host, non_blocking=True), 5)
    x = torch.randn(8192, k, device="cuda", dtype=w_dev.dtype)
    warm_up(lambda: torch.matmul(x, w_dev), 0.5)
    gemm = estimate_ms(lambda: torch.matmul(x, w_dev), 5)
    return max(256, round(8192 * copy / gemm / 256) * 256), copy, gemm


# ---------------------------------------------------------------------------- the offloaded Llama


def llama_config() -> Any:
    """The 4-layer Llama of ``offload_llama`` and its probes: h 4096, i 14336, 32 heads,
    8 kv heads."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        tie_word_embeddings=False)


def build(config: Any, seed: int = 0, device: str | torch.device = "cuda") -> Any:
    """A bf16 LlamaForCausalLM with random weights from ``seed``, in eval mode, made in bf16
    on ``device`` from the start (no float32 copy: an 8B model's would need 32 GB; on the
    GPU initialization takes a moment, on the CPU tens of seconds; the same seed gives the
    same weights on the same device)."""
    import transformers

    torch.manual_seed(seed)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(dtype)


def config_8b(layers: int = 32) -> Any:
    """Llama-3-8B's shape (``layers`` decoder layers) of ``offload_budget`` and its probe."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


def is_decoder_linear(name: str, module: torch.nn.Module) -> bool:
    """offload()'s filter: the Linears inside the decoder layers (not lm_head)."""
    return name.startswith("model.layers.")




def offloadable(model: Any) -> list[tuple[str, torch.nn.Linear]]:
    """The Linears ``is_decoder_linear`` offloads, with their names."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and is_decoder_linear(n, m)]


# A budget row's name: what it runs, its budget (percent), its format, its staging (MiB),
# and the step its plan is optimized for where that is not decode (``_prefill``).
ROW = r"([a-z]+)_p([0-9]+)(?:_(fp8|int4))?(?:_s([0-9]+))?(?:_(prefill))?"


def budget_and_staging(model: Any, percent: int, staging_mib: int | None,
                       prefill: bool = False) -> tuple[int | None, int | None]:
    """``offload()``'s ``gpu_budget`` and ``staging`` for a row of ``percent`` and
    ``staging_mib``: 0% with a staging of its own, or with a plan optimized for prefill
    (whose staging is larger than the 0% budget), is no budget (every weight streamed)."""
    staging = staging_mib * 2**20 if staging_mib else None
    unbounded = (staging or prefill) and not percent
    return (None if unbounded else budget_bytes(model, percent)), staging


def budget_bytes(model: Any, percent: int) -> int:
    """``percent`` of the offloadable bytes; for 0, the default staging alone."""
    from codegen.nn.offload import _resident

    return budget_of([_resident(n, m) for n, m in offloadable(model)], percent)


def budget_of(linears: list[Any], percent: int) -> int:
    """``budget_bytes`` of the offloadable Linears ``linears`` (``plan.Resident``)."""
    from codegen.nn.offload import default_staging

    total = sum(lay.nbytes for lay in linears)
    return max(total * percent // 100, default_staging(linears))


def arena_copies(model: Any) -> Callable[[], None]:
    """The bytes ``model`` (offloaded by ``codegen.nn.offload``) streams a forward, copied
    alone from its arena, each weight whole, back to back on the current stream into two
    GPU buffers: the floor of what it streams (quantized bytes and scales included)."""
    import codegen.nn

    plan = codegen.nn.offload_plan(model)
    arena = codegen.nn.arena(model).storage
    spans = [(lay.weight_offset, lay.weight_bytes) for lay in plan.streamed]
    largest = max(n for _, n in spans)
    dst = [torch.empty(largest, dtype=torch.uint8, device="cuda") for _ in range(2)]

    def copies() -> None:
        for k, (at, n) in enumerate(spans):
            dst[k % 2][:n].copy_(arena[at:at + n], non_blocking=True)

    return copies


def generate_ms(model: Any, prompt: torch.Tensor, tokens: int, mask: bool = True) -> float:
    """Wall-clock ms of greedy ``generate`` of ``tokens`` new tokens after ``prompt`` (the
    host reads every token), the device synchronized before and after; with an attention
    mask of ones, or (``mask=False``) none."""
    import time

    attention_mask = torch.ones_like(prompt) if mask else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(prompt, attention_mask=attention_mask, max_new_tokens=tokens,
                   min_new_tokens=tokens, do_sample=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3
