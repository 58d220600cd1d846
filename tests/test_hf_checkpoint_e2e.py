"""End to end: a tiny HF transformers DeepSeek model with random weights is written to disk by
`save_pretrained` (safetensors, the layout transformers itself writes), its MoE layer is read
back through the project's public loaders (`MoEConfig.from_hf_config(AutoConfig...)`,
`MoELayer.load_safetensors`) and the layer's output is compared with the MoE block of the HF
model that `from_pretrained` builds from the same files (so the reference is what HF computes
from the checkpoint, not from the in-memory module).

What transformers 5.25 writes (checked here, not assumed): DeepSeek V3 / V3.2 keep their experts
fused in memory (`experts.gate_up_proj` [E, 2I, H], gate rows then up rows; `down_proj`
[E, H, I]) but `save_pretrained` reverts them to the hub's per-expert names
(`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`); DeepSeek V4 is written under
DeepSeek's own names below `model.` (`model.layers.{i}.ffn.experts.{e}.w1.weight`,
`gate.bias`, `gate.tid2eid`, `shared_experts.w1`), which the loader reads with
`naming="deepseek"` (or "auto") and `prefix="model.layers.{i}.ffn."`. The fused in-memory
layout is covered by loading the HF module's own `state_dict` written to a file as it is.

Cases: group-limited routing variants (n_group / topk_group, n_group 1), norm_topk_prob False,
routed_scaling_factor != 1, two shared experts (one MLP twice as wide), V3.2, V4 hash and top-k
layers, bf16 checkpoints (loose), a checkpoint without the router bias (HF and the project both
load zeros), extra keys (ignored as HF ignores unexpected keys), wrong shapes (ValueError with
the key and both shapes, nothing written).
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from moe import MoEConfig, MoELayer  # noqa: E402
from moe.loading import SafetensorsState, find_moe_prefix, moe_prefix  # noqa: E402

H, I, E, K, VOCAB, T = 32, 16, 8, 2, 64, 40

_ATTN = dict(num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=8, intermediate_size=48)


def _v3_config(model_type: str = "deepseek_v3", **kw):
    cls = transformers.DeepseekV32Config if model_type == "deepseek_v32" else transformers.DeepseekV3Config
    extra = dict(index_n_heads=2, index_head_dim=16, index_topk=4) if model_type == "deepseek_v32" else {}
    return cls(**{**_ATTN, **extra, **dict(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, num_hidden_layers=2, first_k_dense_replace=1,
        vocab_size=VOCAB), **kw})


def _v4_config(**kw):
    return transformers.DeepseekV4Config(**{**dict(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, vocab_size=VOCAB,
        num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"], swiglu_limit=0.5, routed_scaling_factor=1.5,
        num_attention_heads=2, hc_mult=2), **kw})


def _randomize_moe(mlp: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Weights far from HF's init (std 0.02, zero bias) so routing, groups and clamps all matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*mlp.named_parameters(), *mlp.named_buffers()]:
            if name.endswith("tid2eid"):  # distinct experts per token
                t.copy_(torch.stack([torch.randperm(E, generator=g)[: t.shape[1]] for _ in range(t.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * std)


def _saved(tmp_path, config, seed: int, dtype=torch.float32, moe_layers=(1,)):
    """A tiny HF CausalLM with random MoE weights, saved; -> (dir, the HF model from_pretrained reads)."""
    cls = {"deepseek_v3": transformers.DeepseekV3ForCausalLM, "deepseek_v32": transformers.DeepseekV32ForCausalLM,
           "deepseek_v4": transformers.DeepseekV4ForCausalLM}[config.model_type]
    torch.manual_seed(seed)
    model = cls(config)
    for i in moe_layers:
        _randomize_moe(model.model.layers[i].mlp, seed + i)
    model.to(dtype).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tmp_path, cls.from_pretrained(tmp_path, dtype=dtype).eval()


def _file_keys(path) -> list[str]:
    return sorted(SafetensorsState(path))


def _project(path, layer_idx: int, moe_index: int, prefix: str, dtype=torch.float32, fmt="fp32", **over) -> MoELayer:
    """The project's layer for decoder layer `layer_idx` (MoE layer `moe_index`) from the saved dir."""
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    cfg = MoEConfig.from_hf_config(hf_cfg, dtype=dtype, expert_format=fmt, **over).for_layer(moe_index)
    layer = MoELayer(cfg, init="meta")
    layer.load_safetensors(path, prefix)
    return layer


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, H, generator=g).to(dtype), torch.randint(0, VOCAB, (1, T), generator=g)


