"""The host work an eager decode call keeps between calls (`impl.Memo`): the kernel choice per call
shape and the backend per facts, forgotten whenever CONFIG changes (`impl.Settings`)."""

from __future__ import annotations

import pytest
import torch

from megapar.parallel import impl
from megapar.parallel.cp import triton_decode as td
from megapar.parallel.cp.dcp import PagedKVCache
from megapar.parallel.cp.paged import paged_decode_attention, resolve_backend
from tests.helpers import check_state, mla_paged_cache


def test_settings_bump_their_version_on_every_change():
    s = impl.Settings({"a": 1, "b": 2})
    seen = [s.version]

    def changed():
        assert s.version != seen[-1]
        seen.append(s.version)

    s["a"] = 3; changed()                              # noqa: E702
    s.update(b=4); changed()                           # noqa: E702
    s |= {"c": 5}; changed()                           # noqa: E702
    del s["c"]; changed()                              # noqa: E702
    assert s.pop("b") == 4; changed()                  # noqa: E702
    s.setdefault("d", 6); changed()                    # noqa: E702
    s.popitem(); changed()                             # noqa: E702
    s.clear(); changed()                               # noqa: E702
    assert s == {} and isinstance(td.CONFIG, impl.Settings)
    assert dict(td.CONFIG) == td.CONFIG                # (a plain copy for saving and restoring)


def test_memo_keeps_by_key_and_stays_bounded():
    m = impl.Memo(size=3)
    made = []
    make = lambda v: (lambda: made.append(v) or v)    # noqa: E731
    assert [m.get(k, make(k)) for k in (1, 2, 1, 2)] == [1, 2, 1, 2] and made == [1, 2]
    for k in (3, 4, 5):
        m.get(k, make(k))
    assert len(m.table) <= 3
    impl.clear_memos()
    assert m.table == {}


def _latent(dtype, page=64, nb=6):
    k = torch.randn(nb, page, 1, 576).to(dtype)
    scale = torch.rand(nb, page, 1) + 0.5 if dtype == torch.float8_e4m3fn else None
    return k, k[..., :512], scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kernel_choice_is_kept_per_call_shape_and_forgotten_on_a_config_change(monkeypatch, dtype):
    made = []
    real = td._choose_now
    monkeypatch.setattr(td, "_choose_now", lambda *a: made.append(1) or real(*a))
    k, v, scale = _latent(dtype)
    gen = torch.Generator().manual_seed(3)
    for heads, tq in ((16, 1), (128, 1), (16, 2)):
        q = torch.randn(4, tq, heads, 576, generator=gen).to(torch.bfloat16)
        first = td._choose(q, k, v, scale, scale)
        again = td._choose(torch.randn_like(q.float()).to(torch.bfloat16), k, v, scale, scale)
        assert again is first and first == real(q, k, v, scale, scale)
    assert len(made) == 3
    # a change of CONFIG, of q's layout, of the value view or of the scales is another choice
    q = torch.randn(4, 1, 16, 576).to(torch.bfloat16)
    base = td._choose(q, k, v, scale, scale)
    n = len(made)
    monkeypatch.setitem(td.CONFIG, "target_programs", td.CONFIG["target_programs"] + 1)
    changed = td._choose(q, k, v, scale, scale)
    assert len(made) == n + 1 and changed == real(q, k, v, scale, scale) and changed is not base
    td._choose(torch.cat([q, q], -1)[..., :576], k, v, scale, scale)      # (q not contiguous)
    v_apart = v.clone()
    td._choose(q, k, v_apart, scale, scale)
    assert len(made) == n + 3
    if scale is not None:
        td._choose(q, k, v, scale, scale.clone())        # (keys' and values' scales no longer one tensor)
        assert len(made) == n + 4


def test_backend_resolution_is_kept_but_a_refusal_raises_every_time(monkeypatch):
    cache = PagedKVCache.allocate(4, 16, 2, 32, dtype=torch.float32, device="cpu")
    q = torch.randn(3, 4, 32)
    asked = []
    real = td_resolve = resolve_backend.__globals__["DECODE"].resolve
    monkeypatch.setattr(resolve_backend.__globals__["DECODE"], "resolve",
                        lambda *a, **kw: asked.append(1) or td_resolve(*a, **kw))
    assert resolve_backend(q, cache) == resolve_backend(q, cache) == real("auto", device=q.device, dtype=q.dtype,
                                                                          cache_dtype=cache.k.dtype, head_dim=32,
                                                                          v_head_dim=32, kv_strides=None)
    assert len(asked) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for _ in range(2):
        with pytest.raises(ValueError, match="triton"):
            resolve_backend(q, cache, "triton")          # (CPU tensors without the interpreter)
    assert len(asked) == 3


