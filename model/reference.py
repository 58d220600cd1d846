"""Dense single-process reference of the demo model, in plain torch and float64.

Written independently of the parallel model (model/model.py) and of every parallel code
path: no process groups, no KV cache, no ring or DCP, no dispatch, no mHC module. It runs the
whole token sequence at once with a causal mask, so the logits at position p are those a
cached decode step at p must produce:

    reference_logits(state, cfg, tokens [B, L])[:, p]  ==  logits after seeing tokens[:, :p+1]

Pieces, each the textbook form:
- RoPE in DeepSeek's complex form: pairs (2i, 2i+1) are complex numbers multiplied by
  exp(1j * pos * theta^(-2i/D)).
- Attention: full softmax(q k^T / sqrt(D) + causal mask) v, KV heads repeated for GQA; or
  (cfg.attention "mla") DeepSeek-V3's latent attention with the keys and values expanded per head.
- MoE: for every expert, the tokens that picked it, with the expert's weights as the
  distributed model holds them after quantization (`served_expert_weights`); routing is
  sqrt(softplus) scores, top-k of score + bias, weights = unbiased scores renormalized.
- mHC (docs/numerics.md §11) with explicit Sinkhorn loops over [B, L, M, M].
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .weights import served_expert_weights

DTYPE = torch.float64


def _w(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return state[name].to(DTYPE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [B, L, heads, D], positions: [L] -> rotated x (complex multiplication of pairs)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=DTYPE) / d)                 # [D/2]
    angles = positions.to(DTYPE)[:, None] * inv_freq[None, :]                      # [L, D/2]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]           # [1, L, 1, D/2]
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * rot).reshape(x.shape)


def attention(h: torch.Tensor, state: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str) -> torch.Tensor:
    """h: [B, L, H] -> [B, L, H], causal GQA attention with RoPE."""
    b, length, _ = h.shape
    d = cfg.head_dim
    q = (h @ _w(state, f"{prefix}.wq.weight").T).view(b, length, cfg.heads, d)
    k = (h @ _w(state, f"{prefix}.wk.weight").T).view(b, length, cfg.kv_heads, d)
    v = (h @ _w(state, f"{prefix}.wv.weight").T).view(b, length, cfg.kv_heads, d)
    pos = torch.arange(length)
    q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    group = cfg.heads // cfg.kv_heads
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, length, cfg.heads * d)
    return out @ _w(state, f"{prefix}.wo.weight").T


def mla_attention(h: torch.Tensor, state: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str) -> torch.Tensor:
    """h: [B, L, H] -> [B, L, H], DeepSeek-V3 multi-head latent attention written out per head
    (no absorption): latent c = RMSNorm(W_DKV h)[:r], keys [W_UK c, RoPE(k_pe)], values W_UV c."""
    b, length, _ = h.shape
    heads, dn, dr, dv, r = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        q_lat = rms_norm(h @ _w(state, f"{prefix}.q_a_proj.weight").T, _w(state, f"{prefix}.q_a_layernorm.weight"),
                         cfg.norm_eps)
        q = q_lat @ _w(state, f"{prefix}.q_b_proj.weight").T
    else:
        q = h @ _w(state, f"{prefix}.q_proj.weight").T
    q = q.view(b, length, heads, dn + dr)
    kv = h @ _w(state, f"{prefix}.kv_a_proj_with_mqa.weight").T                   # [B, L, r + d_r]
    c = rms_norm(kv[..., :r], _w(state, f"{prefix}.kv_a_layernorm.weight"), cfg.norm_eps)
    kvb = (c @ _w(state, f"{prefix}.kv_b_proj.weight").T).view(b, length, heads, dn + dv)
    pos = torch.arange(length)
    q_pe = rope(q[..., dn:].contiguous(), pos, cfg.rope_theta)
    k_pe = rope(kv[..., None, r:].contiguous(), pos, cfg.rope_theta)            # [B, L, 1, d_r]
    scores = (torch.einsum("bqhd,bkhd->bhqk", q[..., :dn], kvb[..., :dn])
              + torch.einsum("bqhd,bkd->bhqk", q_pe, k_pe[:, :, 0])) / (dn + dr) ** 0.5
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, kvb[..., dn:]).reshape(b, length, heads * dv)
    return out @ _w(state, f"{prefix}.o_proj.weight").T


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float | None) -> torch.Tensor:
    gate, up = x @ w1.T, x @ w3.T
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (gate * torch.sigmoid(gate) * up) @ w2.T


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return logits.softmax(-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    softplus = torch.where(logits > 20, logits, torch.log1p(torch.exp(logits.clamp(max=20))))
    return softplus.sqrt()


def moe(h: torch.Tensor, state: dict[str, torch.Tensor], cfg: ModelConfig, layer: int) -> torch.Tensor:
    """h: [N, H] -> [N, H]: dense loop over the experts plus the shared expert."""
    p = f"layers.{layer}.moe"
    scores = _scores(h @ _w(state, f"{p}.gate.weight").T, cfg.scoring)           # [N, E]
    choice = (scores + _w(state, f"{p}.gate.e_score_correction_bias")).topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, choice)
    weights = weights / weights.sum(-1, keepdim=True) * cfg.routed_scaling
    out = torch.zeros_like(h)
    for e in range(cfg.experts):
        rows, slot = (choice == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        w1, w3, w2 = (w.to(DTYPE) for w in served_expert_weights(state, cfg, layer, e))
        out.index_add_(0, rows, weights[rows, slot, None] * _swiglu(h[rows], w1, w3, w2, cfg.swiglu_limit))
    if cfg.shared_inter:
        q = f"{p}.shared_experts"
        out = out + _swiglu(h, _w(state, f"{q}.w1.weight"), _w(state, f"{q}.w3.weight"), _w(state, f"{q}.w2.weight"),
                            cfg.shared_swiglu_limit)
    return out


def _sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def mhc_sublayer(streams: torch.Tensor, state: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str, norm: str,
                 sublayer) -> torch.Tensor:
    """streams: [B, L, M, H]. One mHC-wrapped sublayer (docs/numerics.md §11): pre-mix, norm, f, post-mix."""
    b, length, m, hdim = streams.shape
    flat = streams.reshape(b, length, m * hdim)
    mix = (flat @ _w(state, f"{prefix}.fn").T) / torch.sqrt((flat * flat).mean(-1, keepdim=True) + cfg.norm_eps)
    base, scale = _w(state, f"{prefix}.base"), _w(state, f"{prefix}.scale")
    pre = torch.sigmoid(mix[..., :m] * scale[0] + base[:m]) + cfg.mhc_eps
    post = 2 * torch.sigmoid(mix[..., m:2 * m] * scale[1] + base[m:2 * m])
    logits = mix[..., 2 * m:].reshape(b, length, m, m) * scale[2] + base[2 * m:].reshape(m, m)
    comb = _sinkhorn(logits.softmax(-1) + cfg.mhc_eps, cfg.sinkhorn_iters, cfg.mhc_eps)
    x = (pre[..., None] * streams).sum(2)                                        # [B, L, H]
    f = sublayer(rms_norm(x, _w(state, norm), cfg.norm_eps))
    mixed = torch.einsum("blij,blih->bljh", comb, streams)                        # new_j = sum_i C[i,j] x_i
    return mixed + post[..., None] * f[:, :, None, :]


def mhc_collapse(streams: torch.Tensor, state: dict[str, torch.Tensor], cfg: ModelConfig,
                 prefix: str = "head_mhc") -> torch.Tensor:
    """streams: [B, L, M, H] -> [B, L, H]: the head's mHC after the last layer (before the final norm)."""
    b, length, m, hdim = streams.shape
    mix = rms_norm(streams.reshape(b, length, m * hdim), None, cfg.norm_eps) @ _w(state, f"{prefix}.fn").T
    pre = torch.sigmoid(mix * _w(state, f"{prefix}.scale")[0] + _w(state, f"{prefix}.base")) + cfg.mhc_eps
    return (pre[..., None] * streams).sum(2)


def reference_logits(state: dict[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """tokens: [B, L] int -> logits [B, L, V] float64 (causal: position p sees tokens 0..p)."""
    b, length = tokens.shape
    x = _w(state, "embed.weight")[tokens]                                        # [B, L, H]
    streams = x[:, :, None, :].expand(b, length, cfg.mhc_streams, cfg.hidden)
    attend = mla_attention if cfg.attention == "mla" else attention
    for i in range(cfg.layers):
        p = f"layers.{i}"
        streams = mhc_sublayer(streams, state, cfg, f"{p}.attn_mhc", f"{p}.attn_norm.weight",
                               lambda h: attend(h, state, cfg, f"{p}.attn"))
        streams = mhc_sublayer(streams, state, cfg, f"{p}.ffn_mhc", f"{p}.ffn_norm.weight",
                               lambda h: moe(h.reshape(-1, cfg.hidden), state, cfg, i).reshape(h.shape))
    h = rms_norm(mhc_collapse(streams, state, cfg), _w(state, "norm.weight"), cfg.norm_eps)
    return h @ _w(state, "lm_head.weight").T
