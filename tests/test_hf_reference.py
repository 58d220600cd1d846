"""megapar against HF transformers' DeepSeek modules: tiny modules with random weights, their
state dicts loaded into megapar by name, outputs compared (CPU, fp32).

DeepseekV3MoE, DeepseekV4SparseMoeBlock (top-k and hash layers), DeepseekV4MLP (the clamped
shared expert), DeepseekV4HyperConnection / HyperHead against mhc_pre / mhc_post / mhc_head; and
the presets against what the configs say.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from moe import MoEConfig, MoELayer  # noqa: E402
from moe.experts import SharedExpert  # noqa: E402
from moe.loading import moe_state  # noqa: E402
from model.mhc import mhc_checkpoint_params, mhc_head, mhc_post, mhc_pre  # noqa: E402

H, I, E, K, VOCAB = 32, 16, 8, 2, 64
MATH_FIELDS = ("hidden", "inter", "num_experts", "top_k", "scoring", "use_bias", "n_group", "topk_group",
               "renormalize", "routed_scaling", "swiglu_limit", "shared_swiglu_limit", "num_shared", "shared_inter",
               "num_hash_layers", "vocab")


def _v3_config(**kw):
    return transformers.DeepseekV3Config(**{**dict(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, num_hidden_layers=1, vocab_size=VOCAB, intermediate_size=48,
        num_attention_heads=2, num_key_value_heads=2), **kw})


def _v4_config(**kw):
    return transformers.DeepseekV4Config(**{**dict(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, vocab_size=VOCAB,
        num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"], swiglu_limit=0.3, routed_scaling_factor=1.5,
        num_attention_heads=2, hc_mult=4), **kw})


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("tid2eid"):  # distinct experts per token
                t.copy_(torch.stack([torch.randperm(E, generator=g)[: t.shape[1]] for _ in range(t.shape[0])]))
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * (std if t.dim() > 1 else 1.0))


def _megapar(cfg: MoEConfig, state: dict, naming: str) -> MoELayer:
    layer = MoELayer(dataclasses.replace(cfg, dtype=torch.float32, expert_format="fp32"), init="empty")
    layer.load_deepseek(moe_state(state, naming=naming))
    return layer


def _per_expert_hf(state: dict) -> dict:
    """transformers 5's fused expert tensors -> the per-expert names of transformers 4 / hub files."""
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    gu, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    for e in range(gu.shape[0]):
        out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"] = gu[e].chunk(2, 0)
        out[f"experts.{e}.down_proj.weight"] = down[e]
    return out


def _deepseek_names(state: dict) -> dict:
    """HF names -> DeepSeek's original (V4 as published: gate.bias, w1/w2/w3)."""
    out = {}
    proj = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for k, v in _per_expert_hf(state).items():
        k = k.replace("gate.e_score_correction_bias", "gate.bias")
        for a, b in proj.items():
            k = k.replace(f".{a}.", f".{b}.")
        out[k] = v
    return out


