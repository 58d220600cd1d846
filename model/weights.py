"""The demo model's full (unsharded) state dict, made from a seed, with DeepSeek-style names.

Every rank builds the same full dict from the same seed and keeps what it owns (TP rows or
columns, EP experts, quantized at load); the reference uses the whole dict. Names:

    embed.weight                                  [V, H]
    layers.{i}.attn_mhc.{fn,base,scale}           [(2+M)M, M*H], [(2+M)M], [3]   (V4: hc_attn_*)
    layers.{i}.attn_norm.weight                   [H]
    layers.{i}.attn.{wq,wk,wv}.weight             [heads*D, H], [kv_heads*D, H] x 2
    layers.{i}.attn.wo.weight                     [H, heads*D]
    (attention "mla": HF DeepSeek-V3 names instead of wq/wk/wv/wo, d_qk = d_n + d_r)
    layers.{i}.attn.q_a_proj.weight               [q_lora_rank, H]     (q_lora_rank 0: q_proj [heads*d_qk, H])
    layers.{i}.attn.q_a_layernorm.weight          [q_lora_rank]
    layers.{i}.attn.q_b_proj.weight               [heads*d_qk, q_lora_rank]
    layers.{i}.attn.kv_a_proj_with_mqa.weight     [r + d_r, H]
    layers.{i}.attn.kv_a_layernorm.weight         [r]
    layers.{i}.attn.kv_b_proj.weight              [heads*(d_n + d_v), r]
    layers.{i}.attn.o_proj.weight                 [H, heads*d_v]
    layers.{i}.ffn_mhc.{fn,base,scale}            (V4: hc_ffn_*)
    layers.{i}.ffn_norm.weight                    [H]
    layers.{i}.moe.gate.weight                    [E, H]
    layers.{i}.moe.gate.e_score_correction_bias   [E]
    layers.{i}.moe.experts.{e}.{w1,w3}.weight     [I, H];  .w2.weight [H, I]
    layers.{i}.moe.shared_experts.{w1,w3,w2}.weight
    head_mhc.{fn,base,scale}                      [M, M*H], [M], [1]             (V4: hc_head_*)
    norm.weight                                   [H]
    lm_head.weight                                [V, H]

All tensors are fp32 on the CPU. `served_expert_weights` gives the routed experts exactly as a
rank computes with them (fused W13 quantized to the model's format, then dequantized), so
that a reference built on them sees no quantization error relative to the distributed model.
"""

from __future__ import annotations

import math

import torch

from megapar.moe.quant import dequantize, quantize

from .config import ModelConfig

# Quantizer options the MoE experts use (moe/experts.py quantizes NVFP4 with one global scale
# per expert matrix); the reference must round the same way.
_QUANT_OPTS = {"nvfp4": {"global_scale": "matrix"}}


