"""The demo model (model/) in one process: the distributed model at world size 1 against the
float64 reference, the reference's pieces against independent formulas, and layout checks."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F

from model import reference as ref
from model.config import ModelConfig, check_layout
from model.mhc import mhc_head, mhc_post, mhc_pre
from model.model import DemoModel, apply_rope
from model.weights import make_state_dict, round_to_format, served_expert_weights
from parallel import ParallelConfig, destroy_parallel, init_parallel


def _generate(cfg: ModelConfig, state: dict, prompts: torch.Tensor, new_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode at world size 1; returns (tokens fed [B, S + N], logits [N + 1, B, V])."""
    groups = init_parallel(ParallelConfig(world_size=1))
    try:
        model = DemoModel(cfg, groups)
        model.load_full(state)
        logits = [model.prefill(prompts, prompts.shape[1] + new_tokens)]
        fed = []
        for _ in range(new_tokens):
            fed.append(logits[-1].argmax(-1))
            logits.append(model.decode_step(fed[-1]))
    finally:
        destroy_parallel()
    return torch.cat([prompts] + [t[:, None] for t in fed], dim=1), torch.stack(logits)


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4", "fp8_block", "bf16"])
def test_world1_model_matches_reference_every_step(quant):
    cfg = ModelConfig(quant=quant, layers=2, vocab=128, hidden=64, kv_heads=1)
    state = make_state_dict(cfg, seed=3)
    prompts = torch.randint(cfg.vocab, (2, 5), generator=torch.Generator().manual_seed(4))  # odd length
    tokens, logits = _generate(cfg, state, prompts, new_tokens=4)
    expected = ref.reference_logits(state, cfg, tokens)[:, 4:9].transpose(0, 1)
    assert logits.shape == (5, 2, cfg.vocab)
    err = (logits.double() - expected).abs().max().item()
    assert err < 1e-4 * expected.abs().max().item(), f"{quant}: max error {err:.3g}"
    # The logits are not degenerate: positions and batch rows differ.
    assert (logits[0, 0] - logits[0, 1]).abs().max() > 0.1 and (logits[0] - logits[1]).abs().max() > 0.1


def test_world1_model_detects_a_changed_expert_weight():
    cfg = ModelConfig(layers=1, vocab=64)
    state = make_state_dict(cfg, seed=0)
    prompts = torch.randint(cfg.vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    tokens, logits = _generate(cfg, state, prompts, new_tokens=2)
    altered = dict(state)
    for e in range(cfg.experts):  # every expert, so that whichever the tokens picked, it changed
        altered[f"layers.0.moe.experts.{e}.w2.weight"] = state[f"layers.0.moe.experts.{e}.w2.weight"] * 1.5
    expected = ref.reference_logits(altered, cfg, tokens)[:, 5:8].transpose(0, 1)
    assert (logits.double() - expected).abs().max() > 1e-2


def test_reference_attention_equals_sdpa_with_rope_and_gqa():
    cfg = ModelConfig(hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=16)
    state = make_state_dict(cfg, seed=5)
    torch.manual_seed(0)
    h = torch.randn(2, 7, cfg.hidden, dtype=torch.float64)
    out = ref.attention(h, state, cfg, "layers.0.attn")
    w = {n: state[f"layers.0.attn.{n}.weight"].double() for n in ("wq", "wk", "wv", "wo")}
    pos = torch.arange(7)
    q = apply_rope((h @ w["wq"].T).view(2, 7, 4, 8).float(), pos, cfg.rope_theta).double()
    k = apply_rope((h @ w["wk"].T).view(2, 7, 2, 8).float(), pos, cfg.rope_theta).double()
    v = (h @ w["wv"].T).view(2, 7, 2, 8)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                       v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True)
    expected = o.transpose(1, 2).reshape(2, 7, 32) @ w["wo"].T
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rope_keeps_norms_and_makes_scores_depend_on_offset_only():
    torch.manual_seed(1)
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    pos = torch.tensor([0, 3, 7, 11, 20])
    rotated = ref.rope(x, pos, 10000.0)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    qk = lambda pq, pk: (ref.rope(q.view(1, 1, 1, 8), torch.tensor([pq]), 10000.0)
                         * ref.rope(k.view(1, 1, 1, 8), torch.tensor([pk]), 10000.0)).sum()
    torch.testing.assert_close(qk(9, 4), qk(25, 20))
    # the model's real-arithmetic RoPE agrees with the reference's complex form
    torch.testing.assert_close(apply_rope(x.float(), pos, 10000.0).double(), rotated, atol=1e-5, rtol=1e-5)