# ---- DeepSeek V3 / V3.2 through save_pretrained (per-expert files) -------------------------------

V3_VARIANTS = {
    "groups4_keep2": {},
    "groups2_keep1": dict(n_group=2, topk_group=1),
    "groups8_keep8": dict(n_group=8, topk_group=8, n_routed_experts=16, num_experts_per_tok=4),
    "one_group": dict(n_group=1, topk_group=1),
    "no_norm_scale1.7": dict(norm_topk_prob=False, routed_scaling_factor=1.7),
    "norm_scale1": dict(routed_scaling_factor=1.0),
    "two_shared_k3": dict(n_shared_experts=2, num_experts_per_tok=3),
    # HF multiplies the weights by 0 (the routed experts drop out); from_hf_config read 0 as 1
    "scale0": dict(routed_scaling_factor=0.0),
}


@pytest.mark.parametrize("variant", list(V3_VARIANTS))
def test_v3_save_pretrained_checkpoint_matches_hf(tmp_path, variant):
    config = _v3_config(**V3_VARIANTS[variant])
    path, hf = _saved(tmp_path, config, seed=len(variant))
    keys = _file_keys(path)
    # transformers writes the hub's per-expert names, not its in-memory fused tensors
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    layer = _project(path, 1, 0, moe_prefix(1, "hf"))
    cfg, hcfg = layer.config, hf.config
    assert (cfg.n_group or 1, cfg.renormalize, cfg.routed_scaling, cfg.num_shared * cfg.shared_inter) == \
        (hcfg.n_group, hcfg.norm_topk_prob, hcfg.routed_scaling_factor, hcfg.n_shared_experts * I)
    x, _ = _inputs(1)
    with torch.no_grad():
        want = hf.model.layers[1].mlp(x)[0]
        got = layer(x[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_v32_save_pretrained_checkpoint_matches_hf(tmp_path):
    path, hf = _saved(tmp_path, _v3_config("deepseek_v32", norm_topk_prob=False), seed=21)
    layer = _project(path, 1, 0, moe_prefix(1, "hf"))
    x, _ = _inputs(22)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0]), hf.model.layers[1].mlp(x)[0], rtol=1e-5, atol=1e-5)


