"""The MoE layer users import: `MoELayer(config, ep_group)` maps hidden states [T, H] to the
MoE output [T, H] at any expert-parallel size.

    out = combine(experts(dispatch(x, route(gate(x))))) + shared_experts(x)

Token modes (`tokens=`):
- "sequence_parallel": each EP rank brings its own tokens; they travel to the experts'
  ranks through `parallel.ep` dispatch/combine and come back weighted (fp32 sum).
- "replicated": every EP rank holds the same tokens (e.g. TP-replicated activations). Nothing
  is dispatched: each rank runs its own experts on the tokens routed to them (a local
  dispatch), and the partial outputs are all-reduced over the EP group (autograd: identity
  into the region with an all-reduced gradient, all-reduce out of it with an identity one).
At EP = 1 there is no communication at all in either mode.

Overlap (`overlap_chunks=n > 1`): the tokens are split into n chunks; chunk i+1 is dispatched
(async) before chunk i's experts run, and chunk i's combine (or all-reduce) is in flight while
chunk i+1 computes. Per token the arithmetic is that of the plain path (same experts, same
weights, fp32 combine over k), so outputs agree to rounding of the GEMM blocking. Every rank
of the group must use the same n (chunks may be empty). Default: 1 at EP = 1, else 2.
Micro-batch overlap (`parallel.ubatch`) is the other mechanism: the plain path yields to the
other micro-batch around dispatch and combine (no-ops outside a `UBatchRunner`).

Expert load: every forward counts the tokens per logical expert with one scatter-add
(`layer.expert_counts`, [E] int64, this rank's tokens); with `eplb=` the ids are mapped to
physical slots through `Eplb.route`, which records the per-slot counts for rebalancing.

Forward paths (`path=`):
- "device": every shape fixed by the token count, counts and offsets on the device, no host
  synchronization, so `torch.cuda.graph` can capture a forward (see `moe.graphs` for a helper
  that captures several batch sizes). Routing (one launch), the permutation of the T*K pairs
  by local expert (`parallel.ep.static.plan_static`: one launch at decode sizes), one gather of
  the rows, the two grouped GEMMs (SwiGLU in the first one's epilogue; grids sized from T*K,
  experts without rows skipped on the device), one gather-reduce for the fp32 weighted top-k
  sum; the shared expert runs on a side stream on CUDA, overlapped with the routed experts.
  When the experts run the W4A8 path (many rows per expert), each token is quantized to
  fp8_token once, before the gather, instead of each of its top-k copies after it: the same
  bits (the quantization is per row), 1/K of the quantize work, half the gathered bytes.
  Runs at EP = 1, in the "replicated" token mode (one all-reduce), and at EP > 1 in
  "sequence_parallel" mode through the fixed-size all-gather transport (`max_tokens` per rank).
- "host": the `parallel.ep` Dispatcher (a census per dispatch learns the split sizes on the
  host), with autograd and the overlapped chunk pipeline; needed for all-to-all at EP > 1.
- "auto" (default): "host" when autograd needs the forward (the device path is inference
  only), when EP > 1 in sequence_parallel mode has no `max_tokens`, when the transport asked
  for is "all_to_all", or when T exceeds `ALLGATHER_MAX_TOKENS` per rank at EP > 1 (large
  prefill is cheaper with the all-to-all, which moves each token only to the ranks it needs);
  "device" otherwise, at every T at EP = 1.

Ids outside the expert range (a corrupted hash table or EPLB map) are routed nowhere on the
device path and counted in `layer.bad_ids` (int32 [1], on the device); `layer.raise_on_bad_ids()`
reads it (one sync) and raises, naming the count. The host path checks them at dispatch.

Loading: `load_deepseek(state)` takes DeepSeek names relative to the MoE module
(`gate.weight`, `gate.e_score_correction_bias`, `gate.tid2eid`, `experts.{e}.w1/w2/w3.weight`
[+ scales], `shared_experts.w1/w2/w3.weight`) and keeps only this rank's experts.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Mapping

import torch
import torch.distributed as dist
from torch import nn

from megapar.moe.experts import EXPERT_FORMATS, GATE_UP_LAYOUTS, INITS, Experts, SharedExpert
from megapar.moe.router import SCORING_FUNCS, Router, Scoring
from megapar.parallel import comm
from megapar.parallel.ep import static
from megapar.parallel.ep.layout import gather_reduce, gather_rows
from megapar.parallel.groups import Group
from megapar.parallel.quant import QuantizedTensor, quantize
from megapar.parallel.ubatch import ubatch_yield

if TYPE_CHECKING:
    from megapar.moe.loading import SafetensorsState

TOKEN_MODES: tuple[str, ...] = ("replicated", "sequence_parallel")
PATHS: tuple[str, ...] = ("auto", "device", "host")
TRANSPORTS: tuple[str, ...] = ("auto", "all_to_all", "allgather", "nvshmem")
# At EP > 1 (sequence_parallel tokens), "auto" takes the device path's all-gather transport up to
# this many tokens per rank and the host path's all-to-all above it. Users of vLLM, SGLang and
# Megatron report all-gather/reduce-scatter winning at decode sizes for EP <= 8; the crossover
# has not been measured by megapar yet (it needs a multi-GPU machine: `megapar bench moe
# --device cuda --world-size 8`). MEGAPAR_ALLGATHER_MAX_TOKENS overrides it.
ALLGATHER_MAX_TOKENS = int(os.environ.get("MEGAPAR_ALLGATHER_MAX_TOKENS", "256"))


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """Shape and behaviour of one MoE layer (docs/numerics.md §1-3)."""

    hidden: int
    """model hidden size H"""
    inter: int
    """intermediate size I of one routed expert"""
    num_experts: int
    """routed (logical) experts E"""
    top_k: int
    """experts per token K"""
    scoring: Scoring = "sigmoid"
    """router score function: softmax, sigmoid (V3), sqrt_softplus (V4)"""
    use_bias: bool = True
    """router has e_score_correction_bias (selection only)"""
    n_group: int | None = None
    """expert groups for grouped top-k (V3: 8); None = no group limit"""
    topk_group: int | None = None
    """groups kept per token (V3: 4)"""
    renormalize: bool = True
    """divide the K weights by their sum"""
    routed_scaling: float = 1.0
    """routed_scaling_factor applied to the weights"""
    swiglu_limit: float | None = None
    """clamp L of the routed experts' SwiGLU (V4: 10); None = no clamp"""
    swiglu_alpha: float = 1.0
    """SwiGLU alpha (DeepSeek 1, gpt-oss 1.702)"""
    swiglu_beta: float = 0.0
    """SwiGLU beta (DeepSeek 0, gpt-oss 1)"""
    gate_up: Literal["split", "interleaved"] = "split"
    """row layout of the fused W13"""
    num_shared: int = 1
    """shared experts (one MLP of width num_shared * shared_inter); 0 = none"""
    shared_inter: int | None = None
    """intermediate size of one shared expert (default: inter)"""
    shared_swiglu_limit: float | None = None
    """clamp of the shared expert's SwiGLU"""
    expert_format: str = "bf16"
    """routed expert weights: bf16, fp32, fp8_block, mxfp4, nvfp4"""
    hash_layer: bool = False
    """route by tid2eid[input_ids] (V4's first num_hash_layers layers)"""
    num_hash_layers: int = 0
    """model-level: how many leading MoE layers are hash layers (see for_layer)"""
    vocab: int | None = None
    """vocabulary size (the hash table's rows); needed by hash layers"""
    dtype: torch.dtype = torch.bfloat16
    """activation dtype (and shared expert weights)"""
    router_dtype: torch.dtype = torch.float32
    """gate weight dtype (logits are fp32 regardless)"""

    def __post_init__(self) -> None:
        for name in ("hidden", "inter", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"unknown scoring {self.scoring!r}; valid: {', '.join(SCORING_FUNCS)}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert format {self.expert_format!r}; valid: {', '.join(EXPERT_FORMATS)}")
        if self.gate_up not in GATE_UP_LAYOUTS:
            raise ValueError(f"unknown gate_up layout {self.gate_up!r}; valid: {', '.join(GATE_UP_LAYOUTS)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if (self.hash_layer or self.num_hash_layers) and not self.vocab:
            raise ValueError("hash layers need vocab (rows of the tid2eid table)")
        if self.num_shared < 0:
            raise ValueError(f"num_shared ({self.num_shared}) must be >= 0 (0 = no shared expert)")
        if self.shared_inter is not None and self.shared_inter < 1:
            raise ValueError(f"shared_inter ({self.shared_inter}) must be >= 1 or None (= inter); "
                             "num_shared=0 means no shared expert")
        for name in ("swiglu_limit", "shared_swiglu_limit"):
            limit = getattr(self, name)
            if limit is not None and not limit > 0:  # (NaN too)
                raise ValueError(f"{name} ({limit}) must be > 0, or None for no clamp (DeepSeek's configs "
                                 "write 0 for none; as a clamp, 0 zeroes the SwiGLU)")
        if not math.isfinite(self.routed_scaling):  # (every routed output NaN / inf)
            raise ValueError(f"routed_scaling ({self.routed_scaling}) must be a finite number")
        if self.num_hash_layers < 0:
            raise ValueError(f"num_hash_layers ({self.num_hash_layers}) must be >= 0")
        if self.vocab is not None and self.vocab < 1:
            raise ValueError(f"vocab ({self.vocab}) must be >= 1 or None")

    def for_layer(self, index: int) -> MoEConfig:
        """This config for MoE layer `index` (a hash layer when index < num_hash_layers)."""
        return replace(self, hash_layer=index < self.num_hash_layers)

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> MoEConfig:
        """From a checkpoint's config: a transformers DeepSeek V3 / V4 config object, its config.json
        dict, or DeepSeek's inference config.json. Reads every field that changes the math (experts,
        top-k, groups, scoring, bias, norm_topk_prob, routed_scaling_factor, the routed and shared
        SwiGLU limits, hash layers, shared expert width, expert format); `overrides` win (e.g.
        dtype=, expert_format=). The mapping is in `moe.hf`."""
        from megapar.moe.hf import moe_kwargs_from_hf

        return cls(**{**moe_kwargs_from_hf(config), **overrides})

    @classmethod
    def deepseek_v3(cls, **overrides: Any) -> MoEConfig:
        """DeepSeek-V3: H 7168, I 2048, 256 experts top-8, sigmoid + bias, 8 groups keep 4, scale 2.5,
        no SwiGLU clamp (as its config.json and HF's DeepseekV3MoE)."""
        return cls(**{**dict(hidden=7168, inter=2048, num_experts=256, top_k=8, scoring="sigmoid", n_group=8,
                             topk_group=4, routed_scaling=2.5, num_shared=1), **overrides})

    @classmethod
    def deepseek_v4_flash(cls, **overrides: Any) -> MoEConfig:
        """DeepSeek-V4-Flash: H 4096, I 2048, 256 experts top-6, sqrt(softplus) + bias, no group
        limit, routed_scaling_factor 1.5, SwiGLU clamped at L = 10 in the routed *and* the shared
        expert (DeepSeek's inference code and HF's DeepseekV4MLP both clamp the shared one), the
        first 3 MoE layers hash-routed over a 129280-token vocabulary (its config.json)."""
        return cls(**{**dict(hidden=4096, inter=2048, num_experts=256, top_k=6, scoring="sqrt_softplus",
                             routed_scaling=1.5, swiglu_limit=10.0, shared_swiglu_limit=10.0, num_shared=1,
                             num_hash_layers=3, vocab=129280), **overrides})

    @classmethod
    def deepseek_v4_pro(cls, **overrides: Any) -> MoEConfig:
        """DeepSeek-V4-Pro: H 7168, I 3072, 384 experts top-6, sqrt(softplus) + bias, scale 2.5,
        SwiGLU clamped at L = 10 in the routed and the shared expert. num_hash_layers / vocab come
        from the checkpoint's config (`from_hf_config`)."""
        return cls(**{**dict(hidden=7168, inter=3072, num_experts=384, top_k=6, scoring="sqrt_softplus",
                             routed_scaling=2.5, swiglu_limit=10.0, shared_swiglu_limit=10.0, num_shared=1),
                      **overrides})


PRESETS = {"v3": MoEConfig.deepseek_v3, "v4_flash": MoEConfig.deepseek_v4_flash, "v4_pro": MoEConfig.deepseek_v4_pro}


class MoELayer(nn.Module):
    """Router -> dispatch -> experts -> combine -> + shared expert (see module docstring)."""

    def __init__(
        self,
        config: MoEConfig,
        ep_group: Group | dist.ProcessGroup | None = None,
        *,
        tokens: Literal["replicated", "sequence_parallel"] = "sequence_parallel",
        path: Literal["auto", "device", "host"] = "auto",
        transport: Literal["auto", "all_to_all", "allgather"] = "auto",
        kernels: str = "auto",
        resident_fp8: bool = False,
        max_tokens: int | None = None,
        overlap_chunks: int | None = None,
        align: int = 1,
        eplb: Any = None,
        layer_index: int = 0,
        device: torch.device | str | None = None,
        init: Literal["random", "empty", "meta"] = "random",
        dispatcher_backend: str | None = None,
        kernel_backend: str | None = None,
        backend: str | None = None,
    ) -> None:
        """ep_group: a parallel Group, a ProcessGroup, or None for EP = 1 (no communication, even
        when torch.distributed is initialized).
        path: which forward runs (module docstring). transport: how tokens reach other EP ranks
        ("allgather": fixed-size all-gather + reduce-scatter, device path; "all_to_all": the
        host-synced dispatcher; "auto" picks by token count). kernels: the expert GEMM
        implementation (`moe.kernels.expert_ffn` backend: "auto", "torch", "torch_grouped_mm",
        "triton_w4a16", "triton_w4a8"); resident_fp8: keep mxfp4 experts' exact FP8 form resident
        for the W4A8 prefill path (`moe.experts.Experts`; 2x the FP4 bytes more). max_tokens: the most tokens one rank brings to one call
        (static shapes of the all-gather transport at EP > 1). overlap_chunks / align: host path
        options (chunked dispatch overlap; expert block padding). eplb: a
        `parallel.ep.eplb_state.Eplb` shared by the model's MoE layers (physical slots, load
        tracking), with `layer_index` this layer's row. init: "random" (weights drawn and quantized
        on `device`), "empty" (storage allocated, values undefined until loaded) or "meta"
        (nothing allocated; loading materializes on `device`): with a checkpoint to load, use
        "empty" or "meta" (`load_safetensors`, `load_deepseek`).
        Deprecated names: dispatcher_backend (= transport), kernel_backend (= kernels), backend
        ("python", the only layer implementation)."""
        super().__init__()
        if dispatcher_backend is not None:
            warnings.warn("MoELayer(dispatcher_backend=) is deprecated; use transport=", DeprecationWarning, stacklevel=2)
            transport = dispatcher_backend  # type: ignore[assignment]
        if kernel_backend is not None:
            warnings.warn("MoELayer(kernel_backend=) is deprecated; use kernels=", DeprecationWarning, stacklevel=2)
            kernels = kernel_backend
        if backend is not None:
            if backend != "python":
                raise ValueError(f"MoELayer backend={backend!r} is not implemented; the layer has one implementation "
                                 "(omit backend=; choose kernels= and transport= instead)")
            warnings.warn("MoELayer(backend='python') is deprecated; omit it", DeprecationWarning, stacklevel=2)
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; valid: {', '.join(INITS)}")
        if tokens not in TOKEN_MODES:
            raise ValueError(f"unknown tokens mode {tokens!r}; valid: {', '.join(TOKEN_MODES)}")
        if path not in PATHS:
            raise ValueError(f"unknown MoE forward path {path!r}; valid: {', '.join(PATHS)}")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown EP transport {transport!r}; valid: {', '.join(TRANSPORTS)}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise ValueError(f"max_tokens ({max_tokens!r}) must be an int >= 1 or None")
        if ep_group is None:
            pg, rank, size = None, 0, 1
        else:
            pg, rank, size = comm.resolve_group(ep_group)
        num_slots_total = eplb.num_physical if eplb is not None else config.num_experts
        if num_slots_total % size:
            valid = [d for d in range(1, num_slots_total + 1) if num_slots_total % d == 0]
            raise ValueError(f"num_experts ({num_slots_total}{' physical' if eplb is not None else ''}) is not "
                             f"divisible by the EP size ({size}); valid EP sizes: {', '.join(map(str, valid))}")
        distributed = size > 1 and tokens == "sequence_parallel"
        if path == "device" and distributed:
            if transport == "all_to_all":
                raise ValueError("path='device' at EP > 1 runs on transport='allgather' (or 'auto'); all_to_all "
                                 "needs host-known split sizes (path='host')")
            if max_tokens is None:
                raise ValueError(f"path='device' at EP > 1 (EP size {size}, sequence_parallel tokens) needs "
                                 "max_tokens: the most tokens one rank brings to a call (every rank pads to it)")
        if overlap_chunks is None:
            overlap_chunks = 1 if size == 1 else 2
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks ({overlap_chunks}) must be >= 1")
        self.config, self.tokens, self.overlap_chunks = config, tokens, overlap_chunks
        self.path, self.transport, self.max_tokens = path, transport, max_tokens
        self.ep_group, self.ep_rank, self.ep_size = pg, rank, size
        self.eplb, self.layer_index = eplb, layer_index
        self.num_slots_total = num_slots_total
        self.num_slots = num_slots_total // size
        if eplb is not None:
            if eplb.ep_size != size:
                raise ValueError(f"eplb was built for EP size {eplb.ep_size}; this layer's EP group has {size}")
            if eplb.num_logical != config.num_experts:
                raise ValueError(f"eplb was built for {eplb.num_logical} logical experts; this layer has "
                                 f"num_experts {config.num_experts}")
            if not 0 <= layer_index < eplb.num_layers:
                raise ValueError(f"layer_index ({layer_index}) is outside the eplb's {eplb.num_layers} layers")
            local = eplb.local_experts(layer_index).tolist()
        else:
            local = list(range(rank * self.num_slots, (rank + 1) * self.num_slots))

        dense_device = device if init == "random" else "meta"
        self.gate = Router(config.hidden, config.num_experts, config.top_k, scoring=config.scoring,
                           use_bias=config.use_bias and not config.hash_layer, n_group=config.n_group,
                           topk_group=config.topk_group, renormalize=config.renormalize,
                           scaling=config.routed_scaling, hash_vocab=config.vocab if config.hash_layer else None,
                           dtype=config.router_dtype, device=dense_device)
        self.experts = Experts(config.num_experts, config.hidden, config.inter, fmt=config.expert_format,
                               local_experts=local, swiglu_limit=config.swiglu_limit, alpha=config.swiglu_alpha,
                               beta=config.swiglu_beta, gate_up=config.gate_up, device=device,
                               backend=kernels, init=init, resident_fp8=resident_fp8)
        if config.num_shared > 0:
            self.shared_experts = SharedExpert(config.hidden, config.num_shared * (config.shared_inter or config.inter),
                                               swiglu_limit=config.shared_swiglu_limit, dtype=config.dtype,
                                               device=dense_device)
        else:
            self.shared_experts = None
        if init == "empty":  # (built on meta above: no random init to throw away)
            for m in (self.gate, self.shared_experts):
                if m is not None:
                    m.to_empty(device=self.experts.device)
        if eplb is not None:
            eplb.register_weights(layer_index, self.experts.slot_tensors())

        from megapar.parallel.ep import make_dispatcher

        local_group = Group(name="ep_local", group=None, rank=0, size=1, ranks=(rank,))
        host_transport = "all_to_all" if transport in ("auto", "nvshmem") else transport
        self.dispatcher = make_dispatcher(ep_group if distributed else local_group,
                                          num_slots_total if distributed else self.num_slots, config.hidden,
                                          backend=host_transport if distributed else "auto", align=align)
        if not distributed:
            self._device_transport: Any = (static.ReplicatedTransport(pg) if size > 1
                                           else static.LocalTransport())
        elif transport == "nvshmem":  # device-initiated low-latency transport (parallel.ep.nvshmem)
            if max_tokens is None:
                raise ValueError("transport='nvshmem' needs max_tokens (its symmetric buffers are sized from it)")
            from megapar.parallel.ep.nvshmem import NvshmemConfig, NvshmemTransport

            self._device_transport = NvshmemTransport.create(pg, NvshmemConfig(
                max_tokens=max_tokens, hidden=config.hidden, top_k=config.top_k, num_experts=num_slots_total,
                dtype=config.dtype), device=device)
        elif max_tokens is not None and transport != "all_to_all":
            self._device_transport = static.AllGatherTransport(pg, size, max_tokens)
        else:
            self._device_transport = None
        self.register_buffer("expert_counts", torch.zeros(config.num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("bad_ids", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)
        self._side_streams: dict[torch.device, Any] = {}
        self._graphed: Any = None  # enable_cuda_graphs()
        self._graph_counts: tuple[int, ...] = ()
        self._graph_key: tuple | None = None

    # ---- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] (or [..., H]); input_ids: [T] int (hash layers); token_mask: [T] bool (False =
        padding token: routed nowhere, output = shared expert only); both may take x's leading
        shape ([...]) -> [T, H] (x's shape) in x's dtype."""
        cfg = self.config
        if not x.is_floating_point():  # (the device path returned integer zeros without an expert)
            raise ValueError(f"x must hold float activations [T, H]; got {x.dtype}")
        if x.shape[-1] != cfg.hidden:
            raise ValueError(f"MoE hidden size mismatch: x has {x.shape[-1]}, the layer expects {cfg.hidden}")
        if self.shared_experts is not None and x.dtype != self.shared_experts.w1.weight.dtype:
            raise ValueError(f"x is {x.dtype} but the layer's dense weights are {self.shared_experts.w1.weight.dtype}; "
                             f"pass activations in that dtype (or .to() the layer)")
        if x.device != self.expert_counts.device:
            raise ValueError(f"x is on {x.device} but the layer's weights are on {self.expert_counts.device}")
        if cfg.hash_layer and input_ids is None:
            raise ValueError("this MoE layer is a hash layer (tid2eid routing) and needs input_ids: [T] token ids")
        shape = x.shape
        x = x.reshape(-1, cfg.hidden)
        if input_ids is not None:
            input_ids = input_ids.reshape(-1)
        if token_mask is not None and token_mask.shape == shape[:-1]:  # ([B, S] for x [B, S, H])
            token_mask = token_mask.reshape(-1)
        if self._graphed is not None and token_mask is None and self._replayable(x):
            return self._graphed(x, input_ids).clone().reshape(shape)
        path = self.choose_path(x)
        side = self._side_stream(x) if self.shared_experts is not None and path == "device" else None
        shared = None
        if side is not None:  # the shared expert overlaps the routed experts on a second stream
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self.shared_experts(x)
            x.record_stream(side)
        routing = self.gate(x, input_ids=input_ids, token_mask=token_mask)
        topk_ids, topk_weights = routing.topk_ids, routing.topk_weights
        # EP = 1 without EPLB: the device plan's per-slot counts are the expert counts (one copy)
        counts_from_plan = path == "device" and self.ep_size == 1 and self.eplb is None
        if not counts_from_plan:
            self.count_experts(topk_ids)
        if self.eplb is not None:
            topk_ids = self.eplb.route(self.layer_index, topk_ids, self._token_index(topk_ids))
        if path == "device":
            out = self._routed_device(x, topk_ids, topk_weights)
        elif self.tokens == "replicated" and self.ep_size > 1:
            out = self._routed_replicated(x, topk_ids, topk_weights)
        else:
            out = self._routed_dispatched(x, topk_ids, topk_weights)
        if side is not None:
            main.wait_stream(side)
            shared.record_stream(main)
            out = out + shared
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)

    def _token_index(self, topk_ids: torch.Tensor) -> torch.Tensor | None:
        """The token positions EPLB picks replicas by: offset by rank when each EP rank brings its
        own tokens (with one decode token a rank, position 0 everywhere sent every rank's pairs
        of an expert to the same replica); None (0..T-1) when every rank holds the same tokens,
        which must map to the same slots on every rank."""
        if self.ep_size == 1 or self.tokens == "replicated":
            return None
        t = topk_ids.shape[0]
        return torch.arange(t, device=topk_ids.device) + self.ep_rank * t

    def choose_path(self, x: torch.Tensor) -> str:
        """"device" or "host" for a forward on x [T, H] (see the module docstring)."""
        if self.path == "host":
            return "host"
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        if self.path == "device":
            if needs_grad:
                raise ValueError("path='device' is inference only (no autograd): call it under torch.no_grad() / "
                                 "inference_mode, or use path='host' (or 'auto') for training")
        elif needs_grad or self._device_transport is None:
            return "host"
        elif (isinstance(self._device_transport, static.AllGatherTransport) and self.transport == "auto"
              and x.shape[0] > ALLGATHER_MAX_TOKENS):
            return "host"
        # At EP > 1 the device transports (allgather, nvshmem) pad every rank to max_tokens: more is
        # refused here, before routing (their own check came after the expert counts and EPLB's load).
        if self.ep_size > 1 and self.tokens == "sequence_parallel" and x.shape[0] > self.max_tokens:  # type: ignore[operator]
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens ({self.max_tokens}) of this layer's "
                             f"device transport; build it with a larger max_tokens")
        return "device"

    def enable_cuda_graphs(self, token_counts: Any = (1, 2, 4, 8, 16, 32, 64)) -> None:
        """Serve eager inference calls of up to max(token_counts) tokens from CUDA graphs of this
        layer captured now (`moe.graphs.GraphedMoE`): a call then costs one replay plus a copy in
        and out, instead of Python launching every kernel. The result is a fresh tensor, as with a
        plain call. Calls that need autograd, pass a token_mask, have more tokens, or run while a
        graph is being captured take the normal path; if the layer's tensors are replaced
        (loading, `.to()`), the graphs are dropped and recaptured on the next call."""
        from megapar.moe.graphs import GraphedMoE

        self._graphed = None
        self._graph_counts = tuple(sorted({int(t) for t in token_counts}))
        self._graphed = GraphedMoE(self, self._graph_counts)
        self._graph_key = self._tensor_key()

    def disable_cuda_graphs(self) -> None:
        self._graphed, self._graph_counts, self._graph_key = None, (), None

    def _tensor_key(self) -> tuple:
        key = tuple(t.data_ptr() for t in (*self.parameters(), *self.buffers()))
        if self.experts.quantized:  # the graphs read these through a prepared copy (`Experts.prepared`,
            # repacked on CUDA): an in-place rewrite (loading, EPLB migration) must recapture too
            key += tuple(t._version for t in self.experts.slot_tensors())
        return key

    def _replayable(self, x: torch.Tensor) -> bool:
        g = self._graphed
        if (not x.is_cuda or x.shape[0] == 0 or x.shape[0] > g.sizes[-1] or x.dtype != g.dtype
                or torch.cuda.is_current_stream_capturing() or self.path == "host"):
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        if self._tensor_key() != self._graph_key:  # weights were replaced: recapture
            counts, self._graphed = self._graph_counts, None
            self.enable_cuda_graphs(counts)
        return True

    def _side_stream(self, x: torch.Tensor) -> Any:
        if not x.is_cuda:
            return None
        stream = self._side_streams.get(x.device)
        if stream is None:
            stream = self._side_streams[x.device] = torch.cuda.Stream(x.device)
        return stream

    def _routed_device(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed experts with static shapes and no host sync (module docstring)."""
        transport = self._device_transport
        batch = transport.dispatch(x, topk_ids, topk_weights)
        local_only = isinstance(transport, static.LocalTransport) and not isinstance(transport,
                                                                                     static.ReplicatedTransport)
        first = 0 if self.ep_size == 1 else self.ep_rank * self.num_slots
        plan = static.plan_static(batch.topk_ids, self.num_slots, first_slot=first,
                                  num_slots_total=self.num_slots_total, bad_ids=self.bad_ids)
        if self.ep_size == 1 and self.eplb is None:
            self.expert_counts.copy_(plan.counts)
        num_rows = plan.row_token.shape[0]
        if self.experts.takes_fp8_rows(num_rows, x.device, batch.x.dtype):  # W4A8: quantize per token, then copy
            q = quantize(batch.x, "fp8_token")
            rows = QuantizedTensor(gather_rows(q.data, plan.row_token), gather_rows(q.scale, plan.row_token),
                                   "fp8_token", (num_rows, q.shape[-1]))
        else:
            rows = gather_rows(batch.x, plan.row_token)  # [T*K, H]; rows after the last block are zero
        y = self.experts(rows, plan.counts, out_dtype=batch.x.dtype)
        partial = gather_reduce(y, plan.pair_pos, batch.topk_weights, x.dtype if local_only else torch.float32)
        return transport.combine(partial, batch).to(x.dtype)

    def close(self) -> None:
        """Release what the layer's transport holds outside torch's allocator (the NVSHMEM
        symmetric buffers of transport='nvshmem'); a collective on the EP group. The layer cannot
        run the device path afterwards."""
        transport, self._device_transport = self._device_transport, None
        buffer = getattr(transport, "buffer", None)
        if buffer is not None and hasattr(buffer, "destroy"):
            buffer.destroy()

    def raise_on_bad_ids(self) -> None:
        """Raise if a device-path forward since the last call routed ids outside the expert range
        (see the module docstring); reads a device flag (one sync)."""
        static.raise_on_bad_ids(self.bad_ids, self.num_slots_total, what=f"MoE layer {self.layer_index}")

    def count_experts(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Tokens per logical expert of this forward into `expert_counts` ([E] int64; ids outside
        [0, E), -1 included, are skipped). One scatter-add on the device: no host sync (unlike
        bincount on CUDA), graph-capturable."""
        e = self.config.num_experts
        ids = topk_ids.reshape(-1).long()
        key = torch.where((ids >= 0) & (ids < e), ids, torch.full_like(ids, e))  # the rest -> a spare bin
        counts = torch.zeros(e + 1, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        self.expert_counts.copy_(counts[:e])
        return self.expert_counts

    def _experts(self, res: Any) -> torch.Tensor:
        offsets = res.offsets if self.dispatcher.align > 1 else None
        return self.experts(res.x, res.counts, offsets)

    def _routed_dispatched(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        d = self.dispatcher
        if self.overlap_chunks == 1:
            res = ubatch_yield(d.dispatch(x, topk_ids, topk_weights, async_op=True).wait)
            y = self._experts(res)
            return ubatch_yield(d.combine(y, res.handle, async_op=True).wait)
        sizes = comm.even_split(x.shape[0], self.overlap_chunks)
        xs, ids, ws = x.split(sizes), topk_ids.split(sizes), topk_weights.split(sizes)
        pending = d.dispatch(xs[0], ids[0], ws[0], async_op=True)
        combines = []
        for i in range(len(sizes)):
            res = pending.wait()
            if i + 1 < len(sizes):  # next chunk travels while this one computes
                pending = d.dispatch(xs[i + 1], ids[i + 1], ws[i + 1], async_op=True)
            combines.append(d.combine(self._experts(res), res.handle, async_op=True))
        return torch.cat([c.wait() for c in combines])

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global slot ids [T, K] -> this rank's slot ids, -1 for slots of other ranks."""
        first = self.ep_rank * self.num_slots
        local = topk_ids - first
        return torch.where((local >= 0) & (local < self.num_slots), local, torch.full_like(local, -1))

    def _routed_replicated(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        d, group = self.dispatcher, self.ep_group
        local_ids = self._local_ids(topk_ids)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad
                                                  or any(p.requires_grad for p in self.experts.parameters()))
        if needs_grad:  # every rank ends with the full gradient of x and of the router weights
            xin, win = comm.copy_to_region(x, group), comm.copy_to_region(topk_weights, group)
            res = d.dispatch(xin, local_ids, win)
            partial = d.combine(self._experts(res), res.handle)
            return comm.reduce_from_region(partial, group)
        outs = []
        for xc, ic, wc in zip(*(t.split(comm.even_split(x.shape[0], self.overlap_chunks)) for t in (x, local_ids, topk_weights))):
            res = d.dispatch(xc, ic, wc)
            partial = d.combine(self._experts(res), res.handle).contiguous()
            outs.append(comm.all_reduce(partial, group, async_op=True))  # in flight while the next chunk computes
        return torch.cat([ubatch_yield(h.wait) for h in outs])

    # ---- loading ------------------------------------------------------------------------

    def load_deepseek(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load DeepSeek-named tensors (`{prefix}gate.weight`, `{prefix}experts.{e}.w1.weight`, ...),
        keeping only this rank's experts. `state` may be lazy (`moe.loading`): only the keys this
        rank needs are looked up, each routed expert once, written into its slot on the layer's
        device. Quantized shared-expert tensors (DeepSeek's FP8) are dequantized. Meta tensors
        (init="meta") are materialized first. A missing tensor raises KeyError and one of another
        shape ValueError, before anything is written: the gate and shared expert are read and
        checked, every routed expert's keys looked up (and the sizes checked on the first one
        read) first; the gate and shared expert are written after the routed experts, which are
        the only part that can still fail (`Experts.load_deepseek`).

        The one exception: a router whose checkpoint has no `gate.e_score_correction_bias` (nor
        DeepSeek's `gate.bias`) gets a zero bias and one warning naming the key, as HF transformers
        loads it (its DeepSeek V3 / V3.2 / V4 routers register the buffer as zeros and report the
        key missing)."""
        from megapar.moe.experts import read_dense
        from megapar.moe.loading import Prefixed, checkpoint_key

        sub = Prefixed(state, prefix) if prefix else state
        device = self.experts.device
        gate = Prefixed(sub, "gate.")
        wanted = self.gate.state_dict()
        # a router tensor the checkpoint holds and this layer's config does not use (a hash layer's
        # tid2eid loaded as a top-k layer, a bias with use_bias=False) would be dropped and the
        # layer route unlike the checkpoint's model: the config does not describe this layer
        for name, needs, why in (("tid2eid", "tid2eid", "a hash-routed layer's table; this layer routes by "
                                  "top-k (is the layer index / num_hash_layers right?)"),
                                 ("e_score_correction_bias", "e_score_correction_bias", "a router bias; this "
                                  "layer's config has none (use_bias / topk_method)"),
                                 ("bias", "e_score_correction_bias", "a router bias; this layer's config has none "
                                  "(use_bias / topk_method)")):
            if name in gate and needs not in wanted:
                raise ValueError(f"the checkpoint has {checkpoint_key(gate, name)}, {why}: refusing to drop it")
        values = {}
        zero_filled: list[str] = []
        for k in wanted:
            key = "bias" if k == "e_score_correction_bias" and k not in gate and "bias" in gate else k
            if key not in gate and k == "e_score_correction_bias":
                values[k] = torch.zeros(self.gate.e_score_correction_bias.shape, dtype=torch.float32)
                names = dict.fromkeys(checkpoint_key(gate, n) for n in (k, "bias"))   # (HF maps both to one)
                zero_filled.append(" / ".join(names))
                continue
            if key not in gate:
                raise KeyError(f"missing {prefix}gate.{k}")
            values[k] = gate[key]
        self._check_module_state(self.gate, values, f"{prefix}gate.")
        shared = {}
        if self.shared_experts is not None:
            for k in self.shared_experts.state_dict():
                if f"shared_experts.{k}" not in sub:
                    raise KeyError(f"missing {prefix}shared_experts.{k}")
            for k in self.shared_experts.state_dict():
                shared[k] = read_dense(sub, f"shared_experts.{k[: -len('.weight')]}")
            self._check_module_state(self.shared_experts, shared, f"{prefix}shared_experts.")
        if self.eplb is not None:  # the slots may have moved since construction
            self.experts.local_experts = self.eplb.local_experts(self.layer_index).tolist()
        self.experts.load_deepseek(sub, prefix="experts.")  # (every key looked up before the first write)
        self._load_module(self.gate, values, "gate.", device)
        if self.shared_experts is not None:
            self._load_module(self.shared_experts, shared, "shared_experts.", device)
        if self.eplb is not None:
            self.eplb.register_weights(self.layer_index, self.experts.slot_tensors())
        if zero_filled:
            warnings.warn(f"missing router bias {', '.join(zero_filled)}: loaded as zeros (as HF transformers "
                          f"initializes a missing e_score_correction_bias)", stacklevel=2)

    def load_safetensors(self, paths: Any, prefix: str = "", *, naming: str = "auto") -> SafetensorsState:
        """Load this layer from .safetensors files (a file, a list, or a checkpoint directory),
        streaming: only this rank's experts are read, one at a time, each quantized or converted
        on the layer's device. prefix: the MoE module's prefix in the files ("layers.3.ffn." for
        DeepSeek's names, "model.layers.3.mlp." for HF's; `moe.loading.moe_prefix`). naming:
        "deepseek", "hf" (fused `gate_up_proj`/`down_proj` or per-expert `gate_proj`/...), or
        "auto" (detected). Returns the reader (its `reads` lists the keys read)."""
        from megapar.moe.loading import SafetensorsState, moe_state

        reader = SafetensorsState(paths)
        self.load_deepseek(moe_state(reader, prefix, naming))
        return reader

    @staticmethod
    def _check_module_state(module: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
        """KeyError / ValueError for a missing key or another shape in `module`'s state (writes nothing)."""
        own = module.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise KeyError(f"missing {', '.join(what + k for k in missing)}")
        for k, t in own.items():
            if tuple(state[k].shape) != tuple(t.shape):
                raise ValueError(f"{what}{k} has shape {tuple(state[k].shape)}; expected {tuple(t.shape)}")

    @classmethod
    def _load_module(cls, module: nn.Module, state: Mapping[str, torch.Tensor], what: str,
                     device: torch.device | None = None) -> None:
        cls._check_module_state(module, state, what)  # (all of it before the first copy)
        if device is not None and any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            module.to_empty(device=device)
        with torch.no_grad():
            for k, t in module.state_dict().items():
                t.copy_(state[k].to(t.dtype))

    def extra_repr(self) -> str:
        return (f"ep={self.ep_rank}/{self.ep_size}, tokens={self.tokens}, path={self.path}, "
                f"transport={self.transport}, overlap_chunks={self.overlap_chunks}, slots={self.num_slots}")