def test_reference_mhc_sublayer_matches_model_mhc_functions():
    cfg = ModelConfig(hidden=16, vocab=16, quant="bf16")
    state = make_state_dict(cfg, seed=2)
    torch.manual_seed(2)
    streams = torch.randn(2, 3, cfg.mhc_streams, cfg.hidden, dtype=torch.float64)
    sub = lambda x: torch.tanh(x) * 3
    out = ref.mhc_sublayer(streams, state, cfg, "layers.0.attn_mhc", "layers.0.attn_norm.weight", sub)
    flat = streams.reshape(6, cfg.mhc_streams, cfg.hidden)
    p = {n: state[f"layers.0.attn_mhc.{n}"].double() for n in ("fn", "base", "scale")}
    x, post, comb = mhc_pre(flat, p["fn"], p["base"], p["scale"], backend="torch")
    x = ref.rms_norm(x, state["layers.0.attn_norm.weight"].double(), cfg.norm_eps)
    expected = mhc_post(sub(x), flat, post.double(), comb.double(), backend="torch")
    # model/mhc.py computes in fp32, the reference in fp64
    torch.testing.assert_close(out.reshape(6, cfg.mhc_streams, cfg.hidden), expected, atol=2e-5, rtol=2e-5)
    h = {n: state[f"head_mhc.{n}"].double() for n in ("fn", "base", "scale")}
    head = mhc_head(flat, h["fn"], h["base"], h["scale"], backend="torch")
    mix = ref.rms_norm(flat.reshape(6, -1), None, cfg.norm_eps) @ h["fn"].T
    pre = torch.sigmoid(mix * h["scale"][0] + h["base"]) + cfg.mhc_eps
    torch.testing.assert_close(head, (pre[..., None] * flat).sum(1), atol=2e-5, rtol=2e-5)