def test_v3_fused_state_dict_file_matches_hf_and_the_per_expert_file(tmp_path):
    """The in-memory (fused) state dict written as it is, beside the save_pretrained (per-expert)
    files of the same model: both load to the same layer, which computes what HF computes."""
    config = _v3_config(n_group=2, topk_group=1, routed_scaling_factor=0.7)
    path, hf = _saved(tmp_path / "hub", config, seed=31)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items() if ".mlp." in k}
    gu = fused["model.layers.1.mlp.experts.gate_up_proj"]
    assert gu.shape == (E, 2 * I, H)
    # gate rows first: HF's expert computes act(x @ gate_up[:I].T) * (x @ gate_up[I:].T)
    per_expert = SafetensorsState(path)
    assert torch.equal(gu[3, :I], per_expert["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(gu[3, I:], per_expert["model.layers.1.mlp.experts.3.up_proj.weight"])
    (tmp_path / "fused").mkdir()
    safetensors_torch.save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    a = _project(path, 1, 0, moe_prefix(1, "hf"))
    cfg = a.config
    b = MoELayer(cfg, init="meta")
    reader = b.load_safetensors(tmp_path / "fused", moe_prefix(1, "hf"))
    assert reader.slices  # read a slice of the fused tensors per expert
    assert torch.equal(a.experts.w13, b.experts.w13) and torch.equal(a.experts.w2, b.experts.w2)
    x, _ = _inputs(32)
    with torch.no_grad():
        want = hf.model.layers[1].mlp(x)[0]
        torch.testing.assert_close(b(x[0]), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(a(x[0]), b(x[0]))


# ---- DeepSeek V4 through save_pretrained (DeepSeek names under model.) ---------------------------

@pytest.mark.parametrize("norm_topk_prob,scoring", [(True, "sqrtsoftplus"), (False, "sqrtsoftplus"), (True, "sigmoid")])
def test_v4_save_pretrained_checkpoint_matches_hf_hash_and_topk_layers(tmp_path, norm_topk_prob, scoring):
    config = _v4_config(norm_topk_prob=norm_topk_prob, scoring_func=scoring)
    path, hf = _saved(tmp_path, config, seed=41, moe_layers=(0, 1))
    keys = _file_keys(path)
    # transformers writes V4 under DeepSeek's names, below "model."
    assert {"model.layers.0.ffn.gate.tid2eid", "model.layers.1.ffn.gate.bias",
            "model.layers.1.ffn.experts.0.w1.weight", "model.layers.1.ffn.shared_experts.w3.weight"} <= set(keys)
    assert not any(".mlp." in k for k in keys)
    x, ids = _inputs(42)
    for i in (0, 1):
        assert find_moe_prefix(SafetensorsState(path), i) == f"model.layers.{i}.ffn."
        layer = _project(path, i, i, f"model.{moe_prefix(i, 'deepseek')}")
        assert layer.config.hash_layer == (i == 0)
        with torch.no_grad():
            want = hf.model.layers[i].mlp(x, input_ids=ids)[0]
            got = layer(x[0], input_ids=ids[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if i == 0:
            assert torch.equal(layer.gate.tid2eid.long(), hf.model.layers[0].mlp.gate.tid2eid)


def test_v4_fused_state_dict_file_matches_hf(tmp_path):
    config = _v4_config()
    path, hf = _saved(tmp_path / "hub", config, seed=51, moe_layers=(0, 1))
    fused = {k: v.contiguous() for k, v in hf.state_dict().items() if ".mlp." in k}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    (tmp_path / "fused").mkdir()
    safetensors_torch.save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    x, ids = _inputs(52)
    for i in (0, 1):
        cfg = MoEConfig.from_hf_config(transformers.AutoConfig.from_pretrained(path), dtype=torch.float32,
                                       expert_format="fp32").for_layer(i)
        layer = MoELayer(cfg, init="meta")
        layer.load_safetensors(tmp_path / "fused", moe_prefix(i, "hf"), naming="hf")
        with torch.no_grad():
            torch.testing.assert_close(layer(x[0], input_ids=ids[0]), hf.model.layers[i].mlp(x, input_ids=ids)[0],
                                       rtol=1e-5, atol=1e-5)


# ---- bf16 checkpoints (loose) --------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_v3_bf16_checkpoint_matches_hf_bf16(tmp_path):
    """bf16 files, bf16 layer and HF model: HF's V3 router takes the product in fp32, as the
    project does, so both route the same; the outputs differ by bf16 rounding only (both stay
    as close to the fp32 computation on the same bf16 weights)."""
    path, hf = _saved(tmp_path, _v3_config(), seed=61, dtype=torch.bfloat16)
    assert SafetensorsState(path)["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    layer = _project(path, 1, 0, moe_prefix(1, "hf"), dtype=torch.bfloat16, fmt="bf16")
    ref32 = _project(path, 1, 0, moe_prefix(1, "hf"))        # the same bf16 weights, fp32 math
    x, _ = _inputs(62, torch.bfloat16)
    mlp = hf.model.layers[1].mlp
    with torch.no_grad():
        want, got, exact = mlp(x)[0], layer(x[0]), ref32(x[0].float())
        _, _, hf_ids = mlp.gate(x)
        assert torch.equal(layer.gate(x[0]).topk_ids.sort(-1).values, hf_ids.sort(-1).values)
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2
    assert _rel(got, exact) < 1e-2 and _rel(want, exact) < 1e-2


def test_v4_bf16_checkpoint_matches_hf_bf16_loosely(tmp_path):
    """HF's V4 routers compute the logits in the weights' dtype (bf16 here); the project's router
    keeps fp32 logits (as DeepSeek's inference code does). Both are compared with the fp32 math on
    the same bf16 weights: the project is at least as close as HF's own bf16 forward."""
    path, hf = _saved(tmp_path, _v4_config(), seed=71, dtype=torch.bfloat16, moe_layers=(0, 1))
    x, ids = _inputs(72, torch.bfloat16)
    for i in (0, 1):
        prefix = f"model.{moe_prefix(i, 'deepseek')}"
        layer = _project(path, i, i, prefix, dtype=torch.bfloat16, fmt="bf16")
        exact = _project(path, i, i, prefix)
        with torch.no_grad():
            want, got = hf.model.layers[i].mlp(x, input_ids=ids)[0], layer(x[0], input_ids=ids[0])
            ref = exact(x[0].float(), input_ids=ids[0])
        assert _rel(got, want) < 5e-2
        assert _rel(got, ref) < 1e-2 and _rel(got, ref) <= _rel(want, ref) + 2e-3


# ---- optional / extra / wrong tensors --------------------------------------------------------------

def _rewrite(src, dst, edit) -> None:
    """dst: src's files with `edit(dict)` applied (config copied)."""
    dst.mkdir()
    st = dict(safetensors_torch.load_file(str(src / "model.safetensors")))
    edit(st)
    safetensors_torch.save_file(st, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_v3_checkpoint_without_router_bias_loads_zeros_as_hf_does(tmp_path):
    """A V3 checkpoint with no e_score_correction_bias: HF's from_pretrained keeps its zero buffer
    (and reports the key missing); the project loads zeros with one warning naming the key. Both
    then compute the same."""
    path, _ = _saved(tmp_path / "full", _v3_config(), seed=81)
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    _rewrite(path, tmp_path / "nobias", lambda st: st.pop(key))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "nobias").eval()
    assert torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, torch.zeros(E))
    with pytest.warns(UserWarning, match=key.replace(".", r"\.")):
        layer = _project(tmp_path / "nobias", 1, 0, moe_prefix(1, "hf"))
    x, _ = _inputs(82)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0]), hf.model.layers[1].mlp(x)[0], rtol=1e-5, atol=1e-5)


def test_extra_keys_are_ignored_as_hf_ignores_unexpected_keys(tmp_path):
    """Keys the layer does not read (another layer's, an expert past n_routed_experts, an unknown
    tensor under the module) are not looked up: the layer loads as without them, as HF's
    from_pretrained loads the model and reports them unexpected."""
    path, hf = _saved(tmp_path / "full", _v3_config(), seed=91)
    p = moe_prefix(1, "hf")

    def extra(st):
        st[f"{p}experts.{E}.gate_proj.weight"] = torch.randn(I, H)
        st[f"{p}gate.unknown_buffer"] = torch.randn(3)
        st[f"{p}experts.0.gate_proj.extra_scale"] = torch.randn(1)
        st["model.layers.7.mlp.gate.weight"] = torch.randn(E + 1, H)

    _rewrite(path, tmp_path / "extra", extra)
    layer = _project(tmp_path / "extra", 1, 0, p)
    x, _ = _inputs(92)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0]), hf.model.layers[1].mlp(x)[0], rtol=1e-5, atol=1e-5)


