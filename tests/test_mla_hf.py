"""The demo model's MLA layer (model/mla.py) against HF transformers' DeepSeek-V3 attention.

A tiny `DeepseekV3Config` with random weights; `load_hf_attention` copies the weights (both
`rope_interleave` conventions), HF's RoPE cos/sin (default and yarn, whose attention factor
scales cos/sin) and HF's softmax scale (yarn's mscale^2). Compared in float64 (HF) against our
float32 path: prefill (causal, non-absorbed, ring attention at one rank) and decode of new
tokens against the latent paged cache (absorbed, fused prep's torch path)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention, DeepseekV3RotaryEmbedding)

from model.config import ModelConfig  # noqa: E402
from model.mla import MLAttention, hf_attention_state, hf_rope_table, hf_softmax_scale, load_hf_attention  # noqa: E402
from model.profile import Timer  # noqa: E402
from parallel import ParallelConfig, destroy_parallel, init_parallel  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
HIDDEN, HEADS, B, T, NEW = 64, 4, 2, 11, 3


def _hf_layer(q_lora: int | None, interleave: bool, rope: dict | None, seed: int):
    config = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              q_lora_rank=q_lora, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=12, max_position_embeddings=64, rope_interleave=interleave,
                              rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
                              attention_bias=False, attn_implementation="eager")
    torch.manual_seed(seed)
    attn = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for name, p in attn.named_parameters():     # norms off 1, projections of a useful size
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "layernorm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5)
    return config, attn.double().eval(), DeepseekV3RotaryEmbedding(config)


def _our_layer(config, attn, rotary):
    cfg = ModelConfig(attention="mla", hidden=HIDDEN, heads=HEADS, kv_heads=1, q_lora_rank=config.q_lora_rank or 0,
                      kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                      qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                      norm_eps=config.rms_norm_eps)
    groups = init_parallel(ParallelConfig(world_size=1))
    layer = MLAttention(cfg, groups, sequence_parallel=False, overlap=False, timer=Timer(), device=torch.device("cpu"))
    pos = torch.arange(config.max_position_embeddings)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float64), pos)                 # HF's own table, [1, P, d_r]
    load_hf_attention(layer, attn.state_dict(), cos[0], sin[0], rope_interleave=config.rope_interleave,
                      rope_parameters=config.rope_parameters)
    return layer, (cos.double(), sin.double())


def _causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]


@pytest.mark.parametrize("q_lora", [24, None])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope", [None, YARN], ids=["default_rope", "yarn"])
def test_mla_layer_matches_hf_deepseek_v3_attention(q_lora, interleave, rope):
    from transformers import DynamicCache

    config, attn, rotary = _hf_layer(q_lora, interleave, rope, seed=7)
    try:
        layer, (cos, sin) = _our_layer(config, attn, rotary)
        assert layer.scale == pytest.approx(attn.scaling, rel=1e-12)
        if rope is not None:                                  # yarn really changes the scale and the table
            assert layer.scale != pytest.approx(layer.dims.qk_head_dim ** -0.5)
            assert not torch.allclose(cos[0, :, 0], torch.ones(cos.shape[1], dtype=torch.float64))
        gen = torch.Generator().manual_seed(8)
        h = torch.randn(B, T + NEW, HIDDEN, generator=gen, dtype=torch.float64)
        # HF: prefill with a cache, then one token at a time
        cache = DynamicCache(config=config)
        with torch.no_grad():
            ref = [attn(h[:, :T], (cos[:, :T], sin[:, :T]), _causal_mask(T), cache=cache)[0]]
            for t in range(T, T + NEW):
                ref.append(attn(h[:, t:t + 1], (cos[:, t:t + 1], sin[:, t:t + 1]), None, cache=cache)[0])
        # ours: prefill fills the latent paged cache (block 4, a shuffled table), then absorbed decode steps
        # in which sequence 1 lags one token behind sequence 0: a step holds positions (t, t - 1), so each
        # sequence's own position (RoPE, cache slot, length) is checked, not one shared by the batch
        layer.allocate_cache(B * 4, 4, torch.device("cpu"))
        table = torch.randperm(B * 4, generator=gen).view(B, 4)
        got = [layer.prefill(h[:, :T].reshape(B * T, HIDDEN).float(), B, T, B * T, table).view(B, T, HIDDEN)]
        decoded = [[] for _ in range(B)]
        for j in range(NEW + 1):
            rows = [b for b in range(B) if T <= T + j - b < T + NEW]
            pos = torch.tensor([T + j - b for b in rows])
            out = layer.decode(h[rows, pos].float(), len(rows), len(rows), pos, table[rows])
            for b, o in zip(rows, out):
                decoded[b].append(o)
        got += list(torch.stack([torch.stack(x) for x in decoded]).unbind(1))     # [B, HIDDEN] per new token
        scale = ref[0].abs().max().item()
        assert len(got) == len(ref) == 1 + NEW
        for step, (a, b) in enumerate(zip(got, ref)):
            torch.testing.assert_close(a.double().view(b.shape), b, atol=2e-6 * scale, rtol=0,
                                       msg=lambda m: f"step {step}: {m}")
        # the check can fail: one wrong convention (pairs vs halves) moves the outputs far off
        if not interleave:
            wrong = hf_attention_state(attn.state_dict(), layer.cfg, rope_interleave=True, out_prefix="a")
            layer.load_full(wrong, "a")
            bad = layer.prefill(h[:, :T].reshape(B * T, HIDDEN).float(), B, T, B * T, table).view(B, T, HIDDEN)
            assert (bad.double() - ref[0]).abs().max().item() > 1e-3 * scale
    finally:
        destroy_parallel()


def test_hf_helpers_reject_bad_input():
    config, attn, rotary = _hf_layer(24, True, None, seed=1)
    cfg = ModelConfig(attention="mla", hidden=HIDDEN, heads=HEADS, kv_heads=1, q_lora_rank=24, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    state = attn.state_dict()
    with pytest.raises(ValueError, match=r"'kv_b_proj.weight' missing from the HF state dict"):
        hf_attention_state({k: v for k, v in state.items() if k != "kv_b_proj.weight"}, cfg)
    with pytest.raises(ValueError, match=r"kv_b_proj.weight has shape \(112, 32\), expected \(160, 32\) for 4 heads"):
        hf_attention_state(state, ModelConfig(**{**cfg.to_dict(), "v_head_dim": 24}))
    with pytest.raises(ValueError, match="attention biases are not supported"):
        hf_attention_state({**state, "o_proj.bias": torch.zeros(HIDDEN)}, cfg)
    with pytest.raises(ValueError, match="cat\\(freqs, freqs\\) layout"):
        hf_rope_table(torch.randn(4, 8), torch.randn(4, 8))
    assert hf_softmax_scale(24, None) == 24 ** -0.5
    assert hf_softmax_scale(24, {"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0}) == 24 ** -0.5


@pytest.mark.parametrize("q_lora", [24, None])
def test_demo_reference_mla_matches_hf(q_lora):
    """model/reference.py's fp64 MLA (what `megapar demo --attention mla` is checked against) is HF's."""
    from model.reference import mla_attention

    config, attn, rotary = _hf_layer(q_lora, True, None, seed=9)
    cfg = ModelConfig(attention="mla", hidden=HIDDEN, heads=HEADS, kv_heads=1, q_lora_rank=q_lora or 0,
                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                      norm_eps=config.rms_norm_eps)
    state = hf_attention_state(attn.state_dict(), cfg)
    h = torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    cos, sin = rotary(h, torch.arange(T)[None])
    with torch.no_grad():
        ref = attn(h, (cos.double(), sin.double()), _causal_mask(T))[0]
    got = mla_attention(h, state, cfg, "layers.0.attn")
    torch.testing.assert_close(got, ref, atol=1e-6 * ref.abs().max().item(), rtol=0)


def test_prefill_past_a_loaded_rope_table_raises_naming_the_lengths():
    """A loaded HF table keeps its own length; a prefill past it indexed the table out of range
    (IndexError on the CPU, a device-side assert on CUDA) instead of a ValueError."""
    config, attn, rotary = _hf_layer(24, True, None, seed=7)
    try:
        layer, _ = _our_layer(config, attn, rotary)
        layer.allocate_cache(B * 4, 4, torch.device("cpu"))
        layer.cos_sin = layer.cos_sin[:8]                             # as if HF's table had 8 positions
        h = torch.randn(B * T, HIDDEN)
        with pytest.raises(ValueError, match=r"seq_len \(11\) exceeds the RoPE table's 8 positions"):
            layer.prefill(h, B, T, B * T, torch.arange(B * 4).view(B, 4))
    finally:
        destroy_parallel()
