"""ModelConfig: the shape of the small DeepSeek-V4-style model, and the checks it needs per layout.

The model is DeepSeek-V4 in miniature where it matters for parallelism: mHC residual
streams (M = 4, Sinkhorn-mixed), a GQA attention whose heads are split over TP, and an MoE
with sqrt(softplus) routing + correction bias, a shared expert and FP4/FP8 routed experts.
(V4's compressed attention is replaced by plain GQA with RoPE: the parallel structure, TP
heads, ring prefill and DCP decode, is the same.) Defaults are tiny so that `megapar demo`
runs in seconds per step on 2 CPU cores with 4 gloo processes. Activations are fp32: the
demo compares every logit against a reference, and a bf16 run would flip near-tied routing
decisions (a top-k choice is discontinuous) and make the check meaningless.

`check_layout(cfg, pcfg)` raises ValueError for layouts the model cannot run, naming the
values and the valid choices: heads over TP, KV-head replication, vocab over TP, and DCP
groups that must hold the same KV heads (the ranks of a group split the tokens of one cache).
DCP is carved from TP (vLLM's layout, whatever pcp is), so it needs vLLM's GQA rule: kv_heads <
tp and dcp divides the tp // kv_heads ranks replicating each KV head, so every rank holds one KV
head and the group's gathered query heads all map onto it. PCP peers share their TP rank, hence
their heads (any number of KV heads per rank when dcp == 1).
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass
from typing import Literal

from megapar.parallel.config import ParallelConfig
from megapar.parallel.layout import coords, rank_groups

Quant = Literal["mxfp4", "nvfp4", "fp8_block", "bf16"]
AttentionKind = Literal["gqa", "mla"]
ATTENTION_KINDS: tuple[str, ...] = ("gqa", "mla")
QUANT_FORMATS: tuple[str, ...] = ("mxfp4", "nvfp4", "fp8_block", "bf16")
Scoring = Literal["softmax", "sigmoid", "sqrt_softplus"]
SCORINGS: tuple[str, ...] = ("softmax", "sigmoid", "sqrt_softplus")

# K-dim block of each routed-expert format: hidden and moe_inter must be multiples of it.
_QUANT_BLOCK = {"mxfp4": 32, "nvfp4": 16, "fp8_block": 1, "bf16": 1}


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Sizes of the demo model (tiny defaults)."""

    vocab: int = 512
    """vocabulary size (embedding rows, lm_head rows); a multiple of tp"""
    hidden: int = 64
    """model hidden size H"""
    layers: int = 2
    """transformer layers, each attention + MoE"""
    heads: int = 4
    """query heads (split over TP)"""
    kv_heads: int = 2
    """key/value heads (GQA); replicated when fewer than tp"""
    head_dim: int = 16
    """dimension of one head (even: RoPE rotates pairs)"""
    attention: AttentionKind = "gqa"
    """"gqa" (wq/wk/wv, the heads above) or "mla" (DeepSeek-V3 multi-head latent attention: the
    kv_lora_rank / qk_*_head_dim / v_head_dim sizes below; head_dim and kv_heads are unused)"""
    q_lora_rank: int = 32
    """MLA: rank of the query down-projection (q_a_proj); 0 = a direct q_proj"""
    kv_lora_rank: int = 32
    """MLA: latent rank r (the cache holds r + qk_rope_head_dim values per token)"""
    qk_nope_head_dim: int = 16
    """MLA: per-head query/key dims without RoPE"""
    qk_rope_head_dim: int = 16
    """MLA: the RoPE dims (one key shared by all heads); even"""
    v_head_dim: int = 16
    """MLA: per-head value dims"""
    rope_theta: float = 10000.0
    """RoPE base; pairs (2i, 2i+1) rotate by pos * theta^(-2i/head_dim) (DeepSeek's interleaved form)"""
    norm_eps: float = 1e-6
    """RMSNorm epsilon"""
    mhc_streams: int = 4
    """mHC residual streams M"""
    sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations of the mHC mixing matrix"""
    mhc_eps: float = 1e-6
    """mHC epsilon (coefficients and Sinkhorn denominators); its RMS epsilon is norm_eps"""
    experts: int = 8
    """routed experts E"""
    top_k: int = 2
    """experts per token"""
    moe_inter: int = 32
    """intermediate size of one routed expert"""
    shared_inter: int = 32
    """intermediate size of the shared expert (0 = none)"""
    scoring: Scoring = "sqrt_softplus"
    """router score function (V4: sqrt(softplus))"""
    routed_scaling: float = 1.5
    """routed_scaling_factor on the renormalized top-k weights"""
    swiglu_limit: float | None = 10.0
    """clamp of the routed experts' SwiGLU (V4: 10); None = no clamp"""
    shared_swiglu_limit: float | None = 10.0
    """clamp of the shared expert's SwiGLU (V4 clamps it like the routed experts); None = no clamp"""
    quant: Quant = "mxfp4"
    """routed expert weight format"""

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "mhc_streams", "sinkhorn_iters",
                     "experts", "top_k", "moe_inter"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} ({getattr(self, name)}) must be >= 1")
        if self.shared_inter < 0:
            raise ValueError(f"ModelConfig.shared_inter ({self.shared_inter}) must be >= 0")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}; valid: {', '.join(ATTENTION_KINDS)}")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"ModelConfig.{name} ({getattr(self, name)}) must be >= 1")
            if self.q_lora_rank < 0:
                raise ValueError(f"ModelConfig.q_lora_rank ({self.q_lora_rank}) must be >= 0 (0 = q_proj)")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE rotates pairs)")
        if self.attention == "gqa" and self.head_dim % 2:   # (MLA uses neither head_dim nor kv_heads)
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
        if self.attention == "gqa" and self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}); "
                             f"valid kv_heads: {_divisors(self.heads)}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown scoring {self.scoring!r}; valid: {', '.join(SCORINGS)}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta ({self.rope_theta}) must be > 0")
        for name in ("norm_eps", "mhc_eps"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"ModelConfig.{name} ({getattr(self, name)}) must be >= 0 and finite")
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= experts ({self.experts})")
        if self.quant not in QUANT_FORMATS:
            raise ValueError(f"unknown quant {self.quant!r}; valid: {', '.join(QUANT_FORMATS)}")
        block = _QUANT_BLOCK[self.quant]
        for name in ("hidden", "moe_inter"):
            if getattr(self, name) % block:
                raise ValueError(f"{self.quant} experts need {name} ({getattr(self, name)}) to be a multiple of "
                                 f"{block} (the format's block along K)")

    def to_dict(self) -> dict:
        return asdict(self)

    def moe_config(self, **overrides):
        """The MoE layers' `moe.MoEConfig` (V4 routing: sqrt(softplus) + bias, no group limit; the
        values of `MoEConfig.deepseek_v4_flash` at this model's sizes). fp32 activations."""
        import torch

        from megapar.moe.layer import MoEConfig

        return MoEConfig(**{**dict(hidden=self.hidden, inter=self.moe_inter, num_experts=self.experts,
                                   top_k=self.top_k, scoring=self.scoring, use_bias=True,
                                   routed_scaling=self.routed_scaling, swiglu_limit=self.swiglu_limit,
                                   shared_swiglu_limit=self.shared_swiglu_limit,
                                   num_shared=1 if self.shared_inter else 0, shared_inter=self.shared_inter or None,
                                   expert_format=self.quant, dtype=torch.float32), **overrides})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_heads_of_tp_rank(cfg: ModelConfig, tp: int, tp_rank: int) -> tuple[int, ...]:
    """The KV heads a TP rank holds: kv_heads / tp of them, or one replicated head when kv_heads < tp."""
    if cfg.kv_heads >= tp:
        n = cfg.kv_heads // tp
        return tuple(range(tp_rank * n, (tp_rank + 1) * n))
    return (tp_rank // (tp // cfg.kv_heads),)


def _dcp_group_with_mixed_kv_heads(cfg: ModelConfig, pcfg: ParallelConfig
                                   ) -> tuple[list[int], dict[int, tuple[int, ...]]] | None:
    """The first DCP group whose ranks hold different KV heads, with the heads of each rank; None if none."""
    for group in rank_groups(pcfg)["dcp"]:
        held = {r: kv_heads_of_tp_rank(cfg, pcfg.tp, coords(pcfg, r)["tp"]) for r in group}
        if len(set(held.values())) > 1:
            return group, held
    return None


def check_layout(cfg: ModelConfig, pcfg: ParallelConfig, *, prompt_len: int | None = None,
                 batch: int | None = None, redundant_experts: int = 0) -> None:
    """Raise ValueError when the model cannot run on this layout (every rank checks the same).

    prompt_len / batch: also check the run's shapes. redundant_experts: EPLB's extra slots."""
    tp = pcfg.tp
    if pcfg.pp != 1:
        raise ValueError(f"the demo model has no pipeline stages; pp ({pcfg.pp}) must be 1")
    if cfg.heads % tp:
        raise ValueError(f"heads ({cfg.heads}) must be a multiple of tp ({tp}); valid tp: {_divisors(cfg.heads)}")
    if cfg.attention == "gqa" and cfg.kv_heads % tp and tp % cfg.kv_heads:   # (MLA: one latent head, no kv_heads)
        raise ValueError(f"kv_heads ({cfg.kv_heads}) and tp ({tp}) must divide one another (KV heads are split "
                         f"over TP, or replicated when fewer than tp)")
    if cfg.vocab % tp:
        raise ValueError(f"vocab ({cfg.vocab}) must be a multiple of tp ({tp}) (the lm_head is vocab-parallel)")
    slots = cfg.experts + redundant_experts
    if slots % pcfg.ep:
        what = f"experts ({cfg.experts}) + EPLB redundant slots ({redundant_experts})" if redundant_experts else \
            f"experts ({cfg.experts})"
        raise ValueError(f"{what} = {slots} must be a multiple of ep ({pcfg.ep}); "
                         f"valid ep: {[d for d in _divisors(slots) if (pcfg.dp * pcfg.pcp * tp) % d == 0]}")
    # MLA: one latent KV head shared by every query head, so any DCP group holds the same "KV heads"
    mixed = None if cfg.attention == "mla" else _dcp_group_with_mixed_kv_heads(cfg, pcfg)
    if mixed is not None:
        group, held = mixed
        valid = []
        for d in _divisors(tp):
            try:
                other = ParallelConfig(world_size=pcfg.world_size, tp=tp, pp=pcfg.pp, pcp=pcfg.pcp, dcp=d,
                                       dp=pcfg.dp, ep=pcfg.ep)
            except ValueError:
                continue
            if _dcp_group_with_mixed_kv_heads(cfg, other) is None:
                valid.append(d)
        rule = (f"DCP carved from TP needs kv_heads < tp and (tp // kv_heads) % dcp == 0 (vLLM's GQA rule; "
                f"tp {tp}, kv_heads {cfg.kv_heads})")
        raise ValueError(f"dcp ({pcfg.dcp}) group {group} holds different KV heads {held}: the ranks of a DCP group "
                         f"split the tokens of the same KV heads. {rule}. valid dcp: {valid}")
    if prompt_len is not None:
        if prompt_len < 1:
            raise ValueError(f"prompt_len ({prompt_len}) must be >= 1")
        if pcfg.pcp > 1 and prompt_len % (2 * pcfg.pcp):
            pad = -prompt_len % (2 * pcfg.pcp)
            raise ValueError(f"prompt_len ({prompt_len}) must be a multiple of 2 * pcp = {2 * pcfg.pcp} (zigzag "
                             f"chunks); e.g. {prompt_len + pad}")
    replicas = pcfg.dp * pcfg.ext_dp
    if batch is not None and (batch < 1 or batch % replicas):
        raise ValueError(f"batch ({batch}) must be a positive multiple of the data-parallel replicas ({replicas}); "
                         f"e.g. {2 * replicas}")
