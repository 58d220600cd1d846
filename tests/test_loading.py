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
