"""Fusions used by several tests: the bundled examples, with sizes as parameters."""

import torch
import torch.nn.functional as F

import codegen as cg
from codegen import examples


def stream_matmul_columns(m=5, k=7, n=6, slices=3):
    """nvFuser's StreamTest.Matmul: out columns split ``slices`` ways on streams."""
    return examples.stream_matmul_n(m, k, n, slices)


def stream_matmul_rows(slices=4, dtype=torch.float32):
    """[m, k] @ [k, n], symbolic extents, output rows in ``slices`` stream slices."""
    return examples.matmul_rows(dtype, slices)


def two_matmuls(inlinable: bool):
    """t2 = (inp @ w1) @ w2. Inlinable: rows of t2 on streams (2 slices). Not: columns of
    t1 (3 slices), then rows of t2 (2 slices)."""
    return examples.two_matmuls() if inlinable else examples.two_matmuls_not_inlinable()


def stream_loops(program):
    return [n for n in program.nodes()
            if isinstance(n, cg.hostir.ForLoop) and n.parallel is cg.ParallelType.Stream]


# Batched products, for their gradients: per kind, the op on a fusion's inputs, torch's
# same math and the inputs' shapes. "bmm": [b, m, k] @ [b, k, n]; "shared": [b, m, k] @
# [k, n] (the 2-D operand's gradient sums over the batch); "linear": a 3-D x with bias.
BATCHED_INPUTS = {
    "bmm": [("a", ["b", "m", "k"]), ("w", ["b", "k", "n"])],
    "shared": [("a", ["b", "m", "k"]), ("w", ["k", "n"])],
    "linear": [("x", ["b", "m", "k"]), ("w", ["n", "k"]), ("bias", ["n"])],
}
BATCHED_TORCH = {"bmm": torch.matmul, "shared": torch.matmul, "linear": F.linear}
BATCHED_SHAPES = {"bmm": [(4, 5, 3), (4, 3, 6)], "shared": [(4, 5, 3), (3, 6)],
                  "linear": [(4, 5, 3), (6, 3), (6,)]}


def batched(kind, dtype, axis, slices=2):
    """The batched product ``kind``, its output split ``slices`` ways on ``axis``."""
    with cg.Fusion(f"{kind}_split_{axis}") as f:
        inputs = [cg.input(shape, dtype, name=name) for name, shape in BATCHED_INPUTS[kind]]
        out = cg.linear(*inputs) if kind == "linear" else cg.matmul(*inputs)
        cg.output(out)
    out.outer_split(axis, slices)
    out.axis(axis).parallelize(cg.ParallelType.Stream)
    return f


def tiny_llama(dtype=torch.float32, seed=0, *, layers=2, hidden=64, intermediate=160, vocab=97,
               max_positions=64, tie=False, bias=False):
    """A small transformers Llama (4 heads, 2 KV heads) with random weights from ``seed``,
    on the CPU, in eval mode (``bias``: every Linear of its layers with a bias); the calling
    test is skipped where transformers is missing (a test extra: CI installs it)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, tie_word_embeddings=tie,
        attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def assert_same_greedy_generate(model, ref, prompt, new_tokens):
    """``model`` and ``ref`` generate the same ``new_tokens`` greedy tokens after
    ``prompt`` ([1, n] token ids)."""
    mask = torch.ones_like(prompt)
    got = model.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens,
                         do_sample=False)
    want = ref.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens,
                        do_sample=False)
    assert torch.equal(got, want), (got, want)


def allocated(nbytes):
    """What PyTorch's caching allocator takes for a tensor of ``nbytes`` (multiples of 512
    bytes), written out here rather than taken from the code under test."""
    return -(-nbytes // 512) * 512
