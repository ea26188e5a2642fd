"""The bundled examples: their generated C++ is checked in under ``csrc_gen/``.

Each example builds a scheduled Fusion and says which input shapes to test it with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..errors import ScheduleError
from ..frontend import ir
from ..frontend.ir import DeviceMesh, Fusion, ParallelType
from ..nn.program import offload_linear  # noqa: F401 - a bundled example too
from ..nn.quantize import INT4_GROUP

Stream = ParallelType.Stream
DIDx = ParallelType.DIDx


@dataclasses.dataclass(frozen=True)
class Example:
    name: str
    doc: str
    make: Callable[[], Fusion]
    shapes: tuple[tuple[int, ...], ...]  # input shapes for a small test
    # Integer-valued inputs give exact results (only products and sums; no SiLU or GELU).
    exact: bool = True

    def devices(self, gpu: str = "cuda") -> list[str]:
        """Where each input of a test call lives: ``gpu`` (e.g. "cuda" or "meta") for
        inputs on the GPU, "cpu" for those declared in host memory (device="cpu")."""
        return ["cpu" if t.device == "cpu" else gpu for t in self.make().inputs]


def stream_matmul_n(m: int = 5, k: int = 7, n: int = 6, slices: int = 3) -> Fusion:
    """nvFuser's StreamTest.Matmul: [5, 7] @ [7, 6], output columns in 3 stream slices."""
    _check_positive("stream_matmul_n", slices=slices)
    with Fusion("stream_matmul_n") as fusion:
        inp = ir.input([m, k], torch.float32)
        w = ir.input([k, n], torch.float32)
        out = ir.matmul(inp, w)
        ir.output(out)
    out.outer_split(1, slices)
    out.axis(1).parallelize(Stream)
    return fusion


def _split_matmul(name: str, dtype: torch.dtype, axis: int, slices: int,
                  x_device: str = "cuda", w_device: str = "cuda",
                  out_device: str = "cuda") -> Fusion:
    """x [m, k] @ w [k, n] (named extents), output axis ``axis`` (0 rows, 1 columns) in
    ``slices`` stream slices; each tensor on ``device`` "cuda" or "cpu" (host memory)."""
    _check_positive(name, slices=slices)
    with Fusion(name) as fusion:
        x = ir.input(["m", "k"], dtype, device=x_device)
        w = ir.input(["k", "n"], dtype, device=w_device)
        out = ir.matmul(x, w)
        ir.output(out, device=out_device)
    out.outer_split(axis, slices)
    out.axis(axis).parallelize(Stream)
    return fusion


def matmul_rows(dtype: torch.dtype = torch.float32, slices: int = 4,
                name: str = "matmul_rows") -> Fusion:
    """[m, k] @ [k, n] with rows of the output in ``slices`` stream slices."""
    return _split_matmul(name, dtype, 0, slices)


def matmul_rows_bf16() -> Fusion:
    """The demo's program: bf16 [m, k] @ [k, n], rows in 4 stream slices."""
    return matmul_rows(torch.bfloat16, 4, "matmul_rows_bf16")


def two_matmuls() -> Fusion:
    """(inp @ w1) @ w2 with rows on streams: one loop, two matmuls per slice."""
    with Fusion("two_matmuls") as fusion:
        inp = ir.input(["m", "k"])
        w1 = ir.input(["k", "n"])
        w2 = ir.input(["n", "p"])
        t2 = ir.matmul(ir.matmul(inp, w1), w2)
        ir.output(t2)
    t2.outer_split(0, 2)
    t2.axis(0).parallelize(Stream)
    return fusion


def two_matmuls_not_inlinable() -> Fusion:
    """Columns of t1 = inp @ w1 on streams, then rows of t2 = t1 @ w2: two loops."""
    with Fusion("two_matmuls_not_inlinable") as fusion:
        inp = ir.input(["m", "k"])
        w1 = ir.input(["k", "n"])
        w2 = ir.input(["n", "p"])
        t1 = ir.matmul(inp, w1)
        t2 = ir.matmul(t1, w2)
        ir.output(t2)
    t1.outer_split(1, 3)
    t1.axis(1).parallelize(Stream)
    t2.outer_split(0, 2)
    t2.axis(0).parallelize(Stream)
    return fusion


def linear_bias() -> Fusion:
    """x @ w.T + bias with output columns (w rows, bias) in 4 stream slices."""
    with Fusion("linear_bias") as fusion:
        x = ir.input(["m", "k"])
        w = ir.input(["n", "k"])
        bias = ir.input(["n"])
        out = ir.linear(x, w, bias)
        ir.output(out)
    out.outer_split(1, 4)
    out.axis(1).parallelize(Stream)
    return fusion


