"""Decode steps replayed from a CUDA graph: one captured forward of one token per sequence over a static cache.

An eager K3 decode step is bound by the host: hundreds of kernel launches (a Triton launch costs 30-40 us of host
time) around a few ms of GPU work (BENCHMARKS.md, sixth session). A static `KimiK3Cache` (`max_cache_len`) keeps
every write position, length, padding flag and state in device buffers that do not move, so the step can be
captured once and replayed with the GPU running it back to back. `generate(..., cache_implementation="static")`
uses it on CUDA (the K3 generation mixin's `get_compiled_call`, where transformers would `torch.compile` the
forward); it needs `attn_implementation="k3_mla_paged"`, whose decode reads only those buffers.
"""

from __future__ import annotations

import torch


class DecodeGraph:
    """Decode steps of `model` over the static `cache`: eager once (which compiles every kernel variant the step
    uses; nothing may compile inside a capture), captured at the second step, replayed from then on.

    The capture records the step's device work without running it and runs its Python side once (the cache's
    host-side lengths move one token then), so the capture step replays at once and later replays move the host
    lengths with `cache.advance(1)`. The logits returned live in the graph's memory: the next step overwrites them.
    """

    def __init__(self, model, cache, logits_to_keep=1):
        if not cache.is_static:
            raise ValueError("DecodeGraph needs a static KimiK3Cache (KimiK3Cache(config, max_cache_len=N))")
        self.model, self.cache, self.logits_to_keep = model, cache, logits_to_keep
        self.graph = self.input_ids = self.logits = None
        self.steps = 0

    def _forward(self, input_ids):
        return self.model(input_ids=input_ids, cache=self.cache, use_cache=True,
                          logits_to_keep=self.logits_to_keep).logits

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"a decode step takes input_ids [batch, 1], got {list(input_ids.shape)}")
        if self.cache.get_seq_length() + 1 > self.cache.static_len:  # a replay would write past the last page
            raise ValueError(f"KimiK3Cache(max_cache_len={self.cache.static_len}) is full")
        if self.steps == 0:
            logits = self._forward(input_ids)
        elif self.graph is None:
            self.input_ids = input_ids.clone()
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph):
                    self.logits = self._forward(self.input_ids)
            except RuntimeError as e:
                self.graph = None
                raise RuntimeError(
                    "capturing the K3 decode step in a CUDA graph failed: something in the step synchronises with the "
                    "host (for example experts_implementation='eager', which loops over the experts in Python). Use "
                    "experts_implementation='k3_triton', or decode eagerly (generate(..., disable_compile=True)); "
                    "this cache's host-side lengths have moved one step and it must be rebuilt"
                ) from e
            self.graph.replay()
            logits = self.logits
        else:
            if input_ids.shape != self.input_ids.shape:
                raise ValueError(f"the captured step takes input_ids {list(self.input_ids.shape)}, got "
                                 f"{list(input_ids.shape)}")
            self.input_ids.copy_(input_ids)
            self.graph.replay()
            self.cache.advance(1)
            logits = self.logits
        self.steps += 1
        return logits