@pytest.mark.parametrize("naming", ["hf_fused", "hf_per_expert", "deepseek"])
def test_v3_moe_matches_hf(naming):
    config = _v3_config()
    ref = v3.DeepseekV3MoE(config).float().eval()
    _randomize(ref, 0)
    state = ref.state_dict()
    state = {"hf_fused": state, "hf_per_expert": _per_expert_hf(state), "deepseek": _deepseek_names(state)}[naming]
    cfg = MoEConfig.from_hf_config(config)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling, cfg.scoring) == (4, 2, 2.5, "sigmoid")
    layer = _megapar(cfg, state, "deepseek" if naming == "deepseek" else "hf")
    x = torch.randn(1, 24, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)[0]
        got = layer(x[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["hash", "topk"])
def test_v4_moe_matches_hf(layer_idx):
    config = _v4_config()
    ref = v4.DeepseekV4SparseMoeBlock(config, layer_idx).float().eval()
    _randomize(ref, 2 + layer_idx, std=1.0)   # big enough that the 0.3 clamps fire in both expert kinds
    cfg = MoEConfig.from_hf_config(config).for_layer(layer_idx)
    assert cfg.hash_layer == (layer_idx == 0) and cfg.shared_swiglu_limit == 0.3 and cfg.routed_scaling == 1.5
    layer = _megapar(cfg, ref.state_dict(), "hf")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 24, H, generator=g)
    ids = torch.randint(0, VOCAB, (1, 24), generator=g)
    with torch.no_grad():
        want = ref(x, input_ids=ids)[0]
        got = layer(x[0], input_ids=ids[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # an unclamped shared expert (the old V4 presets) is far off on the same weights
        layer.shared_experts.swiglu_limit = None
        assert (layer(x[0], input_ids=ids[0]) - want).abs().max() > 1e-2



@pytest.mark.parametrize("n_shared", [0, 2])
def test_v4_shared_expert_is_one_mlp_whatever_n_shared_experts_says_as_hf_builds_it(n_shared):
    """HF's DeepseekV4SparseMoeBlock always has one shared DeepseekV4MLP of width
    moe_intermediate_size; n_shared_experts does not enter it. megapar read it as V3's count: 0
    dropped the shared expert (its tensors ignored, the output off by it), 2 built one twice as
    wide, which the checkpoint's tensors did not fit (ValueError on load)."""
    config = _v4_config(n_shared_experts=n_shared)
    ref = v4.DeepseekV4SparseMoeBlock(config, 1).float().eval()
    _randomize(ref, 16 + n_shared, std=1.0)
    assert ref.shared_experts.gate_proj.weight.shape == (I, H)
    cfg = MoEConfig.from_hf_config(config).for_layer(1)
    assert cfg.num_shared * (cfg.shared_inter or cfg.inter) == I
    layer = _megapar(cfg, ref.state_dict(), "hf")
    x = torch.randn(1, 24, H, generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0]), ref(x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["hash", "topk"])
def test_v4_moe_renormalizes_whatever_norm_topk_prob_says_as_hf_does(layer_idx):
    """HF's V4 routers (and DeepSeek's V4 code, for its non-softmax scores) always divide the K
    weights by their sum; norm_topk_prob=False in a V4 config changes nothing there (megapar read
    it as renormalize=False: weights off by the sum, 2.6 and 6.4 at the output here)."""
    config = _v4_config(norm_topk_prob=False)
    ref = v4.DeepseekV4SparseMoeBlock(config, layer_idx).float().eval()
    _randomize(ref, 12 + layer_idx, std=1.0)
    cfg = MoEConfig.from_hf_config(config).for_layer(layer_idx)
    assert cfg.renormalize
    layer = _megapar(cfg, ref.state_dict(), "hf")
    g = torch.Generator().manual_seed(13)
    x = torch.randn(1, 24, H, generator=g)
    ids = torch.randint(0, VOCAB, (1, 24), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0], input_ids=ids[0]), ref(x, input_ids=ids)[0], rtol=1e-5, atol=1e-5)