def _params(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


WRONG = {
    # key edited -> (new shape, regex the ValueError must match)
    "gate.weight": ((E, H + 2), r"gate\.weight has shape \(8, 34\); expected \(8, 32\)"),
    "gate.e_score_correction_bias": ((E + 1,), r"gate\.e_score_correction_bias has shape \(9,\); expected \(8,\)"),
    # (the routed / shared experts' messages name the key under DeepSeek's names, w1 / w3 / w2)
    "shared_experts.up_proj.weight": ((I + 1, H), r"shared_experts\.(w3|up_proj)\.weight has shape \(17, 32\); "
                                                  r"expected \(16, 32\)"),
    "experts.0.down_proj.weight": ((H, I + 2), r"experts\.0\.(w2|down_proj)\.weight has logical shape \(32, 18\); "
                                               r"expected \(32, 16\)"),
    # (a fused tensor: named as in the file, with the expert's DeepSeek name it was read as)
    "experts.gate_up_proj": ((E, 2 * I + 4, H), r"experts\.gate_up_proj has logical shape \(18, 32\); "
                                                r"expected \(16, 32\) \(.*read as experts\.0\.w1\.weight\)"),
}


@pytest.mark.parametrize("key", list(WRONG))
def test_wrong_shapes_raise_naming_the_key_and_both_shapes_before_anything_is_written(tmp_path, key):
    config = _v3_config()
    path, hf = _saved(tmp_path / "full", config, seed=101)
    p = moe_prefix(1, "hf")
    shape, match = WRONG[key]
    if key == "experts.gate_up_proj":   # a fused file (the in-memory layout) of another inter
        fused = {k: v.contiguous() for k, v in hf.state_dict().items() if k.startswith(p)}
        fused[p + key] = torch.randn(shape)
        (tmp_path / "bad").mkdir()
        safetensors_torch.save_file(fused, str(tmp_path / "bad" / "model.safetensors"))
    else:
        _rewrite(path, tmp_path / "bad", lambda st: st.__setitem__(p + key, torch.randn(shape)))
    cfg = MoEConfig.from_hf_config(transformers.AutoConfig.from_pretrained(path), dtype=torch.float32,
                                   expert_format="fp32")
    layer = MoELayer(cfg, init="random")
    before = _params(layer)
    with pytest.raises(ValueError, match=match):
        layer.load_safetensors(tmp_path / "bad", p)
    after = _params(layer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_v4_checkpoint_config_json_round_trip(tmp_path):
    """The saved config.json (a dict, not the config object) gives the same MoEConfig."""
    config = _v4_config(routed_scaling_factor=2.0)
    path, _ = _saved(tmp_path, config, seed=111, moe_layers=(0, 1))
    d = json.loads((path / "config.json").read_text())
    assert MoEConfig.from_hf_config(d) == MoEConfig.from_hf_config(transformers.AutoConfig.from_pretrained(path))
    assert MoEConfig.from_hf_config(d) == MoEConfig.from_hf_config(config)


def test_find_moe_prefix_tells_the_three_layouts_apart(tmp_path):
    v3_path, _ = _saved(tmp_path / "v3", _v3_config(), seed=121)
    assert find_moe_prefix(SafetensorsState(v3_path), 1) == "model.layers.1.mlp."
    with pytest.raises(ValueError, match="no MoE router .* for layer 0"):   # (layer 0 is dense)
        find_moe_prefix(SafetensorsState(v3_path), 0)
    ds = {"layers.3.ffn.gate.weight": torch.zeros(1)}
    assert find_moe_prefix(ds, 3) == "layers.3.ffn."
    with pytest.raises(ValueError, match="more than one"):
        find_moe_prefix({**ds, "model.layers.3.mlp.gate.weight": torch.zeros(1)}, 3)


def test_router_tensors_the_config_does_not_use_are_refused(tmp_path):
    path, _ = _saved(tmp_path, _v4_config(), seed=131, moe_layers=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"model\.layers\.0\.ffn\.gate\.tid2eid, a hash-routed layer's table"):
            _project(path, 0, 1, "model.layers.0.ffn.")   # a hash layer's tensors, a top-k layer's config
