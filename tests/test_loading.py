"""Construction without random weights (init="empty" / "meta") and streaming loads from
.safetensors files: only this rank's experts are read, one at a time, and the loaded layer
computes what a layer loaded from the same tensors in memory computes.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from moe import MoEConfig, MoELayer  # noqa: E402
from moe.experts import Experts  # noqa: E402
from moe.loading import SafetensorsState, moe_prefix, moe_state  # noqa: E402
from moe.quant import quantize  # noqa: E402
from parallel.groups import Group  # noqa: E402

H, I, E = 64, 32, 8


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(**{**dict(hidden=H, inter=I, num_experts=E, top_k=2, scoring="sqrt_softplus", swiglu_limit=1.0,
                               shared_swiglu_limit=1.0, expert_format="fp32", dtype=torch.float32), **kw})


def _deepseek_state(seed: int = 0, *, fp4: str | None = None) -> dict[str, torch.Tensor]:
    """One MoE module under DeepSeek names (layers.3.ffn.), experts bf16 or pre-quantized FP4."""
    g = torch.Generator().manual_seed(seed)
    p = moe_prefix(3, "deepseek")
    st = {f"{p}gate.weight": torch.randn(E, H, generator=g) * H ** -0.5, f"{p}gate.bias": torch.randn(E, generator=g) * 0.1}
    for e in range(E):
        for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t = (torch.randn(shape, generator=g) * 0.2).to(torch.bfloat16)
            if fp4 is None:
                st[f"{p}experts.{e}.{w}.weight"] = t
            else:
                q = quantize(t.float(), fp4)
                st[f"{p}experts.{e}.{w}.weight"] = q.data
                st[f"{p}experts.{e}.{w}.scale"] = q.scale
                if q.global_scale is not None:
                    st[f"{p}experts.{e}.{w}.weight_scale_2"] = q.global_scale.reshape(1)
    for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
        st[f"{p}shared_experts.{w}.weight"] = (torch.randn(shape, generator=g) * 0.2).to(torch.bfloat16)
    return st


def _hf_fused(st: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under transformers 5's names (model.layers.3.mlp., fused experts)."""
    src, p = moe_prefix(3, "deepseek"), moe_prefix(3, "hf")
    out = {f"{p}gate.weight": st[f"{src}gate.weight"], f"{p}gate.e_score_correction_bias": st[f"{src}gate.bias"]}
    out[f"{p}experts.gate_up_proj"] = torch.stack([torch.cat([st[f"{src}experts.{e}.w1.weight"],
                                                              st[f"{src}experts.{e}.w3.weight"]]) for e in range(E)])
    out[f"{p}experts.down_proj"] = torch.stack([st[f"{src}experts.{e}.w2.weight"] for e in range(E)])
    for w, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        out[f"{p}shared_experts.{n}.weight"] = st[f"{src}shared_experts.{w}.weight"]
    return out


def _write(tmp_path, st: dict[str, torch.Tensor], shards: int = 2, index: bool = True):
    """st -> `shards` files in tmp_path (+ model.safetensors.index.json)."""
    keys = sorted(st)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        part = {k: st[k].contiguous() for k in keys[i::shards]}
        safetensors_torch.save_file(part, str(tmp_path / name))
        weight_map.update({k: name for k in part})
    if index:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def _ep_group(rank: int, size: int) -> Group:
    return Group(name="ep", group=None, rank=rank, size=size, ranks=tuple(range(size)))