def test_v3_router_with_a_bf16_gate_weight_keeps_fp32_logits_as_hf_does():
    """A bf16 gate weight (router_dtype=bf16): HF's DeepseekV3TopkRouter takes x and the weight to
    fp32 before the product; megapar's Router took x to bf16 and rounded the logits to bf16 (6e-2 off
    here, the weights 6e-4; near-ties can flip experts)."""
    config = _v3_config(n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4)
    ref = v3.DeepseekV3TopkRouter(config)
    _randomize(ref, 14, std=1.0)
    with torch.no_grad():
        ref.weight.copy_(ref.weight.to(torch.bfloat16).float())      # what a bf16 checkpoint holds
        ref.e_score_correction_bias.mul_(0.05)
    cfg = dataclasses.replace(MoEConfig.from_hf_config(config), dtype=torch.float32, expert_format="fp32",
                              router_dtype=torch.bfloat16)
    layer = MoELayer(cfg, init="empty")
    layer.gate.load_state_dict(ref.state_dict())
    assert layer.gate.weight.dtype == torch.bfloat16
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        want_logits, want_w, want_ids = ref(x)
        got = layer.gate(x, backend="torch")
        torch.testing.assert_close(layer.gate.logits(x), want_logits, rtol=1e-5, atol=1e-5)
    order, want_order = got.topk_ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(got.topk_ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(got.topk_weights.gather(1, order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)


def test_v4_mlp_matches_shared_expert():
    config = _v4_config()
    ref = v4.DeepseekV4MLP(config).float()
    _randomize(ref, 4, std=1.0)
    shared = SharedExpert(H, I, swiglu_limit=MoEConfig.from_hf_config(config).shared_swiglu_limit, dtype=torch.float32)
    sd = ref.state_dict()
    shared.load_state_dict({"w1.weight": sd["gate_proj.weight"], "w3.weight": sd["up_proj.weight"],
                            "w2.weight": sd["down_proj.weight"]})
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(shared(x), ref(x), rtol=1e-5, atol=1e-5)


def test_v4_hyper_connection_and_head_match_mhc():
    config = _v4_config(hc_sinkhorn_iters=7, hc_eps=1e-4, rms_norm_eps=1e-5)
    hc = v4.DeepseekV4HyperConnection(config).float()
    head = v4.DeepseekV4HyperHead(config).float()
    for i, m in enumerate((hc, head)):
        _randomize(m, 6 + i, std=0.05)
    g = torch.Generator().manual_seed(8)
    streams = torch.randn(2, 5, 4, H, generator=g)             # [B, S, M, H]
    out = torch.randn(2, 5, H, generator=g)                    # a sublayer's output
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
        new = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        want_head = head(streams)
    # by name, as a checkpoint holds them (HF names here; DeepSeek's are hc_attn_fn, ...)
    state = {f"model.layers.0.attn_hc.{k}": v for k, v in hc.state_dict().items()}
    state.update({f"model.hc_head.{k}": v for k, v in head.state_dict().items()})
    fn, base, scale = mhc_checkpoint_params(state, "attn", 0, naming="hf")
    res = streams.reshape(10, 4, H)
    pre = mhc_pre(res, fn, base, scale, sinkhorn_iters=7, eps=1e-4, rms_eps=1e-5, backend="torch")
    torch.testing.assert_close(pre.layer_input, collapsed.reshape(10, H), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pre.post, post.reshape(10, 4), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pre.comb, comb.reshape(10, 4, 4), rtol=1e-5, atol=1e-6)
    got_new = mhc_post(out.reshape(10, H), res, pre.post, pre.comb, backend="torch")
    torch.testing.assert_close(got_new, new.reshape(10, 4, H), rtol=1e-5, atol=1e-5)
    hfn, hbase, hscale = mhc_checkpoint_params(state, "head", naming="hf")
    got_head = mhc_head(res, hfn, hbase, hscale, eps=1e-4, rms_eps=1e-5, backend="torch")
    torch.testing.assert_close(got_head, want_head.reshape(10, H), rtol=1e-5, atol=1e-6)
    ds = {"layers.0.hc_attn_fn": fn, "layers.0.hc_attn_base": base, "layers.0.hc_attn_scale": scale}
    assert all(torch.equal(a, b) for a, b in zip(mhc_checkpoint_params(ds, "attn", 0), (fn, base, scale)))


def _math(cfg: MoEConfig) -> dict:
    out = {f: getattr(cfg, f) for f in MATH_FIELDS}
    out["shared_inter"] = cfg.shared_inter or cfg.inter                   # None means "= inter"
    return out


def test_presets_agree_with_the_hf_configs():
    """HF's default configs are the published V3 and V4-Flash(-Base) ones."""
    assert _math(MoEConfig.from_hf_config(transformers.DeepseekV3Config())) == _math(MoEConfig.deepseek_v3())
    v4_flash = MoEConfig.from_hf_config(transformers.DeepseekV4Config())
    assert _math(v4_flash) == _math(MoEConfig.deepseek_v4_flash())
    assert v4_flash.routed_scaling == 1.5 and v4_flash.shared_swiglu_limit == 10.0
    pro = transformers.DeepseekV4Config(hidden_size=7168, moe_intermediate_size=3072, n_routed_experts=384,
                                        routed_scaling_factor=2.5)
    want = _math(MoEConfig.deepseek_v4_pro(num_hash_layers=3, vocab=129280))
    assert _math(MoEConfig.from_hf_config(pro)) == want
    # the config.json dict (to_dict) gives the same, and the demo model agrees with the preset's rules
    assert _math(MoEConfig.from_hf_config(transformers.DeepseekV4Config().to_dict())) == _math(v4_flash)
    from model.config import ModelConfig

    demo = ModelConfig().moe_config()
    assert (demo.scoring, demo.routed_scaling, demo.swiglu_limit, demo.shared_swiglu_limit) == \
        (v4_flash.scoring, v4_flash.routed_scaling, v4_flash.swiglu_limit, v4_flash.shared_swiglu_limit)


def test_from_hf_config_fields_and_errors():
    d = transformers.DeepseekV4Config(mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 41, swiglu_limit=7.0,
                                      norm_topk_prob=False, scoring_func="sigmoid").to_dict()
    d["quantization_config"] = {"quant_method": "fp8", "expert_dtype": "fp4"}
    cfg = MoEConfig.from_hf_config(d, dtype=torch.float32)
    # (renormalize: HF's V4 routers always renormalize, norm_topk_prob=False or not)
    assert (cfg.num_hash_layers, cfg.swiglu_limit, cfg.shared_swiglu_limit, cfg.renormalize, cfg.scoring,
            cfg.expert_format, cfg.dtype) == (2, 7.0, 7.0, True, "sigmoid", "mxfp4", torch.float32)
    v3d = transformers.DeepseekV3Config(topk_method="greedy", n_group=1).to_dict()
    v3d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    c3 = MoEConfig.from_hf_config(v3d)
    # (HF's V3 router keeps its e_score_correction_bias whatever topk_method says)
    assert (c3.use_bias, c3.n_group, c3.expert_format) == (True, None, "fp8_block")
    # the experts' format: quant_method mxfp4 maps; an unknown expert_dtype / quant_method is refused (it
    # loaded as the default bf16 format, or failed on the checkpoint's tensors)
    assert MoEConfig.from_hf_config({**v3d, "quantization_config": {"quant_method": "mxfp4"}}).expert_format == "mxfp4"
    assert MoEConfig.from_hf_config({**v3d, "quantization_config": {"expert_dtype": "bf16"}}).expert_format == "bf16"
    for q, needle in (({"expert_dtype": "int4"}, "expert_dtype 'int4'"), ({"quant_method": "awq"}, "quant_method 'awq'"),
                      ({"quant_method": "fp8", "weight_block_size": [1, 128]}, r"weight_block_size \[1, 128\]")):
        with pytest.raises(ValueError, match=needle):
            MoEConfig.from_hf_config({**v3d, "quantization_config": q})
    # DeepSeek's inference config.json (ModelArgs names)
    ds = {"dim": 4096, "moe_inter_dim": 2048, "n_routed_experts": 256, "n_activated_experts": 6, "n_shared_experts": 1,
          "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "n_hash_layers": 3,
          "vocab_size": 129280, "expert_dtype": "fp4"}
    assert _math(MoEConfig.from_hf_config(ds)) == _math(MoEConfig.deepseek_v4_flash())
    with pytest.raises(ValueError, match="model_type"):
        MoEConfig.from_hf_config({"model_type": "llama", "hidden_size": 8})
    # HF routes layer 1 by hash here; for_layer(1) would have made it a top-k layer
    with pytest.raises(ValueError, match=r"hash_moe layers at \[1, 3\], after the leading 0"):
        MoEConfig.from_hf_config(transformers.DeepseekV4Config(num_hidden_layers=4,
                                                               mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe"]))
    with pytest.raises(ValueError, match="hidden_act"):
        MoEConfig.from_hf_config({**transformers.DeepseekV3Config().to_dict(), "hidden_act": "gelu"})


def test_demo_reference_is_hf_deepseek_v4_with_its_attention_swapped():
    """model/reference.py (what the demo model is checked against) against HF's DeepseekV4ForCausalLM
    with the same weights and each layer's attention replaced by the reference's GQA (the demo's
    stand-in for V4's compressed attention): embedding, mHC sites, norm placement and eps, top-k MoE
    with the clamped shared expert, the mHC head, final norm and lm_head (untied)."""
    from model import reference
    from model.config import ModelConfig
    from model.weights import make_state_dict

    cfg = ModelConfig(vocab=VOCAB, hidden=H, layers=2, heads=4, kv_heads=2, head_dim=8, experts=E, top_k=K,
                      moe_inter=I, shared_inter=I, quant="bf16", norm_eps=1e-5, mhc_eps=1e-4, sinkhorn_iters=7,
                      swiglu_limit=0.8, shared_swiglu_limit=0.8)
    state = {k: v.bfloat16().float() if ".experts." in k else v           # bf16 experts: served exactly
             for k, v in make_state_dict(cfg, seed=11).items()}
    config = _v4_config(mlp_layer_types=["moe", "moe"], swiglu_limit=0.8, hc_sinkhorn_iters=7, hc_eps=1e-4,
                        rms_norm_eps=1e-5, head_dim=32, q_lora_rank=16, o_lora_rank=16, o_groups=2, index_n_heads=2,
                        index_head_dim=16, sliding_window=16, experts_implementation="eager")
    assert not config.tie_word_embeddings
    hf = v4.DeepseekV4ForCausalLM(config).double().eval()
    state64 = {k: v.double() for k, v in state.items()}

    class RefAttention(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i

        def forward(self, x, **kwargs):
            return reference.attention(x, state64, cfg, f"layers.{self.i}.attn"), None

    m = hf.model
    with torch.no_grad():
        m.embed_tokens.weight.copy_(state["embed.weight"])
        for i, layer in enumerate(m.layers):
            p = f"layers.{i}"
            layer.self_attn = RefAttention(i)
            for ours, site in (("attn_mhc", layer.attn_hc), ("ffn_mhc", layer.ffn_hc)):
                for n in ("fn", "base", "scale"):
                    getattr(site, n).copy_(state[f"{p}.{ours}.{n}"])
            layer.input_layernorm.weight.copy_(state[f"{p}.attn_norm.weight"])
            layer.post_attention_layernorm.weight.copy_(state[f"{p}.ffn_norm.weight"])
            layer.mlp.gate.weight.copy_(state[f"{p}.moe.gate.weight"])
            layer.mlp.gate.e_score_correction_bias.copy_(state[f"{p}.moe.gate.e_score_correction_bias"])
            for e in range(E):
                q = f"{p}.moe.experts.{e}"
                layer.mlp.experts.gate_up_proj[e].copy_(torch.cat([state[f"{q}.w1.weight"], state[f"{q}.w3.weight"]]))
                layer.mlp.experts.down_proj[e].copy_(state[f"{q}.w2.weight"])
            for hf_name, ours in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                getattr(layer.mlp.shared_experts, hf_name).weight.copy_(state[f"{p}.moe.shared_experts.{ours}.weight"])
        for n in ("fn", "base", "scale"):
            getattr(m.hc_head, f"hc_{n}").copy_(state[f"head_mhc.{n}"])
        m.norm.weight.copy_(state["norm.weight"])
        hf.lm_head.weight.copy_(state["lm_head.weight"])
        tokens = torch.randint(VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
        want = hf(input_ids=tokens, use_cache=False).logits
    got = reference.reference_logits(state, cfg, tokens)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)   # HF's mHC runs in fp32


def test_v4_config_dict_without_hash_layer_fields_gets_hfs_default():
    """A deepseek_v4 config.json dict naming neither mlp_layer_types nor num_hash_layers: HF's
    DeepseekV4Config makes its first 3 layers (at most num_hidden_layers) hash layers; megapar read
    0, so those layers routed by top-k instead of by token id. An explicit count is kept."""
    base = {k: v for k, v in transformers.DeepseekV4Config().to_dict().items()
            if k not in ("mlp_layer_types", "num_hash_layers", "transformers_version", "architectures")}
    for extra in ({}, {"num_hidden_layers": 2}, {"num_hash_layers": 0}, {"num_hash_layers": 1}):
        d = {**base, **extra}
        hf = transformers.DeepseekV4Config(**d)
        want = next((i for i, t in enumerate(hf.mlp_layer_types) if t != "hash_moe"), len(hf.mlp_layer_types))
        assert MoEConfig.from_hf_config(d).num_hash_layers == want, extra
        assert MoEConfig.from_hf_config(hf).num_hash_layers == want, extra


def test_v3_router_ignores_topk_method_as_hf_does():
    """HF's DeepseekV3TopkRouter always adds e_score_correction_bias and ranks groups by their
    top-2 sums; topk_method is not one of its config's fields. megapar read topk_method="greedy" as
    use_bias=False: the checkpoint's bias dropped and groups ranked by their max (other experts)."""
    config = _v3_config(topk_method="greedy")
    ref = v3.DeepseekV3MoE(config).float().eval()
    _randomize(ref, 20)
    cfg = MoEConfig.from_hf_config(config)
    assert cfg.use_bias
    layer = _megapar(cfg, ref.state_dict(), "hf")
    x = torch.randn(1, 24, H, generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0]), ref(x)[0], rtol=1e-5, atol=1e-5)


_MOE_FIELDS = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
               "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "hidden_act", "scoring_func",
               "swiglu_limit", "vocab_size", "num_hidden_layers", "mlp_bias", "mlp_layer_types", "layer_types")


@pytest.mark.parametrize("drop", ["optional", "all"])
@pytest.mark.parametrize("cls", ["DeepseekV3Config", "DeepseekV32Config", "DeepseekV4Config"])
def test_config_dict_without_moe_fields_gets_hfs_defaults(cls, drop):
    """A config.json dict that leaves the MoE fields out: HF's config class fills in its defaults
    (V3: routed_scaling_factor 2.5, n_shared_experts 1, n_group 8 / topk_group 4; V4 1.5); megapar
    read 1.0, no shared expert and no group limit, or raised KeyError for the sizes."""
    config_cls = getattr(transformers, cls)
    fields = _MOE_FIELDS if drop == "all" else ("routed_scaling_factor", "n_shared_experts", "n_group", "topk_group")
    d = {k: v for k, v in config_cls().to_dict().items() if k not in (*fields, "transformers_version")}
    assert _math(MoEConfig.from_hf_config(d)) == _math(MoEConfig.from_hf_config(config_cls(**d)))


def test_v4_mlp_bias_is_refused():
    """mlp_bias=True gives HF's shared DeepseekV4MLP bias terms, which megapar's shared expert has
    not: the checkpoint's biases were dropped without a word."""
    config = _v4_config(mlp_bias=True)
    assert v4.DeepseekV4MLP(config).gate_proj.bias is not None
    with pytest.raises(ValueError, match=r"mlp_bias \(True\)"):
        MoEConfig.from_hf_config(config)
    with pytest.raises(ValueError, match="mlp_bias"):
        MoEConfig.from_hf_config(config.to_dict())