def batched() -> Fusion:
    """[b, m, k] @ [b, k, n] with the batch in 4 stream slices."""
    with Fusion("batched") as fusion:
        a = ir.input(["b", "m", "k"])
        b = ir.input(["b", "k", "n"])
        out = ir.matmul(a, b)
        ir.output(out)
    out.outer_split(0, 4)
    out.axis(0).parallelize(Stream)
    return fusion


def stream_weights(dtype: torch.dtype = torch.bfloat16, slices: int = 8,
                   name: str = "stream_weights") -> Fusion:
    """x [m, k] on the GPU @ w [k, n] in host memory: w streamed in by column slices
    (one staging slot per worker stream), out [m, n] on the GPU."""
    return _split_matmul(name, dtype, 1, slices, w_device="cpu")


def offload_activations(dtype: torch.dtype = torch.bfloat16, slices: int = 8,
                        name: str = "offload_activations") -> Fusion:
    """x [m, k] in host memory @ w [k, n] on the GPU: x streamed in and out [m, n]
    streamed back to (pinned) host memory, both by row slices."""
    return _split_matmul(name, dtype, 0, slices, x_device="cpu", out_device="cpu")


def dequantize_linear(kind: str = "fp8", slices: int = 4, name: str | None = None) -> Fusion:
    """y = x @ dequantize(q, scale).T in bf16, the quantized weight in host memory, its
    rows in ``slices`` stream slices: each slice copies its rows of q and scale, dequantizes
    them and multiplies. ``kind`` "fp8": q float8_e4m3fn, one scale per row; "int4": q int8
    (values in [-8, 7]), one scale per 128 columns (codegen.nn.quantize's formats)."""
    if kind not in ("fp8", "int4"):
        raise ScheduleError(f"dequantize_linear: kind must be 'fp8' or 'int4', got {kind!r}")
    _check_positive("dequantize_linear", slices=slices)
    fp8 = kind == "fp8"
    with Fusion(name or f"dequantize_linear_{kind}") as fusion:
        x = ir.input(["m", "k"], torch.bfloat16, name="x")
        q = ir.input(["n", "k"], torch.float8_e4m3fn if fp8 else torch.int8, name="q",
                     device="cpu")
        scale = ir.input(["n"] if fp8 else ["n", "groups"], torch.bfloat16, name="scale",
                         device="cpu")
        w = ir.dequantize(q, scale, group_size=None if fp8 else INT4_GROUP)
        y = ir.linear(x, w)
        ir.output(y)
    y.outer_split(1, slices)
    y.axis(1).parallelize(Stream)
    return fusion


def _weights(what: str, weights: str) -> str:
    if weights not in ("cuda", "cpu"):
        raise ScheduleError(f"{what}: weights must be \"cuda\" (GPU memory) or \"cpu\" (host "
                            f"memory, streamed in slice by slice), got {weights!r}")
    return weights


def _check_positive(what: str, **values: int) -> None:
    for arg, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{what}: {arg} must be an int >= 1, got {value!r}")


def llama_mlp(dtype: torch.dtype = torch.bfloat16, slices: int = 4, weights: str = "cuda",
              name: str = "llama_mlp") -> Fusion:
    """A Llama MLP, ``down(silu(gate(x)) * up(x))``: ``op(x [m, h], w_gate [i, h],
    w_up [i, h], w_down [h, i]) -> [m, h]``, as transformers' LlamaMLP computes it with
    ``F.linear``. The intermediate axis (``inter``) is in ``slices`` stream slices: slice
    j's gate and up GEMMs and its SiLU-and-multiply kernel run on one stream; ``down``
    reduces over that axis, so it runs after the loop, on the whole intermediate.
    ``weights="cpu"``: the three weights live in host memory and are streamed in by
    slices: gate and up by the intermediate's slices, down by slices of its output
    columns (``h``) in a second loop, whose first copies run under the first loop's
    GEMMs when the program has a copy stream (``hostir.hoist_staging``)."""
    _check_positive("llama_mlp", slices=slices)
    device = _weights("llama_mlp", weights)
    with Fusion(name) as fusion:
        x = ir.input(["m", "h"], dtype, name="x")
        w_gate = ir.input(["inter", "h"], dtype, name="w_gate", device=device)
        w_up = ir.input(["inter", "h"], dtype, name="w_up", device=device)
        w_down = ir.input(["h", "inter"], dtype, name="w_down", device=device)
        act = ir.mul(ir.silu(ir.linear(x, w_gate)), ir.linear(x, w_up))
        out = ir.linear(act, w_down)
        ir.output(out)
    act.outer_split(1, slices)
    act.axis(1).parallelize(Stream)
    if device == "cpu":  # stream w_down too, by row blocks (contiguous in host memory)
        out.outer_split(1, slices)
        out.axis(1).parallelize(Stream)
    return fusion