@pytest.mark.parametrize("naming", ["deepseek", "hf"])
def test_safetensors_load_reads_only_this_ranks_experts(tmp_path, naming):
    st = _deepseek_state(0)
    files = _write(tmp_path, st if naming == "deepseek" else _hf_fused(st))
    ref = MoELayer(_cfg(), init="empty")
    ref.load_deepseek(st, prefix=moe_prefix(3, "deepseek"))       # everything, from memory
    for rank in range(2):
        layer = MoELayer(_cfg(), _ep_group(rank, 2), init="meta")
        assert layer.experts.w13.is_meta and layer.shared_experts.w1.weight.is_meta
        reader = layer.load_safetensors(files, moe_prefix(3, naming), naming="auto")
        mine = range(rank * 4, rank * 4 + 4)
        if naming == "deepseek":
            experts_read = {k.split(".")[4] for k in reader.reads if ".experts." in k}
            assert experts_read == {str(e) for e in mine}
            assert len(reader.reads) == len(set(reader.reads)) == 2 + 3 * 4 + 3   # gate, 4 experts, shared
        else:  # one expert's slice of the fused tensors at a time
            sliced = [k for k in reader.reads if "experts." in k and "shared" not in k]
            assert all("[" in k for k in sliced) and len(sliced) == 3 * 4
            experts_read = {idx[0] if isinstance(idx, tuple) else idx for _, idx in reader.slices}
            assert experts_read == set(mine) and len(reader.slices) == 3 * 4
        assert not layer.experts.w13.is_meta and layer.experts.w13.device.type == "cpu"
        torch.testing.assert_close(layer.experts.w13, ref.experts.w13[rank * 4:rank * 4 + 4], rtol=0, atol=0)
        torch.testing.assert_close(layer.experts.w2, ref.experts.w2[rank * 4:rank * 4 + 4], rtol=0, atol=0)
        torch.testing.assert_close(layer.gate.e_score_correction_bias, st["layers.3.ffn.gate.bias"], rtol=0, atol=0)
        for name in ("w1", "w2", "w3"):
            torch.testing.assert_close(getattr(layer.shared_experts, name).weight,
                                       st[f"layers.3.ffn.shared_experts.{name}.weight"].float(), rtol=0, atol=0)


def test_loaded_layer_matches_an_independent_dense_reference(tmp_path):
    """EP = 1, from a single file without an index: y = sum_k w_k FFN_k(x) + shared(x), computed
    here from the raw tensors."""
    st = _deepseek_state(1)
    path = tmp_path / "one.safetensors"
    safetensors_torch.save_file(st, str(path))
    layer = MoELayer(_cfg(), init="empty")
    layer.load_safetensors(path, "layers.3.ffn.")
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(2))
    p = "layers.3.ffn."
    scores = torch.nn.functional.softplus(x @ st[f"{p}gate.weight"].t()).sqrt()
    ids = (scores + st[f"{p}gate.bias"]).topk(2, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True)

    def ffn(x, key):
        g, u = x @ st[f"{key}.w1.weight"].float().t(), x @ st[f"{key}.w3.weight"].float().t()
        h = torch.nn.functional.silu(g.clamp(max=1.0)) * u.clamp(-1.0, 1.0)
        return h @ st[f"{key}.w2.weight"].float().t()

    want = ffn(x, f"{p}shared_experts")
    for t in range(10):
        for k in range(2):
            want[t] += w[t, k] * ffn(x[t:t + 1], f"{p}experts.{int(ids[t, k])}")[0]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_prequantized_fp4_checkpoint_streams_into_fp4_storage(tmp_path, fmt):
    st = _deepseek_state(3, fp4=fmt)
    files = _write(tmp_path, st, shards=3, index=False)              # index from the file headers
    layer = MoELayer(_cfg(expert_format=fmt), _ep_group(1, 2), init="empty")
    layer.load_safetensors(files, "layers.3.ffn.", naming="deepseek")
    ref = MoELayer(_cfg(expert_format=fmt), _ep_group(1, 2), init="random")
    ref.load_deepseek(st, prefix="layers.3.ffn.")
    for a, b in zip(layer.experts.slot_tensors(), ref.experts.slot_tensors()):
        assert torch.equal(a, b)
    # the stored bytes are the checkpoint's own for expert 4 (rank 1's first), w1 half of w13
    assert torch.equal(layer.experts.w13_data[0, :I], st["layers.3.ffn.experts.4.w1.weight"])


def test_bf16_checkpoint_quantized_per_expert_on_load():
    st = _deepseek_state(4)
    layer = MoELayer(_cfg(expert_format="nvfp4"), init="empty")
    layer.load_deepseek(st, prefix="layers.3.ffn.")
    w13 = torch.cat([st["layers.3.ffn.experts.5.w1.weight"], st["layers.3.ffn.experts.5.w3.weight"]]).float()
    q = quantize(w13, "nvfp4")                                      # one global scale per matrix
    assert torch.equal(layer.experts.w13_data[5], q.data) and torch.equal(layer.experts.w13_scale[5], q.scale)
    assert layer.experts.w13_global_scale[5] == q.global_scale


