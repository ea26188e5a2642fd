"""Decode steps a CUDA graph can capture, for models offloaded with :func:`codegen.nn.offload`
(or any transformers causal LM): ``StaticDecodeStep`` (one token over a preallocated KV
cache, its token and position static device tensors) and ``capture_graph`` (warm-up on a
side stream, then capture, as torch's CUDA-graph docs do).

    from codegen.nn import StaticDecodeStep, capture_graph
    step = StaticDecodeStep(model, prompt, token, max_len=prompt.shape[1] + 64)
    graph, logits = capture_graph(step)     # graph.replay() reruns the step
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch


def capture_graph(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Captures one call of ``fn`` (static inputs, its output becomes the static output)
    after three warm-up calls on a side stream, as torch's CUDA-graph docs do, and on
    that same stream: a codegen op whose GEMMs run on the caller's stream (one slice, or
    pool_size=1) then finds that stream's cuBLASLt workspace allocated, as eager calls
    do (none is allocated during capture).
    Returns (graph, static output); ``graph.replay()`` reruns the call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def cache_keyword(model: Any) -> str:
    """The forward's KV-cache keyword: ``cache`` in newer transformers releases (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def static_cache(model: Any, max_len: int) -> Any:
    """A ``transformers.StaticCache`` of ``max_len`` positions for ``model`` (batch 1): its
    keys and values are preallocated and each step writes into them in place, which a
    CUDA graph can capture (a ``DynamicCache`` concatenates). Made with the constructor
    arguments the installed release takes: older ones allocate at once and take the batch
    size (``batch_size`` or ``max_batch_size``), device and dtype (the model's input
    embeddings'); newer ones allocate on the first forward."""
    import transformers

    params = inspect.signature(transformers.StaticCache.__init__).parameters
    embeddings = model.get_input_embeddings().weight
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": max_len}
    batch = next((k for k in ("batch_size", "max_batch_size") if k in params), None)
    if batch is not None:
        kwargs[batch] = 1
    if "device" in params:
        kwargs["device"] = embeddings.device
    if "dtype" in params:
        kwargs["dtype"] = embeddings.dtype
    return transformers.StaticCache(**kwargs)


class StaticDecodeStep:
    """One-token decode steps of a transformers causal LM over a ``static_cache`` of
    ``max_len`` positions, in a form a CUDA graph can capture: the token and its position
    are static device tensors, ``token`` [1, 1] and ``position`` [1], that the caller
    rewrites in place (``copy_``) between calls or graph replays. A step reads them on the
    device only (no host read, no shape that depends on them), writes the token's keys and
    values at ``position`` and attends to positions 0..position (the rest of the cache is
    masked); it returns the logits [1, 1, vocab].

    The constructor prefills ``prompt`` [1, n] (positions 0..n-1) and sets ``token`` to
    ``token`` and ``position`` to n. A call with ``position`` unchanged rewrites that
    position (the same step again); advancing ``position`` by one per call decodes a
    sequence.

    Where the position goes depends on the transformers release: a forward that takes
    ``cache_position`` (4.x and the first 5.x releases) gets ``position`` there, and the
    cache and the attention mask follow it; later releases' static cache layers keep their
    write position in a device tensor of their own (``cumulative_length``), which each step
    sets from ``position`` before the forward, and the mask follows that tensor."""

    def __init__(self, model: Any, prompt: torch.Tensor, token: torch.Tensor,
                 max_len: int) -> None:
        n = prompt.shape[1]
        if prompt.shape[0] != 1 or max_len <= n:
            raise ValueError(f"StaticDecodeStep: need a [1, n] prompt and max_len > n, got "
                             f"{tuple(prompt.shape)} and max_len {max_len}")
        self.model, self.length = model, n
        self.keyword = cache_keyword(model)
        self.takes_cache_position = "cache_position" in inspect.signature(
            model.forward).parameters
        self.cache = static_cache(model, max_len)
        self.token = token.reshape(1, 1).clone()
        self.position = torch.full((1,), n, dtype=torch.long, device=prompt.device)
        self._forward(prompt, torch.arange(n, device=prompt.device))
        if not self.takes_cache_position:
            self._check_write_positions(n)

    def _check_write_positions(self, n: int) -> None:
        """After the prefill, every cache layer keeps its write position in a device
        tensor, at ``n``; otherwise a step cannot set it in this release."""
        layers = getattr(self.cache, "layers", None) or []
        if not layers or not all(
                isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
                and not getattr(layer, "is_sliding", False)
                and int(layer.cumulative_length) == n for layer in layers):
            raise RuntimeError(
                "StaticDecodeStep: this transformers release takes no cache_position, and "
                "its static cache layers keep no write position tensor (cumulative_length) "
                "at the prompt length that a step could set")

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits of ``ids`` at ``positions`` (1-D, on the device), written into the
        cache there."""
        kwargs = {self.keyword: self.cache, "use_cache": True,
                  "position_ids": positions.view(1, -1)}
        if self.takes_cache_position:
            kwargs["cache_position"] = positions
        with torch.no_grad():
            return self.model(ids, **kwargs).logits

    def __call__(self) -> torch.Tensor:
        """One step: ``token`` at ``position``; its logits."""
        if not self.takes_cache_position:
            for layer in self.cache.layers:
                layer.cumulative_length.copy_(self.position[0])
        return self._forward(self.token, self.position)
