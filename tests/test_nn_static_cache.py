"""The decode step over a static KV cache (``codegen.nn.StaticDecodeStep``) that the
GPU tests and ``offload_llama`` capture in a CUDA graph, run eagerly on the CPU: a tiny
transformers Llama, its Linears offloaded and run through the evaluator, against the
original and against a forward of the whole sequence without a cache."""

import copy

import pytest
import torch
from helpers import tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

import codegen.nn
from codegen.nn import StaticDecodeStep, static_cache

transformers = pytest.importorskip("transformers")  # a test extra: CI installs it

PROMPT, STEPS, MAX_LEN = 7, 3, 16  # the cache keeps unwritten positions after the steps


def decode(model, prompt, tokens):
    """The logits of each of ``tokens`` [1, k], decoded one step at a time after
    ``prompt`` by rewriting the step's static token and position in place."""
    step = StaticDecodeStep(model, prompt, tokens[:, :1], max_len=MAX_LEN)
    assert step.position.tolist() == [PROMPT] and torch.equal(step.token, tokens[:, :1])
    logits = []
    for i in range(tokens.shape[1]):
        step.token.copy_(tokens[:, i:i + 1])
        step.position.copy_(torch.tensor([PROMPT + i]))
        logits.append(step().clone())
    return torch.cat(logits, dim=1)


def test_decode_steps_match_the_whole_sequence_and_the_offloaded_model():
    ref = tiny_llama()
    model = codegen.nn.offload(copy.deepcopy(ref), slices=2, device="cpu")
    prompt, tokens = torch.randint(0, 97, (1, PROMPT)), torch.randint(0, 97, (1, STEPS))
    expect = decode(ref, prompt, tokens)
    with torch.no_grad():
        whole = ref(torch.cat([prompt, tokens], dim=1), use_cache=False).logits
    torch.testing.assert_close(expect, whole[:, PROMPT:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode(model, prompt, tokens), expect, rtol=1e-5, atol=1e-5)


def test_a_step_at_an_unchanged_position_rewrites_it():
    ref = tiny_llama(seed=1)
    prompt, token = torch.randint(0, 97, (1, PROMPT)), torch.tensor([[5]])
    step = StaticDecodeStep(ref, prompt, token, max_len=PROMPT + 1)  # as offload_llama's
    first = step().clone()
    for _ in range(2):
        assert torch.equal(step(), first)
    with torch.no_grad():
        whole = ref(torch.cat([prompt, token], dim=1), use_cache=False).logits
    torch.testing.assert_close(first, whole[:, -1:], rtol=1e-5, atol=1e-5)


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (``.item()``, ``bool()``,
    ``int()``) or whose output shape depends on values (a boolean mask index included):
    on a GPU each one synchronizes with the device, and a CUDA graph cannot capture it."""

    READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
             "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim")
    INDEXING = ("aten::index", "aten::index_put", "aten::index_put_")

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.READS or (name in self.INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_a_step_reads_no_value_on_the_host():
    ref = tiny_llama()
    step = StaticDecodeStep(ref, torch.randint(0, 97, (1, PROMPT)), torch.tensor([[3]]),
                            max_len=MAX_LEN)
    with HostReads() as mode:
        step()
        step.position.add_(1)
        step()
    assert mode.reads == []


def test_a_static_cache_is_made_and_needs_room_after_the_prompt():
    assert isinstance(static_cache(tiny_llama(), MAX_LEN), transformers.StaticCache)
    with pytest.raises(ValueError, match="max_len > n"):
        StaticDecodeStep(tiny_llama(), torch.zeros(1, 4, dtype=torch.long),
                         torch.tensor([[1]]), max_len=4)


def test_the_benchmark_graph_row_decodes_what_the_eager_row_decodes():
    from benchmarks import offload_llama as ol

    ref = tiny_llama(seed=2)
    prompt, token = torch.randint(0, 97, (1, 12)), torch.tensor([[7]])
    static = StaticDecodeStep(ref, prompt, token, max_len=13)
    torch.testing.assert_close(static(), ol.DecodeStep(ref, prompt, token)(),
                               rtol=1e-5, atol=1e-5)