def test_random_init_is_per_expert_and_empty_init_draws_nothing(monkeypatch):
    calls = []
    real = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: calls.append(a) or real(*a, **k))
    Experts(E, H, I, fmt="mxfp4", init="random")
    assert len(calls) == 2 * E and all(len(c) == 2 for c in calls)     # one [2I, H] and one [H, I] per expert
    calls.clear()
    ex = Experts(E, H, I, fmt="mxfp4", init="empty")
    assert not calls and ex.w13_data.shape == (E, 2 * I, H // 2) and ex.w13_scale.shape == (E, 2 * I, H // 32)
    with pytest.raises(ValueError, match="init"):
        Experts(E, H, I, init="zeros")
    with pytest.raises(ValueError, match="init"):
        MoELayer(_cfg(), init="zeros")


def test_v4_flash_shard_builds_without_weights_in_seconds():
    """One rank's V4-Flash shard (32 of 256 MXFP4 experts): meta and empty construction
    allocate nothing random; what empty allocates is exactly the shard's storage."""
    cfg = MoEConfig.deepseek_v4_flash(expert_format="mxfp4")
    t0 = time.perf_counter()
    meta = MoELayer(cfg, _ep_group(3, 8), init="meta")
    empty = MoELayer(cfg, _ep_group(3, 8), init="empty")
    assert time.perf_counter() - t0 < 10.0
    assert all(t.is_meta for t in meta.experts.slot_tensors())
    assert meta.experts.local_experts == list(range(96, 128))
    shard = sum(t.numel() * t.element_size() for t in empty.experts.slot_tensors())
    assert shard == 32 * (2 * 2048 * 4096 // 2 + 2 * 2048 * 4096 // 32 + 4096 * 2048 // 2 + 4096 * 2048 // 32)


def test_deepseek_v3_checkpoint_without_router_bias_loads_it_as_zeros_with_one_warning(tmp_path):
    """A deepseek_v3 checkpoint whose router has no e_score_correction_bias raised KeyError ('missing
    gate.e_score_correction_bias'). HF transformers' DeepseekV3 router registers that buffer as
    zeros and loads such a checkpoint with the bias 0 (reporting the key missing): so here, with
    one warning naming the key in the file. The layer computes what the same checkpoint with an
    explicit zero bias gives. Any other missing tensor is still a KeyError."""
    import warnings

    hf_config = {"model_type": "deepseek_v3", "hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E,
                 "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1}
    cfg = MoEConfig.from_hf_config(hf_config, expert_format="fp32", dtype=torch.float32)
    assert cfg.use_bias
    p = moe_prefix(3, "hf")
    st = _hf_fused(_deepseek_state(11))
    no_bias = {k: v for k, v in st.items() if k != f"{p}gate.e_score_correction_bias"}
    zero_bias = {**no_bias, f"{p}gate.e_score_correction_bias": torch.zeros(E)}
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(12))
    (tmp_path / "zero").mkdir()
    (tmp_path / "none").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = MoELayer(cfg, init="meta")
        ref.load_safetensors(_write(tmp_path / "zero", zero_bias), p)
    assert not [w for w in caught if "bias" in str(w.message)]
    layer = MoELayer(cfg, init="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer.load_safetensors(_write(tmp_path / "none", no_bias), p)
    msgs = [str(w.message) for w in caught if "bias" in str(w.message)]
    assert len(msgs) == 1 and f"{p}gate.e_score_correction_bias" in msgs[0], msgs
    assert torch.equal(layer.gate.e_score_correction_bias, torch.zeros(E))
    with torch.no_grad():
        assert torch.equal(layer(x), ref(x))
    # DeepSeek names: the warning names both of the router bias' names; in-memory states load the same
    ds = {k: v for k, v in _deepseek_state(11).items() if k != "layers.3.ffn.gate.bias"}
    mem = MoELayer(cfg, init="empty")
    with pytest.warns(UserWarning, match=r"layers\.3\.ffn\.gate\.e_score_correction_bias / layers\.3\.ffn\.gate\.bias"):
        mem.load_deepseek(ds, prefix="layers.3.ffn.")
    with torch.no_grad():
        assert torch.equal(mem(x), ref(x))
    # the router weight (or anything but the bias) missing is still an error, before anything is written
    del no_bias[f"{p}gate.weight"]
    with pytest.raises(KeyError, match="missing gate.weight"):
        MoELayer(cfg, init="meta").load_deepseek(moe_state(no_bias, p))


def test_naming_errors_and_lazy_views():
    st = _deepseek_state(5)
    with pytest.raises(ValueError, match="naming"):
        moe_state(st, "layers.3.ffn.", naming="megatron")
    view = moe_state(st, "layers.3.ffn.")
    assert "experts.2.w1.weight" in view and "experts.99.w1.weight" not in view
    layer = MoELayer(_cfg(), init="empty")
    del st["layers.3.ffn.experts.6.w3.weight"]
    with pytest.raises(KeyError, match="experts.6.w3.weight"):
        layer.load_deepseek(st, prefix="layers.3.ffn.")
    with pytest.raises(ValueError, match="not found"):
        SafetensorsState(["/nonexistent/x.safetensors"])


@pytest.mark.gpu
def test_gpu_v4_flash_shard_loads_in_seconds_with_little_host_memory(tmp_path):
    """One rank's V4-Flash shard (32 MXFP4 experts, DeepSeek names, one file per expert; the other
    ranks' experts are absent, so reading one fails) builds and loads on one GPU in seconds, with
    host memory growing by less than twice the shard; random init on the GPU is quick too."""
    import resource

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = MoEConfig.deepseek_v4_flash(expert_format="mxfp4")
    h, inter, p = cfg.hidden, cfg.inter, "layers.3.ffn."
    g = torch.Generator().manual_seed(0)
    shard = 0
    for e in range(32):
        part = {}
        for w, (n, k) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
            part[f"{p}experts.{e}.{w}.weight"] = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
            part[f"{p}experts.{e}.{w}.scale"] = torch.randint(118, 124, (n, k // 32), generator=g, dtype=torch.uint8)
        shard += sum(t.numel() for t in part.values())
        safetensors_torch.save_file(part, str(tmp_path / f"expert-{e:03d}.safetensors"))
        del part
    dense = {f"{p}gate.weight": torch.randn(256, h) * 0.01, f"{p}gate.bias": torch.zeros(256),
             **{f"{p}shared_experts.{w}.weight": torch.randn(s, dtype=torch.bfloat16) * 0.01
                for w, s in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter)))}}
    safetensors_torch.save_file(dense, str(tmp_path / "dense.safetensors"))
    del dense
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    layer = MoELayer(cfg, _ep_group(0, 8), device="cuda", init="empty")
    layer.load_safetensors(tmp_path, p)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    assert took < 20.0, took
    assert grew < 2 * shard, (grew, shard)
    assert torch.equal(layer.experts.w2_data[7].cpu(),
                       SafetensorsState(tmp_path / "expert-007.safetensors")[f"{p}experts.7.w2.weight"])
    t0 = time.perf_counter()
    MoELayer(cfg, _ep_group(0, 8), device="cuda")                    # random weights, made on the GPU
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 20.0


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _quantized_expert(shape, kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale, the values they hold in fp32 by plain torch) of one random checkpoint matrix:
    "fp8": e4m3 + fp32 scales of 128 x 128 tiles (DeepSeek V3 / transformers' weight_scale_inv);
    "fp4": packed e2m1 (low nibble first) + E8M0 scales of 32 columns (DeepSeek V4's experts)."""
    n, k = shape
    if kind == "fp8":
        data = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        return data, scale, data.float() * full
    data = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(115, 130, (n, k // 32), generator=g, dtype=torch.uint8)
    vals = torch.stack([_E2M1[(data & 15).long()], _E2M1[(data >> 4).long()]], dim=-1).reshape(n, k)
    return data.view(torch.int8), scale.view(torch.float8_e8m0fnu), vals * (scale.float() - 127).exp2().repeat_interleave(32, 1)


def _hf_fused_quantized(kind: str, h: int, inter: int, e_: int, seed: int):
    """A quantized HF MoE module's names as transformers 5 holds them (its FP8Experts, fused):
    experts.gate_up_proj [E, 2I, .] + gate_up_proj_scale_inv (each expert's gate then up scales),
    experts.down_proj + down_proj_scale_inv; and the fp32 values of each expert's w1 / w3 / w2."""
    g = torch.Generator().manual_seed(seed)
    p = moe_prefix(3, "hf")
    st = {f"{p}gate.weight": torch.randn(e_, h, generator=g) * h ** -0.5,
          f"{p}gate.e_score_correction_bias": torch.randn(e_, generator=g) * 0.1}
    want: dict[tuple[int, str], torch.Tensor] = {}
    parts: dict[str, list] = {"gate_up": [], "gate_up_s": [], "down": [], "down_s": []}
    for e in range(e_):
        (d1, s1, v1), (d3, s3, v3), (d2, s2, v2) = (_quantized_expert(s, kind, g)
                                                    for s in ((inter, h), (inter, h), (h, inter)))
        want[e, "w1"], want[e, "w3"], want[e, "w2"] = v1, v3, v2
        parts["gate_up"].append(torch.cat([d1, d3]))
        parts["gate_up_s"].append(torch.cat([s1, s3]))
        parts["down"].append(d2)
        parts["down_s"].append(s2)
    for name, key in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        st[f"{p}experts.{key}"] = torch.stack(parts[name])
        st[f"{p}experts.{key}_scale_inv"] = torch.stack(parts[f"{name}_s"])
    for n, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        st[f"{p}shared_experts.{n}.weight"] = (torch.randn(shape, generator=g) * 0.2).to(torch.bfloat16)
    return st, want


@pytest.mark.parametrize("kind,fmt", [("fp8", "fp8_block"), ("fp8", "fp32"), ("fp4", "mxfp4"), ("fp4", "fp32")])
def test_hf_fused_quantized_experts_load_with_their_scale_inv(tmp_path, kind, fmt):
    """transformers 5 keeps a quantized DeepSeek model's experts fused with `*_scale_inv` beside
    them (V3's FP8 as the hub has it, V4's FP4 experts); reading those names raised KeyError
    ('experts.0.w1.weight_scale_inv'). Each rank reads its experts' slices of weight and scale."""
    h, inter, e_ = (256, 128, 4) if kind == "fp8" else (64, 32, 4)
    st, want = _hf_fused_quantized(kind, h, inter, e_, seed=7)
    files = _write(tmp_path, st)
    for rank in range(2):
        layer = MoELayer(_cfg(hidden=h, inter=inter, num_experts=e_, expert_format=fmt), _ep_group(rank, 2),
                         init="meta")
        reader = layer.load_safetensors(files, moe_prefix(3, "hf"))
        assert {idx[0] if isinstance(idx, tuple) else idx for _, idx in reader.slices} == {2 * rank, 2 * rank + 1}
        w13, w2 = layer.experts.dequantized(torch.float32)
        for slot, e in enumerate((2 * rank, 2 * rank + 1)):
            torch.testing.assert_close(w13[slot, :inter], want[e, "w1"], rtol=0, atol=0)
            torch.testing.assert_close(w13[slot, inter:], want[e, "w3"], rtol=0, atol=0)
            torch.testing.assert_close(w2[slot], want[e, "w2"], rtol=0, atol=0)


def test_hf_fused_fp8_scale_whose_tile_spans_gate_and_up_is_refused():
    """I = 64: a 128-row FP8 tile of the fused gate_up scale would hold gate and up rows, so which
    rows are which cannot be told from the shapes: ValueError naming the row counts."""
    st, _ = _hf_fused_quantized("fp8", 128, 64, 2, seed=8)
    with pytest.raises(ValueError, match=r"gate_up_proj_scale_inv has 2 rows per expert for the 128"):
        moe_state(st, moe_prefix(3, "hf"))["experts.0.w1.weight_scale_inv"]


def test_hf_fused_expert_past_the_tensors_is_absent_and_an_odd_row_count_refused():
    """An expert past the fused tensors' first dimension read as present (`in` said True) and then
    raised IndexError; it is absent, a KeyError naming it, as a missing per-expert key is. A fused
    gate_up_proj of an odd row count was split at floor(rows / 2), its last row dropped silently."""
    p = moe_prefix(3, "hf")
    g = torch.Generator().manual_seed(9)
    st = {f"{p}experts.gate_up_proj": torch.randn(2, 2 * I, H, generator=g),
          f"{p}experts.down_proj": torch.randn(2, H, I, generator=g)}
    view = moe_state(st, p)
    assert torch.equal(view["experts.1.w3.weight"], st[f"{p}experts.gate_up_proj"][1, I:])
    assert "experts.1.w2.weight" in view and "experts.2.w1.weight" not in view and "experts.2.w2.weight" not in view
    with pytest.raises(KeyError, match="experts.2.w3.weight"):
        view["experts.2.w3.weight"]
    # a layer of E experts over fused tensors of 2: refused before any slot is written (the up-front
    # key check believed `in`; experts 0 and 1 were written, then expert 2 raised IndexError)
    full = {**_hf_fused(_deepseek_state(10)), **st}
    layer = MoELayer(_cfg(), init="random")
    before = layer.experts.w13.detach().clone()
    with pytest.raises(KeyError, match="experts.2.w1.weight"):
        layer.load_deepseek(moe_state(full, p))
    assert torch.equal(layer.experts.w13, before)
    st[f"{p}experts.gate_up_proj"] = torch.randn(2, 2 * I + 1, H, generator=g)
    with pytest.raises(ValueError, match=f"{2 * I + 1} rows per expert"):
        moe_state(st, p)["experts.0.w1.weight"]


@pytest.mark.parametrize("naming", ["deepseek", "hf_per_expert", "safetensors"])
def test_experts_stored_unlike_each_other_are_refused_before_any_write(tmp_path, naming):
    """A checkpoint whose experts differ among themselves (a later expert's w2 of another shape, a
    scale one expert lacks) loaded expert 0, 1, ... into their slots and failed at the odd one,
    leaving the layer half-written. Now a ValueError names both experts' keys first (stored shapes
    only: the lazy reader reads no tensor data for it) and the layer is untouched."""
    p = moe_prefix(3, "deepseek")
    cases = []
    st = _deepseek_state(21)
    st[f"{p}experts.5.w2.weight"] = torch.randn(H, I + 2).to(torch.bfloat16)
    cases.append((st, r"experts\.5\.(w2|down_proj)\.weight of shape \[64, 34\].*experts\.0\.(w2|down_proj)\.weight "
                      r"of shape \[64, 32\]", "fp32"))
    st = _deepseek_state(22, fp4="mxfp4")
    del st[f"{p}experts.6.w3.scale"]
    st[f"{p}experts.6.w3.weight_scale"] = torch.zeros(1, dtype=torch.uint8)      # (not the scale's shape)
    cases.append((st, r"experts\.6\.w3\.(weight_)?scale (absent|of shape \[1\]).*experts\.0\.w3\.(weight_)?scale "
                      r"(absent|of shape)", "mxfp4"))
    for i, (state, match, fmt) in enumerate(cases):
        if naming != "deepseek" and fmt != "fp32":
            continue
        if naming == "hf_per_expert":
            hp = moe_prefix(3, "hf")
            names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
            src = {k[len(p):]: v for k, v in state.items()}
            state = {f"{hp}gate.weight": src["gate.weight"], f"{hp}gate.e_score_correction_bias": src["gate.bias"]}
            for k, v in src.items():
                parts = k.split(".")
                if parts[0] in ("experts", "shared_experts"):
                    parts[-2] = names[parts[-2]]
                    state[hp + ".".join(parts)] = v
            prefix = hp
        else:
            prefix = p
        layer = MoELayer(_cfg(expert_format=fmt), init="random")
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(ValueError, match="the experts differ: .*" + match):
            if naming == "safetensors":
                (tmp_path / str(i)).mkdir()
                reader = SafetensorsState(_write(tmp_path / str(i), state))
                layer.load_deepseek(moe_state(reader, prefix))
            else:
                layer.load_deepseek(moe_state(state, prefix))
        if naming == "safetensors":
            assert not any(".experts.5." in k or ".experts.6." in k for k in reader.reads), reader.reads
        after = layer.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_router_bias_the_config_does_not_use_is_refused():
    """A checkpoint's router bias under a config without one (use_bias False) was dropped silently:
    the layer routed unlike the checkpoint's model. Now a ValueError names the key, before any write."""
    st = _deepseek_state(23)
    layer = MoELayer(_cfg(use_bias=False), init="random")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=r"layers\.3\.ffn\.gate\.bias, a router bias; this layer's config has none"):
        layer.load_deepseek(st, prefix="layers.3.ffn.")
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    hf = _hf_fused(st)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.gate\.e_score_correction_bias, a router bias"):
        MoELayer(_cfg(use_bias=False), init="random").load_deepseek(moe_state(hf, moe_prefix(3, "hf")))