def make_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full fp32 weights of the demo model from `seed` (same dict on every rank and in the reference)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    h, m, d = cfg.hidden, cfg.mhc_streams, cfg.head_dim
    state: dict[str, torch.Tensor] = {"embed.weight": normal(cfg.vocab, h, std=1.0)}

    def mhc(prefix: str, rows: int, num_scales: int) -> None:
        # fn large enough that pre/post/comb differ per token (mix ~ N(0, 2^2)), base off-centre.
        state[f"{prefix}.fn"] = normal(rows, m * h, std=2.0 / math.sqrt(m * h))
        state[f"{prefix}.base"] = normal(rows, std=0.5)
        state[f"{prefix}.scale"] = 1.0 + normal(num_scales, std=0.2)

    for i in range(cfg.layers):
        p = f"layers.{i}"
        mhc(f"{p}.attn_mhc", (2 + m) * m, 3)
        state[f"{p}.attn_norm.weight"] = 1.0 + normal(h, std=0.1)
        if cfg.attention == "mla":
            state.update(_mla_weights(cfg, f"{p}.attn", normal))
        else:
            state[f"{p}.attn.wq.weight"] = normal(cfg.heads * d, h, std=h ** -0.5)
            state[f"{p}.attn.wk.weight"] = normal(cfg.kv_heads * d, h, std=h ** -0.5)
            state[f"{p}.attn.wv.weight"] = normal(cfg.kv_heads * d, h, std=h ** -0.5)
            state[f"{p}.attn.wo.weight"] = normal(h, cfg.heads * d, std=(cfg.heads * d) ** -0.5)
        mhc(f"{p}.ffn_mhc", (2 + m) * m, 3)
        state[f"{p}.ffn_norm.weight"] = 1.0 + normal(h, std=0.1)
        state[f"{p}.moe.gate.weight"] = normal(cfg.experts, h, std=h ** -0.5)
        state[f"{p}.moe.gate.e_score_correction_bias"] = normal(cfg.experts, std=0.1)
        for e in range(cfg.experts):
            q = f"{p}.moe.experts.{e}"
            state[f"{q}.w1.weight"] = normal(cfg.moe_inter, h, std=h ** -0.5)
            state[f"{q}.w3.weight"] = normal(cfg.moe_inter, h, std=h ** -0.5)
            state[f"{q}.w2.weight"] = normal(h, cfg.moe_inter, std=cfg.moe_inter ** -0.5)
        if cfg.shared_inter:
            q = f"{p}.moe.shared_experts"
            state[f"{q}.w1.weight"] = normal(cfg.shared_inter, h, std=h ** -0.5)
            state[f"{q}.w3.weight"] = normal(cfg.shared_inter, h, std=h ** -0.5)
            state[f"{q}.w2.weight"] = normal(h, cfg.shared_inter, std=cfg.shared_inter ** -0.5)
    mhc("head_mhc", m, 1)
    state["norm.weight"] = 1.0 + normal(h, std=0.1)
    state["lm_head.weight"] = normal(cfg.vocab, h, std=h ** -0.5)
    return state


def _mla_weights(cfg: ModelConfig, prefix: str, normal) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MLA weights (HF names) of one layer: see `model.mla`."""
    h, heads, r = cfg.hidden, cfg.heads, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    out: dict[str, torch.Tensor] = {}
    if cfg.q_lora_rank:
        out[f"{prefix}.q_a_proj.weight"] = normal(cfg.q_lora_rank, h, std=h ** -0.5)
        out[f"{prefix}.q_a_layernorm.weight"] = 1.0 + normal(cfg.q_lora_rank, std=0.1)
        out[f"{prefix}.q_b_proj.weight"] = normal(heads * qk, cfg.q_lora_rank, std=cfg.q_lora_rank ** -0.5)
    else:
        out[f"{prefix}.q_proj.weight"] = normal(heads * qk, h, std=h ** -0.5)
    out[f"{prefix}.kv_a_proj_with_mqa.weight"] = normal(r + cfg.qk_rope_head_dim, h, std=h ** -0.5)
    out[f"{prefix}.kv_a_layernorm.weight"] = 1.0 + normal(r, std=0.1)
    out[f"{prefix}.kv_b_proj.weight"] = normal(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), r, std=r ** -0.5)
    out[f"{prefix}.o_proj.weight"] = normal(h, heads * cfg.v_head_dim, std=(heads * cfg.v_head_dim) ** -0.5)
    return out


def round_to_format(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w as the experts hold it in `fmt`: quantize + dequantize (fp32), or a bf16 round trip."""
    if fmt == "bf16":
        return w.to(torch.bfloat16).float()
    return dequantize(quantize(w.float(), fmt, **_QUANT_OPTS.get(fmt, {})), torch.float32)


def served_expert_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, layer: int, expert: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1 [I, H], w3 [I, H], w2 [H, I]) fp32 of one routed expert after the format's rounding.

    W1 and W3 are rounded as the fused W13 [2I, H] (W1 rows first) that the experts store:
    NVFP4's per-matrix scale and FP8's 128x128 tiles see both halves together."""
    p = f"layers.{layer}.moe.experts.{expert}"
    w13 = torch.cat([state[f"{p}.w1.weight"], state[f"{p}.w3.weight"]])
    w1, w3 = round_to_format(w13, cfg.quant).split(cfg.moe_inter)
    return w1, w3, round_to_format(state[f"{p}.w2.weight"], cfg.quant)