def gpt_mlp(dtype: torch.dtype = torch.bfloat16, slices: int = 4, weights: str = "cuda",
            name: str = "gpt_mlp") -> Fusion:
    """A GPT MLP, ``fc2(gelu(fc1(x)))`` with biases: ``op(x [m, h], w1 [i, h], b1 [i],
    w2 [h, i], b2 [h]) -> [m, h] = F.linear(F.gelu(F.linear(x, w1, b1),
    approximate="tanh"), w2, b2)``. The intermediate axis in ``slices`` stream slices;
    fc1's bias and the tanh-GELU run in its cuBLASLt epilogue; fc2 reduces over the
    intermediate, after the loop. ``weights="cpu"``: weights and biases in host memory,
    streamed in by slices as for ``llama_mlp``."""
    _check_positive("gpt_mlp", slices=slices)
    device = _weights("gpt_mlp", weights)
    with Fusion(name) as fusion:
        x = ir.input(["m", "h"], dtype, name="x")
        w1 = ir.input(["inter", "h"], dtype, name="w1", device=device)
        b1 = ir.input(["inter"], dtype, name="b1", device=device)
        w2 = ir.input(["h", "inter"], dtype, name="w2", device=device)
        b2 = ir.input(["h"], dtype, name="b2", device=device)
        act = ir.gelu(ir.linear(x, w1, b1), approximate="tanh")
        out = ir.linear(act, w2, b2)
        ir.output(out)
    act.outer_split(1, slices)
    act.axis(1).parallelize(Stream)
    if device == "cpu":
        out.outer_split(1, slices)
        out.axis(1).parallelize(Stream)
    return fusion


def _check_tp_args(what: str, slices: int, world_size: int) -> DeviceMesh:
    _check_positive(what, slices=slices, world_size=world_size)
    return DeviceMesh(world_size)


def allgather_matmul(dtype: torch.dtype, slices: int, world_size: int,
                     name: str = "allgather_matmul") -> Fusion:
    """Per rank: ``op(x_local [m_local, k], w_local [k, n_local]) -> out [world_size *
    m_local, n_local] = all_gather_into_tensor(x_local) @ w_local`` (rows in rank order).

    Globally ``out = x @ w`` with x's rows and w's and out's columns sharded (DIDx); out's
    rows are whole on every rank, so x's rows are all-gathered. ``slices`` > 1 cuts each
    rank's block of out's rows into stream slices: slice i all-gathers piece i of every
    rank's x_local while slice i-1 multiplies (``slices`` must divide m_local).
    ``slices`` = 1: the all-gather, then one GEMM (no overlap)."""
    mesh = _check_tp_args(name, slices, world_size)
    with Fusion(name) as fusion:
        x = ir.input(["m", "k"], dtype, name="x")
        w = ir.input(["k", "n"], dtype, name="w")
        out = ir.matmul(x, w)
        ir.output(out)
    for tv in (x, w, out):
        tv.set_device_mesh(mesh)
    x.outer_split(0, world_size)
    x.axis(0).parallelize(DIDx)  # x: [DIDx{D}, m/D, k]
    w.outer_split(1, world_size)
    w.axis(1).parallelize(DIDx)  # w: [k, DIDx{D}, n/D]
    out.outer_split(1, world_size)
    out.axis(1).parallelize(DIDx)  # out: [m, DIDx{D}, n/D, rk]
    if slices > 1:
        out.outer_split(0, world_size)  # out's rows as every rank's block: [D, m/D, ...]
        out.outer_split(1, slices)  # [D, S, m/(D*S), DIDx{D}, n/D, rk]
        out.axis(1).parallelize(Stream)
    return fusion


def matmul_reduce_scatter(dtype: torch.dtype, slices: int, world_size: int,
                          name: str = "matmul_reduce_scatter") -> Fusion:
    """Per rank: ``op(x_local [m, k_local], w_local [k_local, n]) -> out [m / world_size,
    n] = reduce_scatter_tensor(x_local @ w_local, SUM)`` (rank r gets rows r*m/D ..).

    Globally ``out = x @ w`` with the contraction k sharded (DIDx on x's columns and w's
    rows: each rank holds a partial sum) and out's rows sharded: a reduce-scatter.
    ``slices`` > 1 cuts each rank's block of out's rows into stream slices: slice i
    multiplies piece i of every block of x_local's rows, then reduce-scatters it while
    slice i+1 multiplies (``slices`` * world_size must divide m). ``slices`` = 1: one GEMM,
    then the reduce-scatter."""
    mesh = _check_tp_args(name, slices, world_size)
    with Fusion(name) as fusion:
        x = ir.input(["m", "k"], dtype, name="x")
        w = ir.input(["k", "n"], dtype, name="w")
        out = ir.matmul(x, w)
        ir.output(out)
    for tv in (x, w, out):
        tv.set_device_mesh(mesh)
    x.outer_split(1, world_size)
    x.axis(1).parallelize(DIDx)  # x: [m, DIDx{D}, k/D]
    w.outer_split(0, world_size)
    w.axis(0).parallelize(DIDx)  # w: [DIDx{D}, k/D, n]
    out.outer_split(0, world_size)
    out.axis(0).parallelize(DIDx)  # out: [DIDx{D}, m/D, n, rk]
    if slices > 1:
        out.outer_split(1, slices)  # [DIDx{D}, S, m/(D*S), n, rk]
        out.axis(1).parallelize(Stream)
    return fusion