def test_reference_moe_routes_by_biased_score_and_weights_by_unbiased_one():
    """Top-2 of 4 experts, token by token: the experts are the top-2 of score + bias, their weights
    the unbiased scores of those two, renormalized, times routed_scaling. (With top-1 the
    renormalized weight is 1 whatever score it is taken from, so K = 2 is needed to see the
    weights.) The bias is big enough that the biased choice differs from the unbiased one for some
    tokens, and small enough that it agrees for others."""
    cfg = ModelConfig(hidden=32, experts=4, top_k=2, moe_inter=32, shared_inter=0, routed_scaling=2.0, vocab=16)
    state = make_state_dict(cfg, seed=1)
    bias = torch.tensor([0.0, 0.5, -0.3, 0.2])
    state["layers.0.moe.gate.e_score_correction_bias"] = bias
    h = torch.randn(16, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    experts = [tuple(w.double() for w in served_expert_weights(state, cfg, 0, e)) for e in range(cfg.experts)]
    gate = state["layers.0.moe.gate.weight"].double()
    limit = cfg.swiglu_limit
    expected = torch.zeros_like(h)
    differs = 0
    for t in range(h.shape[0]):
        scores = F.softplus(h[t] @ gate.T).sqrt().tolist()            # sqrt_softplus, unbiased
        biased = [s + b for s, b in zip(scores, bias.tolist())]
        chosen = sorted(range(cfg.experts), key=lambda e: -biased[e])[:2]
        differs += set(chosen) != set(sorted(range(cfg.experts), key=lambda e: -scores[e])[:2])
        total = sum(scores[e] for e in chosen)
        for e in chosen:
            w1, w3, w2 = experts[e]
            g, u = (h[t] @ w1.T).clamp(max=limit), (h[t] @ w3.T).clamp(-limit, limit)
            expected[t] += cfg.routed_scaling * scores[e] / total * ((g * torch.sigmoid(g) * u) @ w2.T)
    assert 0 < differs < h.shape[0], differs                         # the bias changes some choices, not all
    torch.testing.assert_close(ref.moe(h, state, cfg, 0), expected)


def test_served_expert_weights_round_w13_as_one_matrix():
    cfg = ModelConfig(quant="nvfp4", hidden=32, moe_inter=16, vocab=16)
    state = make_state_dict(cfg, seed=0)
    state["layers.0.moe.experts.0.w3.weight"] = state["layers.0.moe.experts.0.w3.weight"] * 40  # W3 sets the scale
    w1, w3, _ = served_expert_weights(state, cfg, 0, 0)
    w13 = torch.cat([state["layers.0.moe.experts.0.w1.weight"], state["layers.0.moe.experts.0.w3.weight"]])
    assert torch.equal(torch.cat([w1, w3]), round_to_format(w13, "nvfp4"))
    assert not torch.equal(w1, round_to_format(state["layers.0.moe.experts.0.w1.weight"], "nvfp4"))


@pytest.mark.parametrize("kwargs, sizes, match", [
    ({"heads": 6}, dict(tp=4), "heads"),
    ({"kv_heads": 4, "heads": 8}, dict(tp=8), None),
    ({"kv_heads": 2}, dict(tp=2, dcp=2), "KV heads"),
    ({"kv_heads": 1}, dict(tp=2, dcp=2), None),
    ({"kv_heads": 4}, dict(tp=4, dcp=2), r"\(tp // kv_heads\) % dcp == 0.*valid dcp: \[1\]"),
    ({"kv_heads": 1}, dict(tp=4, dcp=4), None),
    ({"kv_heads": 8, "heads": 8}, dict(tp=2, pcp=2), None),           # KV over PCP: 4 KV heads per rank
    ({"kv_heads": 8, "heads": 8}, dict(tp=2, pcp=2, dcp=2), r"\(tp // kv_heads\) % dcp == 0.*valid dcp: \[1\]"),
    ({"kv_heads": 1}, dict(tp=2, pcp=2, dcp=2), None),                # DCP inside TP shares one KV head
    ({"vocab": 99}, dict(tp=2), "vocab"),
    ({"experts": 6}, dict(), "ep"),
])
def test_check_layout_names_the_problem(kwargs, sizes, match):
    cfg = ModelConfig(**kwargs)
    pcfg = ParallelConfig(world_size=8, **sizes)
    if match is None:
        check_layout(cfg, pcfg)
    else:
        with pytest.raises(ValueError, match=match):
            check_layout(cfg, pcfg)


def test_check_layout_run_shapes():
    pcfg = ParallelConfig(world_size=4, pcp=2)  # dp 2
    check_layout(ModelConfig(), pcfg, prompt_len=8, batch=2)
    with pytest.raises(ValueError, match="2 \\* pcp"):
        check_layout(ModelConfig(), pcfg, prompt_len=6)
    with pytest.raises(ValueError, match="replicas"):
        check_layout(ModelConfig(), pcfg, batch=3)
    with pytest.raises(ValueError, match="mxfp4"):
        ModelConfig(hidden=48)
    check_layout(ModelConfig(experts=6), ParallelConfig(world_size=4), redundant_experts=2)


def test_load_full_refuses_keys_it_would_leave_unused_and_wrong_shapes():
    """A checkpoint that does not match the config loaded silently: its shared experts or extra
    layers were dropped (the model then differs from the checkpoint's), a [1] norm broadcast."""
    cfg = ModelConfig(layers=1, vocab=64)
    state = make_state_dict(cfg, seed=0)

    def load(c: ModelConfig, s: dict) -> DemoModel:
        groups = init_parallel(ParallelConfig(world_size=1))
        try:
            model = DemoModel(c, groups)
            model.load_full(s)
            return model
        finally:
            destroy_parallel()

    with pytest.raises(ValueError, match=r"leaves unused: layers\.0\.moe\.shared_experts\.w1\.weight.*shared_inter 0"):
        load(ModelConfig(layers=1, vocab=64, shared_inter=0), state)
    with pytest.raises(ValueError, match=r"leaves unused: layers\.1\.attn\.wk\.weight.*\(41 in all\)"):
        load(cfg, make_state_dict(ModelConfig(layers=2, vocab=64), seed=0))
    with pytest.raises(ValueError, match=r"norm\.weight has shape \(1,\), expected \(64,\)"):
        load(cfg, {**state, "norm.weight": torch.ones(1)})
    with pytest.raises(ValueError, match=r"layers\.0\.attn_mhc\.scale has shape \(1,\), expected \(3,\)"):
        load(cfg, {**state, "layers.0.attn_mhc.scale": torch.ones(1)})
    mla = ModelConfig(attention="mla", layers=1, vocab=64)         # (MLA's attention weights likewise)
    mla_state = make_state_dict(mla, seed=0)
    key = next(k for k in mla_state if k.endswith("kv_a_layernorm.weight"))
    with pytest.raises(ValueError, match=rf"{re.escape(key)} has shape \(1,\), expected"):
        load(mla, {**mla_state, key: torch.ones(1)})
    load(mla, mla_state)                                           # (and the right shapes load)
    # DeepSeek's `gate.bias` for the correction bias is read, hence not unused; the values are the reference's
    renamed = {("layers.0.moe.gate.bias" if k.endswith("e_score_correction_bias") else k): v for k, v in state.items()}
    prompts = torch.randint(cfg.vocab, (2, 4), generator=torch.Generator().manual_seed(1))
    tokens, logits = _generate(cfg, renamed, prompts, new_tokens=1)
    expected = ref.reference_logits(state, cfg, tokens)[:, 3:5].transpose(0, 1)
    assert (logits.double() - expected).abs().max() < 1e-4 * expected.abs().max()


def test_model_config_refuses_bad_values_and_mla_ignores_kv_heads():
    with pytest.raises(ValueError, match="unknown scoring 'sqrtsoftplus'; valid: softmax, sigmoid, sqrt_softplus"):
        ModelConfig(scoring="sqrtsoftplus")           # the reference read any unknown name as sqrt_softplus
    with pytest.raises(ValueError, match=r"rope_theta \(0\.0\) must be > 0"):
        ModelConfig(rope_theta=0.0)
    with pytest.raises(ValueError, match=r"norm_eps \(-1e-06\) must be >= 0"):
        ModelConfig(norm_eps=-1e-6)
    for name, bad in (("norm_eps", float("inf")), ("mhc_eps", float("nan"))):     # (passed the >= 0 check)
        with pytest.raises(ValueError, match=rf"{name} \({bad}\) must be >= 0 and finite"):
            ModelConfig(**{name: bad})
    # MLA has no kv_heads (one latent head): the GQA default kv_heads=2 refused 3 or 6 heads over tp 3
    cfg = ModelConfig(attention="mla", heads=3, layers=1, vocab=64)
    check_layout(ModelConfig(attention="mla", heads=6, experts=6, vocab=96), ParallelConfig(world_size=3, tp=3))
    with pytest.raises(ValueError, match="kv_heads"):
        check_layout(ModelConfig(heads=6, experts=6, vocab=96), ParallelConfig(world_size=3, tp=3))  # GQA still checked
    state = make_state_dict(cfg, seed=2)
    prompts = torch.randint(cfg.vocab, (1, 3), generator=torch.Generator().manual_seed(2))
    tokens, logits = _generate(cfg, state, prompts, new_tokens=2)
    expected = ref.reference_logits(state, cfg, tokens)[:, 2:5].transpose(0, 1)
    assert (logits.double() - expected).abs().max() < 1e-4 * expected.abs().max()


@contextlib.contextmanager
def _loaded_one_rank_model(cfg: ModelConfig, seed: int = 2):
    """A DemoModel at world size 1 with `make_state_dict(cfg, seed)` loaded; the groups destroyed after."""
    state = make_state_dict(cfg, seed=seed)
    groups = init_parallel(ParallelConfig(world_size=1))
    try:
        model = DemoModel(cfg, groups)
        model.load_full(state)
        yield model
    finally:
        destroy_parallel()


def test_decode_step_refuses_another_batch_or_shape_before_writing():
    cfg = ModelConfig(layers=1, vocab=64)
    with _loaded_one_rank_model(cfg) as model:
        prompts = torch.randint(cfg.vocab, (3, 4), generator=torch.Generator().manual_seed(0))
        model.prefill(prompts, 8)
        caches = [t.clone() for layer in model.layers for t in (layer.attn.cache.k, layer.attn.cache.v)]
        with pytest.raises(ValueError, match=r"got 2 tokens but prefill\(\) cached 3 sequences"):
            model.decode_step(torch.zeros(2, dtype=torch.long))
        with pytest.raises(ValueError, match=r"shape \[B\]; got \(3, 1\)"):
            model.decode_step(torch.zeros(3, 1, dtype=torch.long))
        assert model.seq_len == 4                        # nothing advanced
        after = [t for layer in model.layers for t in (layer.attn.cache.k, layer.attn.cache.v)]
        assert all(torch.equal(a, b) for a, b in zip(caches, after))
        model.decode_step(torch.zeros(3, dtype=torch.long))   # the right batch still decodes
        assert model.seq_len == 5


def test_failed_prefill_leaves_no_decode_state_and_bad_tokens_are_refused_before_the_cache():
    """prefill() reallocated the KV cache before the tokens were looked at: a prompt with an id
    outside the vocabulary (IndexError from the embedding) wiped the cache of the sequences being
    decoded but kept their length, and the next decode_step ran on the empty cache with no error
    (wrong logits). Bad tokens now raise ValueError naming the values before the cache is touched,
    and a prefill failing anywhere later leaves no decode state."""
    cfg = ModelConfig(layers=1, vocab=64)
    with _loaded_one_rank_model(cfg) as model:
        prompts = torch.randint(cfg.vocab, (2, 4), generator=torch.Generator().manual_seed(0))
        model.prefill(prompts, 8)
        expected = model.decode_step(torch.tensor([3, 5]))
        for bad, match in ((torch.tensor([[1, 2, 64, 3], [0, 0, 0, 0]]), r"token ids in \[0, 64\] are outside the "
                            r"vocabulary \[0, 64\)"),
                           (torch.tensor([[1, -1, 2, 3], [1, 1, 1, 1]]), r"token ids in \[-1, 3\]"),
                           (torch.zeros(2, 4), "integer token ids; got torch.float32"),
                           (torch.zeros(0, 4, dtype=torch.long), r"tokens \[B, S\] with B >= 1; got shape \(0, 4\)"),
                           (torch.zeros(4, dtype=torch.long), r"got shape \(4,\)")):
            model.prefill(prompts, 8)
            cache = [t.clone() for t in (model.layers[0].attn.cache.k, model.layers[0].attn.cache.v)]
            with pytest.raises(ValueError, match=match):
                model.prefill(bad, 8)
            assert model.seq_len == 4 and all(torch.equal(a, b) for a, b in zip(
                cache, (model.layers[0].attn.cache.k, model.layers[0].attn.cache.v)))   # untouched
            torch.testing.assert_close(model.decode_step(torch.tensor([3, 5])), expected, rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"decode_step\(\): token ids in \[3, 64\]"):
            model.decode_step(torch.tensor([3, 64]))
        # a failure past the checks (here: in the MoE of the first layer) leaves nothing to decode from
        model.prefill(prompts, 8)
        moe = model.layers[0].moe

        def broken(*args, **kwargs):
            raise RuntimeError("injected")

        moe.forward = broken
        with pytest.raises(RuntimeError, match="injected"):
            model.prefill(prompts, 8)
        del moe.forward
        with pytest.raises(RuntimeError, match=r"needs prefill\(\) first"):
            model.decode_step(torch.tensor([3, 5]))
        model.prefill(prompts, 8)                                      # and a new prefill decodes as before
        torch.testing.assert_close(model.decode_step(torch.tensor([3, 5])), expected, rtol=0, atol=0)


def test_mla_load_full_refuses_per_head_weights_of_another_shape():
    """MLA's per-head weights (q_b_proj / q_proj, kv_b_proj) were cut by heads with a view before
    their shape was looked at, so a tensor of the same element count, e.g. a transposed one
    ([r, heads * d] for [heads * d, r]), loaded silently as a scrambled weight."""
    for q_lora in (32, 0):
        cfg = ModelConfig(attention="mla", layers=1, vocab=64, q_lora_rank=q_lora)
        state = make_state_dict(cfg, seed=0)
        groups = init_parallel(ParallelConfig(world_size=1))
        try:
            for name in ("q_b_proj" if q_lora else "q_proj", "kv_b_proj"):
                key = f"layers.0.attn.{name}.weight"
                want = tuple(state[key].shape)
                assert want[0] != want[1]                                  # (a transposed one is another shape)
                with pytest.raises(ValueError, match=rf"{re.escape(key)} has shape "
                                   rf"{re.escape(str(want[::-1]))}, expected {re.escape(str(want))}"):
                    DemoModel(cfg, groups).load_full({**state, key: state[key].T.contiguous()})
            DemoModel(cfg, groups).load_full(state)                        # (the right shapes load)
        finally:
            destroy_parallel()


def test_failed_load_full_leaves_the_weights_as_they_were():
    """load_full wrote layer after layer and refused keys it left unused only at the end: a
    checkpoint of another config (an extra layer), one missing a key of the last layer or with a
    head of another shape raised after some or all of its weights were written over the loaded
    ones. The model must compute as before the failed call."""
    cfg = ModelConfig(layers=2, vocab=64)
    state = make_state_dict(cfg, seed=0)
    other = make_state_dict(ModelConfig(layers=3, vocab=64), seed=1)
    groups = init_parallel(ParallelConfig(world_size=1))
    try:
        model = DemoModel(cfg, groups)
        model.load_full(state)
        prompts = torch.randint(cfg.vocab, (2, 4), generator=torch.Generator().manual_seed(1))
        expected = model.prefill(prompts)
        last = "layers.1.moe.shared_experts.w2.weight"
        for bad, error, match in ((other, ValueError, r"leaves unused: layers\.2\."),
                                  ({k: v for k, v in other.items() if not k.startswith("layers.2.") and k != last},
                                   KeyError, re.escape(last)),
                                  ({k: v for k, v in other.items() if not k.startswith("layers.2.")}
                                   | {"lm_head.weight": torch.zeros(cfg.vocab, cfg.hidden + 1)}, ValueError,
                                   r"full weight has shape \(64, 65\)")):
            with pytest.raises(error, match=match):
                model.load_full(bad)
            torch.testing.assert_close(model.prefill(prompts), expected, rtol=0, atol=0)
    finally:
        destroy_parallel()


def test_gqa_load_full_refuses_q_k_v_weights_of_another_shape():
    """wq / wk / wv were checked only concatenated, and with KV heads replicated over TP (tp >
    kv_heads) wk / wv were first viewed by heads: a transposed wk ([H, kv_heads * D]) loaded
    silently, scrambled, and so did a wq one head larger with a wk one head smaller. The load
    does no communication, so a TP group of 2 (this rank 0) needs no second process."""
    import dataclasses

    from model.model import Attention
    from model.profile import Timer
    from parallel.groups import Group

    cfg = ModelConfig(layers=1, vocab=64, heads=4, kv_heads=1, head_dim=16, hidden=64)
    state = make_state_dict(cfg, seed=0)
    p = "layers.0.attn"
    d = cfg.head_dim
    shifted = {**state, f"{p}.wq.weight": torch.cat([state[f"{p}.wq.weight"], state[f"{p}.wk.weight"]]),
               f"{p}.wk.weight": state[f"{p}.wk.weight"][:0]}                 # one head moved from wk to wq
    groups = init_parallel(ParallelConfig(world_size=1))
    try:
        for tp in (2, 1):
            g = dataclasses.replace(groups, tp=Group(name="tp", group=None, rank=0, size=tp, ranks=tuple(range(tp))))
            attn = Attention(cfg, g, sequence_parallel=False, overlap=False, timer=Timer(), device=torch.device("cpu"))
            assert attn.replicated_kv == tp
            for name in ("wk", "wv"):
                key = f"{p}.{name}.weight"
                with pytest.raises(ValueError, match=rf"{re.escape(key)} has shape \(64, 16\), expected \(16, 64\)"):
                    attn.load_full({**state, key: state[key].T.contiguous()}, p)
            with pytest.raises(ValueError, match=rf"{p}\.wq\.weight has shape \({5 * d}, 64\), expected \({4 * d}, 64\)"):
                attn.load_full(shifted, p)
            attn.load_full(state, p)                                         # (the right shapes load)
    finally:
        destroy_parallel()


def test_rebalance_experts_rebalances_once_when_the_step_lands_on_the_interval():
    """`rebalance_experts` called `eplb.step()`, which rebalances by itself on a multiple of the
    interval, and then `rebalance()` again: two rounds of planning and collectives."""
    from dataclasses import replace

    groups = init_parallel(ParallelConfig(world_size=1))
    try:
        model = DemoModel(ModelConfig(), groups, eplb_redundant=2)
        model.eplb.config = replace(model.eplb.config, interval=2)
        reports = [model.rebalance_experts() for _ in range(4)]     # steps 1..4: due at 2 and 4
        assert [r.step for r in reports] == [1, 2, 3, 4]
        assert len(model.eplb.reports) == 4                         # one rebalance per call
    finally:
        destroy_parallel()