def _layouts(device):
    """Calls whose every fact `_choose_now` reads differs from some other's: heads, query tokens, q's
    dtype and contiguity, the cache's dtype and page, the value as a view of the key, as the same view
    of another tensor (same strides) or a tensor of its own, scales absent / shared / apart / strided,
    the cache's or q's base off 16-byte alignment (read only by the GPU kernels' conditions)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        fp8 = cache_dtype == torch.float8_e4m3fn
        for page in (16, 64):
            store = torch.randn(5, page, 1, 577, generator=gen).to(cache_dtype).to(device)
            for k in (store[..., :576], store[..., 1:]):          # (the second 1 element off: unaligned)
                scales = [None] if not fp8 else [torch.rand(5, page, 1, device=device),
                                                 torch.rand(5, page, 2, device=device)[..., :1]]
                for ks in scales:
                    for vs in ([ks] if ks is None else [ks, ks.clone()]):
                        for v in (k[..., :512], k.clone()[..., :512], k[..., :512].clone()):
                            for heads, tq in ((16, 1), (128, 1), (16, 3), (64, 2)):
                                for qd in (torch.bfloat16, torch.float32):
                                    q = torch.randn(2, tq, heads, 576, generator=gen).to(qd).to(device)
                                    out.append((q, k, v, ks, vs))
                                    out.append((torch.cat([q, q], -1)[..., :576], k, v, ks, vs))
                                    off = torch.empty(q.numel() + 8, dtype=qd, device=device)[1:q.numel() + 1]
                                    out.append((off.view(q.shape).copy_(q), k, v, ks, vs))   # (base unaligned)
    gqa = torch.randn(5, 64, 4, 128, generator=gen).to(device)
    for hq in (4, 32):
        out.append((torch.randn(3, 1, hq, 128, generator=gen).to(device), gqa, gqa.clone(), None, None))
        out.append((torch.randn(3, 1, hq, 128, generator=gen).to(device), gqa, gqa, None, None))
    return out


def _check_kept_choices(device, monkeypatch):
    calls = _layouts(device)
    # (the memo keeps every layout's choice: a bounded one, cleared as it fills, would hide a shared key)
    monkeypatch.setattr(td._CHOICES, "size", 10 * len(calls))
    order = torch.randperm(len(calls), generator=torch.Generator().manual_seed(5)).tolist()
    for i in order + order:        # (every call once more, all of them kept by then)
        got = td._choose(*calls[i])
        assert got == td._choose_now(*calls[i]), i


@pytest.mark.parametrize("interpreting", ["0", "1"])
def test_kept_choices_equal_fresh_ones_over_many_layouts(monkeypatch, interpreting):
    """No two of many calls that a fact tells apart share a kept choice (on CPU; the GPU test below
    reaches the Gluon kernels' conditions)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpreting)
    _check_kept_choices("cpu", monkeypatch)


@pytest.mark.gpu
def test_kept_choices_equal_fresh_ones_on_gpu(monkeypatch):
    _check_kept_choices("cuda", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_an_unaligned_query_runs_and_matches_an_aligned_one_on_gpu(heads):
    """A contiguous q whose base is off 16-byte alignment cannot back the Gluon kernels' TMA descriptor
    (Triton's TensorDescriptor refuses it): it runs the Triton kernel, and its out matches the aligned q's
    through the Gluon kernels and the torch path. Kept choices tell the two apart."""
    lens = [700, 1, 0, 130]
    cache, table = mla_paged_cache(lens, 64, torch.bfloat16, seed=heads, device="cuda")
    q = torch.randn(len(lens), 1, heads, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    off = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")[1:q.numel() + 1].view(q.shape).copy_(q)
    assert off.is_contiguous() and off.data_ptr() % 16 != 0
    seq = torch.tensor(lens, device="cuda")
    run = lambda x, backend="triton": paged_decode_attention(x, cache, table, seq, scale=0.07, backend=backend)  # noqa: E731
    aligned, unaligned, ref = run(q), run(off), run(q.float(), "torch")
    assert td._choose(q, cache.k, cache.v, None, None).gluon and not td._choose(off, cache.k, cache.v, None, None).gluon
    check_state(unaligned, ref, 2e-2)
    check_state(aligned, ref, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_unaligned_fp8_scales_run_and_match_on_gpu(heads):
    """An fp8 latent cache whose scales sit on a base off 16-byte alignment (contiguous, 4 bytes in)
    cannot back the direct kernels' or the raw ring's TMA descriptor: the call takes a kernel that
    reads them by pointer, and its out matches the same cache with aligned scales and the torch path."""
    lens = [700, 1, 0, 130]
    cache, table = mla_paged_cache(lens, 64, torch.float8_e4m3fn, seed=heads + 1, device="cuda")
    sc = cache.k_scale
    off = torch.empty(sc.numel() + 4, dtype=sc.dtype, device="cuda")[1:sc.numel() + 1].view(sc.shape).copy_(sc)
    assert off.is_contiguous() and off.data_ptr() % 16 != 0
    moved = PagedKVCache(cache.k, cache.v, off, off)
    q = torch.randn(len(lens), 1, heads, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, device="cuda")
    run = lambda c, x=q, backend="triton": paged_decode_attention(x, c, table, seq, scale=0.07,  # noqa: E731
                                                                  backend=backend)
    ref = run(cache, q.float(), "torch")
    check_state(run(moved), ref, 2e-2)
    check_state(run(cache), ref, 2e-2)