# The examples that run on one device, each with its csrc_gen/ golden (the distributed
# ones, DISTRIBUTED_EXAMPLES below, need a process group).
EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        Example("stream_matmul_n", stream_matmul_n.__doc__ or "", stream_matmul_n,
                ((5, 7), (7, 6))),
        Example("matmul_rows", matmul_rows.__doc__ or "", matmul_rows, ((37, 24), (24, 20))),
        Example("matmul_rows_bf16", matmul_rows_bf16.__doc__ or "", matmul_rows_bf16,
                ((64, 32), (32, 48))),
        Example("two_matmuls", two_matmuls.__doc__ or "", two_matmuls,
                ((19, 8), (8, 12), (12, 5))),
        Example("two_matmuls_not_inlinable", two_matmuls_not_inlinable.__doc__ or "",
                two_matmuls_not_inlinable, ((19, 8), (8, 12), (12, 5))),
        Example("linear_bias", linear_bias.__doc__ or "", linear_bias, ((9, 16), (30, 16), (30,))),
        Example("batched", batched.__doc__ or "", batched, ((6, 5, 7), (6, 7, 3))),
        # Ragged in the split dimension (13 = 8 + 5 in 8 slices of 2: three are empty).
        Example("stream_weights", stream_weights.__doc__ or "", stream_weights,
                ((9, 16), (16, 13))),
        Example("offload_activations", offload_activations.__doc__ or "",
                offload_activations, ((13, 16), (16, 10))),
        # Ragged: 22 = 4 slices of 6, the last of 4.
        Example("llama_mlp", llama_mlp.__doc__ or "", llama_mlp,
                ((12, 16), (22, 16), (22, 16), (16, 22)), exact=False),
        Example("gpt_mlp", gpt_mlp.__doc__ or "", gpt_mlp,
                ((12, 16), (22, 16), (22,), (16, 22), (16,)), exact=False),
    )
}


def example(name: str) -> Example:
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; choose one of {', '.join(EXAMPLES)}")
    return EXAMPLES[name]


def allgather_matmul_2x4() -> Fusion:
    """Tensor parallel, 2 ranks: all_gather(x_local) @ w_local, the all-gather sliced into
    4 stream slices (slice i's collective runs under slice i-1's GEMM)."""
    return allgather_matmul(torch.bfloat16, 4, 2, name="allgather_matmul_2x4")


def matmul_reduce_scatter_2x4() -> Fusion:
    """Tensor parallel, 2 ranks: reduce_scatter(x_local @ w_local), sliced into 4 stream
    slices (slice i's reduce-scatter runs under slice i+1's GEMM)."""
    return matmul_reduce_scatter(torch.bfloat16, 4, 2, name="matmul_reduce_scatter_2x4")


# Examples whose inputs are quantized (not one float dtype): their C++ is checked in under
# csrc_gen/; tests/test_dequantize.py runs them, with inputs of their dtypes.
QUANTIZED_EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        Example("dequantize_linear_fp8", dequantize_linear.__doc__ or "",
                lambda: dequantize_linear("fp8"), ((9, 128), (22, 128), (22,))),
        Example("dequantize_linear_int4", dequantize_linear.__doc__ or "",
                lambda: dequantize_linear("int4"), ((9, 256), (22, 256), (22, 2))),
    )
}


# Examples whose C++ is checked in under csrc_gen/ but which need a process group to run
# (tests/test_tp*.py run them); not in EXAMPLES, whose entries run on one device.
DISTRIBUTED_EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        Example("allgather_matmul_2x4", allgather_matmul_2x4.__doc__ or "",
                allgather_matmul_2x4, ((16, 32), (32, 24))),
        Example("matmul_reduce_scatter_2x4", matmul_reduce_scatter_2x4.__doc__ or "",
                matmul_reduce_scatter_2x4, ((16, 32), (32, 24))),
    )
}
