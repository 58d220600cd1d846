"""CUDA graphs of an MoE layer for a set of batch sizes (decode), replayed by token count.

The layer's device path (`MoELayer(path="device")`, or "auto" under no_grad / inference_mode)
has static shapes for a given token count and never synchronizes with the host, so a plain

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x_static)
    ...; x_static.copy_(x); g.replay()     # y now holds layer(x)

captures it (warm the layer up once on the same shapes first, as for any capture: the first
calls compile kernels and allocate workspaces). `GraphedMoE` does this for several token counts,
sharing one memory pool, and replays the smallest captured size that holds the batch: the
batch is copied into the graph's input, the padding rows get token_mask False (routed nowhere,
so they cost no expert work and do not count in the expert load), and the first T rows of the
graph's output are returned.

The returned tensor is a view of the graph's static output: it is overwritten by the next
replay of that size (clone it to keep it). Inputs are checked before anything runs: a batch
larger than the largest captured size, or a dtype, hidden size or device other than the
capture's, raises ValueError. Ids outside the expert range are counted on the device
(`layer.raise_on_bad_ids()`), not checked per replay.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megapar.moe.layer import MoELayer


class GraphedMoE:
    """`layer` captured for each of `token_counts` (see the module docstring)."""

    def __init__(self, layer: MoELayer, token_counts: Sequence[int], *, dtype: torch.dtype | None = None,
                 warmup: int = 2) -> None:
        counts = sorted({int(t) for t in token_counts}, reverse=True)
        if not counts or counts[-1] < 1:
            raise ValueError(f"token_counts must be ints >= 1, got {list(token_counts)}")
        device = layer.expert_counts.device
        if layer.path == "host":
            raise ValueError("GraphedMoE needs the device path: build the layer with path='device' or 'auto'")
        with torch.no_grad():   # (the path each size takes: a host-path size would sync inside the capture)
            host = [t for t in counts
                    if layer.choose_path(torch.empty(t, layer.config.hidden, device="meta")) != "device"]
        if host:
            raise ValueError(f"token counts {sorted(host)} take this layer's host path (transport "
                             f"{layer.transport!r}; path 'auto' leaves the all-gather transport above "
                             f"MEGAPAR_ALLGATHER_MAX_TOKENS tokens), which cannot be captured: capture only sizes "
                             f"that take the device path, or build the layer with path='device'")
        if device.type != "cuda":
            raise ValueError(f"GraphedMoE needs a layer on a CUDA device, got {device}")
        self.layer = layer
        self.dtype = dtype or layer.config.dtype
        self.hidden = layer.config.hidden
        self.device = device
        self.hash_layer = layer.config.hash_layer
        self.sizes = sorted(counts)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                      torch.Tensor]] = {}
        pool = None
        # the warm-up forwards are not traffic: EPLB's load tracker gets its counts back afterwards
        # (in place: the graphs count into this very tensor on replay)
        tracker = layer.eplb.tracker if layer.eplb is not None else None
        saved_load = tracker.step_counts.clone() if tracker is not None else None
        with torch.no_grad():  # (not inference_mode: the static inputs must stay writable outside it)
            for t in counts:  # largest first: the smaller graphs fit in its pool
                x = torch.zeros(t, self.hidden, dtype=self.dtype, device=device)
                mask = torch.ones(t, dtype=torch.bool, device=device)
                ids = torch.zeros(t, dtype=torch.int64, device=device) if self.hash_layer else None
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        layer(x, input_ids=ids, token_mask=mask)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = layer(x, input_ids=ids, token_mask=mask)
                pool = graph.pool()
                self._graphs[t] = (graph, x, mask, ids, out)
        layer.expert_counts.zero_()
        if tracker is not None:
            tracker.step_counts.copy_(saved_load)
        self._filled: dict[int, int] = {t: t for t in counts}  # rows of real tokens the static input was set up for

    def size_for(self, num_tokens: int) -> int:
        """The captured size a batch of `num_tokens` replays."""
        for t in self.sizes:
            if t >= num_tokens:
                return t
        raise ValueError(f"a batch of {num_tokens} tokens exceeds the largest captured size ({self.sizes[-1]}); "
                         f"captured sizes: {self.sizes}")

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H] (a view of the graph's output; see the module docstring)."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, hidden={self.hidden}], got {tuple(x.shape)}")
        if x.dtype != self.dtype or x.device != self.device:
            raise ValueError(f"x is {x.dtype} on {x.device}; the graphs were captured for {self.dtype} on "
                             f"{self.device}")
        if self.hash_layer and (input_ids is None or input_ids.shape != (x.shape[0],)):
            raise ValueError(f"this hash layer needs input_ids [T={x.shape[0]}], got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        t = x.shape[0]
        if t == 0:
            return x.new_zeros(0, self.hidden)
        size = self.size_for(t)
        graph, x_static, mask, ids_static, out = self._graphs[size]
        with torch.no_grad():
            x_static[:t].copy_(x)
            if self._filled.get(size) != t:  # the padding rows and the mask change only with T
                x_static[t:].zero_()
                mask[:t].fill_(True)
                mask[t:].fill_(False)
                self._filled[size] = t
            if ids_static is not None:
                ids_static[:t].copy_(input_ids)
                ids_static[t:].zero_()
            graph.replay()
        return out[:t]
