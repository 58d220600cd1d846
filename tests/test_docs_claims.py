"""The concrete claims of docs/numerics.md and docs/design.md, checked against the code.

Each test recomputes a documented formula independently (plain Python / torch, mostly float64)
and compares it with what the library returns on fresh random inputs (fixed seeds, so a run is
reproducible). The section cited in each test's name or docstring is the one it checks.
Everything is single-process and small: the file runs in a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ==================================================================================== §1 presets


def test_s1_presets_match_table():
    from moe import MoEConfig

    v3, fl, pro = MoEConfig.deepseek_v3(), MoEConfig.deepseek_v4_flash(), MoEConfig.deepseek_v4_pro()
    rows = [  # H, I, E, K, shared, scoring, bias, n_group, topk_group, scaling
        (v3, 7168, 2048, 256, 8, 1, "sigmoid", True, 8, 4, 2.5),
        (fl, 4096, 2048, 256, 6, 1, "sqrt_softplus", True, None, None, 1.5),
        (pro, 7168, 3072, 384, 6, 1, "sqrt_softplus", True, None, None, 2.5),
    ]
    for c, h, i, e, k, sh, sc, bias, ng, tg, scale in rows:
        assert (c.hidden, c.inter, c.num_experts, c.top_k, c.num_shared) == (h, i, e, k, sh)
        assert (c.scoring, c.use_bias, c.n_group, c.topk_group, c.routed_scaling) == (sc, bias, ng, tg, scale)
    assert fl.num_hash_layers == 3 and fl.for_layer(2).hash_layer and not fl.for_layer(3).hash_layer
    # §3: V3 unclamped; V4 routed and shared experts clamped at 10
    assert v3.swiglu_limit is None and v3.shared_swiglu_limit is None
    for c in (fl, pro):
        assert c.swiglu_limit == 10.0 and c.shared_swiglu_limit == 10.0
    # "With EP = 8 one rank holds 32 (V4-Pro: 48) routed experts"
    assert (v3.num_experts // 8, fl.num_experts // 8, pro.num_experts // 8) == (32, 32, 48)


# ==================================================================================== §2 routing


def _doc_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    l = logits.double()
    if scoring == "softmax":
        return torch.softmax(l, dim=-1)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-l))
    softplus = torch.where(l > 20, l, torch.log1p(torch.exp(torch.clamp(l, max=20))))
    return softplus.sqrt()


def _doc_route(logits, *, top_k, scoring, bias=None, n_group=None, topk_group=None, renormalize=True,
               scaling=1.0, input_ids=None, tid2eid=None, token_mask=None):
    """docs/numerics.md §2, token by token in float64."""
    s = _doc_scores(logits, scoring)
    sel = s + bias.double() if bias is not None else s
    t_count, e_count = s.shape
    ids, weights = [], []
    for t in range(t_count):
        if tid2eid is not None:
            chosen = [int(e) for e in tid2eid[int(input_ids[t])]]
        else:
            cand = list(range(e_count))
            if n_group not in (None, 1):
                size = e_count // n_group
                gscore = []
                for g in range(n_group):
                    members = range(g * size, (g + 1) * size)
                    if bias is not None:
                        gscore.append(sum(sorted((float(sel[t, e]) for e in members), reverse=True)[:2]))
                    else:
                        gscore.append(max(float(s[t, e]) for e in members))
                kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
                cand = [e for e in cand if e // size in kept]
            chosen = sorted(cand, key=lambda e: (-float(sel[t, e]), e))[:top_k]
        w = [float(s[t, e]) for e in chosen]
        total = sum(w)
        if renormalize and total != 0:
            w = [x / total for x in w]
        w = [x * scaling for x in w]
        if token_mask is not None and not bool(token_mask[t]):
            chosen, w = [-1] * len(chosen), [0.0] * len(chosen)
        ids.append(chosen)
        weights.append(w)
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("scoring,use_bias,groups,renorm,scaling", [
    ("softmax", False, None, False, 1.0),
    ("softmax", False, (4, 2), True, 1.0),
    ("sigmoid", True, (8, 4), True, 2.5),        # V3
    ("sigmoid", False, (4, 3), True, 1.0),       # grouped without bias: max of unbiased scores
    ("sqrt_softplus", True, None, True, 1.5),    # V4
    ("sqrt_softplus", True, (1, 1), False, 2.0),  # n_group 1: no group limit
])
def test_s2_route_matches_documented_formula(scoring, use_bias, groups, renorm, scaling):
    from moe import route

    g = _gen(hash((scoring, use_bias, groups)) % 2**31)
    t, e, k = 48, 32, 6
    logits = torch.randn(t, e, generator=g) * 3
    bias = torch.randn(e, generator=g) * 0.5 if use_bias else None
    mask = torch.rand(t, generator=g) > 0.2
    n_group, topk_group = groups if groups else (None, None)
    got = route(logits, top_k=k, scoring=scoring, bias=bias, n_group=n_group, topk_group=topk_group,
                renormalize=renorm, scaling=scaling, token_mask=mask, backend="torch")
    ids, w = _doc_route(logits, top_k=k, scoring=scoring, bias=bias, n_group=n_group, topk_group=topk_group,
                        renormalize=renorm, scaling=scaling, token_mask=mask)
    assert torch.equal(got.topk_ids.long(), ids)
    assert got.topk_weights.dtype == torch.float32
    torch.testing.assert_close(got.topk_weights.double(), w, rtol=2e-6, atol=1e-7)
    # masked tokens: id -1 and weight 0 in every slot
    assert bool((got.topk_ids[~mask] == -1).all()) and bool((got.topk_weights[~mask] == 0).all())


def test_s2_bias_selects_but_never_weights():
    from moe import route

    g = _gen(1)
    logits = torch.randn(16, 8, generator=g)
    bias = torch.zeros(8)
    bias[3] = 100.0   # expert 3 always chosen, its weight is still its unbiased score
    r = route(logits, top_k=2, scoring="sigmoid", bias=bias, renormalize=False, backend="torch")
    assert bool((r.topk_ids[:, 0] == 3).all())
    torch.testing.assert_close(r.topk_weights[:, 0], torch.sigmoid(logits[:, 3]))


def test_s2_ties_go_to_lowest_index():
    from moe import route

    logits = torch.zeros(3, 12)
    logits[0, [2, 5, 9]] = 1.0          # three-way tie at the top, top-2 takes 2 and 5
    logits[1] = 0.5                     # all equal: 0 and 1
    logits[2, [7, 11]] = 2.0
    r = route(logits, top_k=2, scoring="sqrt_softplus", backend="torch")
    assert r.topk_ids.tolist() == [[2, 5], [0, 1], [7, 11]]
    # grouped: groups 1 and 2 tie exactly, the lower one survives
    lg = torch.zeros(1, 12)
    lg[0, [4, 8]] = 3.0
    r = route(lg, top_k=1, scoring="sigmoid", n_group=3, topk_group=1, backend="torch")
    assert r.topk_ids.tolist() == [[4]]


def test_s2_softplus_threshold_20():
    from moe.router import score_logits

    x = torch.tensor([[19.5, 20.0, 20.5, 25.0, -30.0, 0.0]])
    got = score_logits(x, "sqrt_softplus").double()
    want = _doc_scores(x, "sqrt_softplus")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert float(got[0, 3]) == 5.0   # softplus(25) is 25 exactly above the threshold


def test_s2_nan_logit_ranks_first_and_reaches_weights():
    from moe import route

    g = _gen(2)
    logits = torch.randn(4, 16, generator=g)
    logits[1, 13] = float("nan")
    for bias in (None, torch.zeros(16)):
        r = route(logits, top_k=4, scoring="sigmoid", bias=bias, n_group=4, topk_group=2, backend="torch")
        assert int(r.topk_ids[1, 0]) == 13          # its group ranks first, and it ranks first in it
        assert bool(torch.isnan(r.topk_weights[1]).any())
        assert not bool(torch.isnan(r.topk_weights[[0, 2, 3]]).any())
    # step 6: renormalization needs a sum > 0; a NaN sum leaves the weights as they are (scaled)
    r = route(logits, top_k=4, scoring="sigmoid", scaling=2.0, backend="torch")
    sig = torch.sigmoid(logits[1, r.topk_ids[1, 1:]])
    torch.testing.assert_close(r.topk_weights[1, 1:], 2.0 * sig)


def test_s2_logits_fp32_from_low_precision_gate():
    from moe import Router

    g = _gen(3)
    router = Router(64, 8, 2, scoring="sigmoid", use_bias=True, dtype=torch.bfloat16)
    x = torch.randn(5, 64, generator=g).bfloat16()
    logits = router.logits(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, x.float() @ router.weight.float().t())


def test_s2_hash_routing():
    from moe import route

    g = _gen(4)
    t, e, k, vocab = 20, 16, 3, 50
    logits = torch.randn(t, e, generator=g)
    table = torch.randint(0, e, (vocab, k), generator=g, dtype=torch.int32)
    input_ids = torch.randint(0, vocab, (t,), generator=g)
    bias = torch.randn(e, generator=g) * 10   # ignored: no top-k, no bias
    r = route(logits, top_k=k, scoring="sqrt_softplus", bias=bias, scaling=1.5, input_ids=input_ids,
              tid2eid=table, backend="torch")
    ids, w = _doc_route(logits, top_k=k, scoring="sqrt_softplus", scaling=1.5, input_ids=input_ids, tid2eid=table)
    assert torch.equal(r.topk_ids.long(), ids)
    torch.testing.assert_close(r.topk_weights.double(), w, rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError):
        route(logits, top_k=k, scoring="sqrt_softplus", tid2eid=table, backend="torch")
    with pytest.raises(ValueError):
        route(logits, top_k=k, scoring="sqrt_softplus", tid2eid=table, input_ids=input_ids + vocab, backend="torch")


# ==================================================================================== §3 SwiGLU / FFN


def test_s3_swiglu_clamp_and_gate_up_layouts():
    from moe.kernels.ffn import expert_ffn, swiglu

    g = _gen(5)
    gate, up = torch.randn(64, generator=g) * 12, torch.randn(64, generator=g) * 12
    for limit, alpha, beta in ((None, 1.0, 0.0), (10.0, 1.0, 0.0), (7.0, 1.702, 1.0)):
        gd, ud = gate.double(), up.double()
        if limit is not None:
            gd, ud = torch.minimum(gd, torch.tensor(limit, dtype=torch.float64)), ud.clamp(-limit, limit)
        want = gd * torch.sigmoid(alpha * gd) * (ud + beta)
        torch.testing.assert_close(swiglu(gate, up, limit=limit, alpha=alpha, beta=beta).double(), want,
                                   rtol=1e-5, atol=1e-5)
    # NaN is not clipped away by the clamp
    assert torch.isnan(swiglu(torch.tensor([float("nan")]), torch.tensor([1.0]), limit=10.0)).all()
    assert torch.isnan(swiglu(torch.tensor([1.0]), torch.tensor([float("nan")]), limit=10.0)).all()

    # W13 "split" (rows [0, I) gate, [I, 2I) up) and "interleaved" (even rows gate, odd up)
    e, i, h, rows = 2, 8, 16, 6
    w1, w3 = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g)
    w2 = torch.randn(e, h, i, generator=g)
    x = torch.randn(rows, h, generator=g)
    counts = torch.tensor([4, 2])
    want = []
    for r in range(rows):
        ex = 0 if r < 4 else 1
        gg, uu = x[r].double() @ w1[ex].double().t(), x[r].double() @ w3[ex].double().t()
        hh = torch.minimum(gg, torch.tensor(10.0, dtype=torch.float64))
        hh = hh * torch.sigmoid(hh) * uu.clamp(-10, 10)
        want.append(hh @ w2[ex].double().t())
    want = torch.stack(want)
    split = torch.cat([w1, w3], dim=1)
    inter = torch.stack([w1, w3], dim=2).reshape(e, 2 * i, h)
    for w13, layout in ((split, "split"), (inter, "interleaved")):
        y = expert_ffn(x, w13, w2, counts=counts, swiglu_limit=10.0, gate_up=layout, backend="torch")
        torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


# ==================================================================================== §4 formats


def _e2m1_code(y: float) -> int:
    """Nearest E2M1 magnitude (ties to the even index), saturating at 6; sign in bit 3 (-0 -> 8)."""
    a = abs(y)
    best = min(range(8), key=lambda i: (abs(a - E2M1[i]), i % 2))
    return best | (8 if math.copysign(1.0, y) < 0 else 0)


def _codes_of(data: torch.Tensor) -> torch.Tensor:
    """Unpack by the documented rule: element 2i low nibble, 2i + 1 high nibble."""
    lo, hi = data & 0xF, data >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])


def test_s41_e2m1_packing_matches_torch_fp4x2_and_e4m3_exactness():
    from parallel.quant import pack_fp4, unpack_fp4

    g = _gen(6)
    codes = torch.randint(0, 16, (3, 10), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert torch.equal(packed, (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8))
    assert torch.equal(unpack_fp4(packed), codes)
    if hasattr(torch, "float4_e2m1fn_x2"):   # same bytes as torch's own dtype (a view, no conversion)
        assert packed.view(torch.float4_e2m1fn_x2).view(torch.uint8).data_ptr() == packed.data_ptr()
    # E2M1 value times a power of two in [2^-8, 2^6] is exact in E4M3
    for v in E2M1:
        for s in range(-8, 7):
            x = torch.tensor(v * 2.0 ** s)
            assert float(x.to(torch.float8_e4m3fn).float()) == float(x)


def test_s42_mxfp4_scale_and_rounding():
    from moe.quant import dequantize, quantize

    g = _gen(7)
    n_blocks = 24
    x = torch.randn(n_blocks, 32, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (n_blocks, 1), generator=g))
    x[0] = 0.0                                       # all-zero block: byte 0
    x[1, 5] = 6.0 * 2.0 ** 3                          # amax exactly 6 * 2^e: no rounding up
    x[1, 6] = -1.0
    x[2] = torch.linspace(-1, 1, 32) * 1.5 * 2 ** 4  # amax = 1.5 * 2^4 (mantissa boundary)
    x[3] = 0.0
    x[3, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0])  # midpoints (amax 5: e = 0)
    x = x.reshape(4, 6 * 32)
    q = quantize(x, "mxfp4", backend="torch")
    assert q.data.dtype == torch.uint8 and tuple(q.data.shape) == (4, 96)
    assert q.scale.dtype == torch.uint8 and tuple(q.scale.shape) == (4, 6)
    blocks = x.double().reshape(-1, 32)
    scale = q.scale.reshape(-1)
    codes = _codes_of(q.data).reshape(-1, 32)
    for b in range(blocks.shape[0]):
        amax = float(blocks[b].abs().max())
        if amax == 0:
            assert int(scale[b]) == 0
            continue
        e = math.ceil(math.log2(amax / 6))           # smallest e with amax <= 6 * 2^e, exactly:
        while 6 * 2.0 ** (e - 1) >= amax:
            e -= 1
        while 6 * 2.0 ** e < amax:
            e += 1
        assert int(scale[b]) == e + 127, (b, amax)
        want = [_e2m1_code(float(v) / 2.0 ** e) for v in blocks[b]]
        assert codes[b].tolist() == want, b
    # the midpoint row, by hand: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0, -0 -> code 8
    assert int(scale[3]) == 127 and codes[3, :8].tolist() == [0, 2, 2, 4, 4, 6, 6, 8]
    # dequantization: e2m1 * 2^(byte - 127)
    vals = torch.tensor([E2M1[c & 7] * (-1 if c & 8 else 1) for c in codes.reshape(-1).tolist()]).reshape(-1, 32)
    want = vals.double() * torch.pow(2.0, scale.double() - 127).unsqueeze(-1)
    assert torch.equal(dequantize(q, backend="torch").double().reshape(-1, 32), want)
    # byte 255 is NaN
    q.scale[0, 0] = 255
    assert torch.isnan(dequantize(q, backend="torch")[0, :32]).all()


def test_s42_mxfp4_floor_rule():
    from moe.quant import quantize

    g = _gen(8)
    x = torch.randn(8, 64, generator=g) * 7
    q = quantize(x, "mxfp4", scale_rule="floor", backend="torch")
    amax = x.double().reshape(-1, 32).abs().amax(-1)
    want = torch.floor(torch.log2(amax)) - 2 + 127
    assert torch.equal(q.scale.reshape(-1).double(), want)
    with pytest.raises(ValueError):
        quantize(torch.randn(2, 48), "mxfp4", backend="torch")   # K must be divisible by 32


def test_s43_nvfp4():
    from moe.quant import dequantize, quantize

    g = _gen(9)
    x = torch.randn(6, 64, generator=g) * torch.pow(2.0, torch.randint(-6, 6, (6, 4), generator=g)
                                                    ).repeat_interleave(16, dim=1)
    q = quantize(x, "nvfp4", backend="torch")
    gs = x.abs().amax() / (448 * 6)                    # fp32, as the doc's g
    assert float(q.global_scale) == float(gs)
    blk = x.reshape(6, 4, 16)
    s = torch.minimum((blk.abs().amax(-1) / 6) / gs, torch.tensor(448.0)).to(torch.float8_e4m3fn)
    assert torch.equal(q.scale.view(torch.float8_e4m3fn).float(), s.float())
    d = s.double().unsqueeze(-1) * gs.double()          # s_blk * g, exact in float64
    want = [_e2m1_code(v) for v in (blk.double() / d).reshape(-1).tolist()]
    assert _codes_of(q.data).reshape(-1).tolist() == want
    vals = torch.tensor([E2M1[c & 7] * (-1 if c & 8 else 1) for c in want]).reshape(6, 4, 16)
    # x' = q * s_blk * g: q * s_blk is exact in fp32, so one rounding (of the product with g)
    assert torch.equal(dequantize(q, backend="torch"), (vals.double() * d).float().reshape(6, 64))


@pytest.mark.parametrize("fmt", ["fp8_token", "fp8_group", "fp8_block"])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_s44_fp8_scalings(fmt, ue8m0):
    from moe.quant import dequantize, quantize

    g = _gen(10)
    n, k = 130, 300                                   # partial last 128-block along both dims
    x = torch.randn(n, k, generator=g) * torch.pow(2.0, torch.randint(-8, 8, (n, 1), generator=g))
    x[3] = 0.0
    q = quantize(x, fmt, ue8m0=ue8m0, backend="torch")
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    # scale granularity
    if fmt == "fp8_token":
        spans = [(slice(r, r + 1), slice(0, k)) for r in range(n)]
        assert tuple(q.scale.shape) == (n, 1)
    elif fmt == "fp8_group":
        spans = [(slice(r, r + 1), slice(c, min(c + 128, k))) for r in range(n) for c in range(0, k, 128)]
        assert tuple(q.scale.shape) == (n, 3)
    else:
        spans = [(slice(r, min(r + 128, n)), slice(c, min(c + 128, k)))
                 for r in range(0, n, 128) for c in range(0, k, 128)]
        assert tuple(q.scale.shape) == (2, 3)
    flat_scale = q.scale.reshape(-1)
    for idx, (rs, cs) in enumerate(spans):
        amax = max(float(x[rs, cs].abs().max()), 1e-12)
        if ue8m0:
            e = math.ceil(math.log2(amax / 448))
            while 448 * 2.0 ** (e - 1) >= amax:
                e -= 1
            while 448 * 2.0 ** e < amax:
                e += 1
            want = 2.0 ** e
        else:
            want = float(torch.tensor(amax, dtype=torch.float32) / 448)
        assert float(flat_scale[idx]) == want, (idx, amax)
        sc = torch.tensor(want, dtype=torch.float32)
        vals = torch.clamp(x[rs, cs] / sc, -448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q.data[rs, cs].view(torch.uint8), vals.view(torch.uint8))
    deq = dequantize(q, backend="torch")
    for rs, cs in spans[:4]:
        assert torch.equal(deq[rs, cs], q.data[rs, cs].float() * q.scale.reshape(-1)[spans.index((rs, cs))])


def test_s45_fold_exact_within_spread_14():
    from parallel.quant import QuantizedTensor, dequantize, mxfp4_to_fp8_block

    g = _gen(11)
    n, k = 130, 256                                   # 2 groups of 128 along K, 2 row tiles
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    top = torch.randint(120, 140, (1, k // 128), generator=g).expand(n, -1)
    # block exponents of one group (1 x 128, and 128 x 128) within [top - 14, top]; the lowest block
    # holds the smallest value
    byte = (top.repeat_interleave(4, dim=1) - torch.randint(0, 15, (n, k // 32), generator=g)).to(torch.uint8)
    byte[:, 0] = (top[:, 0] - 14).to(torch.uint8)
    byte[:, 1] = top[:, 0].to(torch.uint8)
    codes[:, 0] = 1                                    # 0.5 in the lowest block: 0.5 * 2^-8 = smallest subnormal
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    q = QuantizedTensor(packed, byte, "mxfp4", (n, k))
    exact = dequantize(q, backend="torch").double()
    for tile_rows, fmt in ((1, "fp8_group"), (128, "fp8_block")):
        f = mxfp4_to_fp8_block(q, tile_rows=tile_rows, strict=True)
        assert f.fmt == fmt
        e = byte.long() - 127
        e_max = e.reshape(n, k // 128, 4).amax(-1)                 # [n, G]
        if tile_rows == 128:
            e_max = torch.stack([e_max[r:r + 128].amax(0) for r in range(0, n, 128)])
        e_ref = torch.clamp(e_max - 6, min=-126)
        assert torch.equal(f.scale.double(), torch.pow(2.0, e_ref.double()))
        ref_rows = e_ref if tile_rows == 1 else e_ref.repeat_interleave(128, dim=0)[:n]
        shift = e - ref_rows.repeat_interleave(4, dim=1)
        vals = torch.tensor([E2M1[c & 7] * (-1 if c & 8 else 1) for c in codes.reshape(-1).tolist()]).reshape(n, k)
        want = vals.double() * torch.pow(2.0, shift.double()).repeat_interleave(32, dim=1)
        assert torch.equal(f.data.double(), want)                  # v * 2^(e_b - e_ref), exact
        assert torch.equal(dequantize(f, backend="torch").double(), exact)
    # a spread of 15 loses the smallest value (0.5 * 2^-9 is below E4M3): strict raises
    byte[:, 0] = (top[:, 0] - 15).to(torch.uint8)
    q = QuantizedTensor(packed, byte, "mxfp4", (n, k))
    with pytest.raises(ValueError):
        mxfp4_to_fp8_block(q, strict=True)
    f = mxfp4_to_fp8_block(q)
    assert bool((f.data[:, 0].float() == 0).all())                # flushed to zero (round to even)


# ==================================================================================== §6 EPLB


def _doc_pack(loads: list, num_packs: int) -> list[list[int]]:
    """§6 balanced packing: heaviest item first (ties: lower index) into the lightest pack with room
    (ties: lower pack); n / m items per pack; with one item per pack, item i goes to pack i. Returns
    each pack's items in arrival order. Pack loads accumulate in float32."""
    n = len(loads)
    cap = n // num_packs
    if cap == 1:
        return [[i] for i in range(n)]
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    weight = [np.float32(0)] * num_packs
    for item in sorted(range(n), key=lambda i: (-loads[i], i)):
        open_packs = [p for p in range(num_packs) if len(packs[p]) < cap]
        p = min(open_packs, key=lambda q: (weight[q], q))
        packs[p].append(item)
        weight[p] = np.float32(weight[p] + loads[item])
    return packs


def _doc_eplb(load_row, num_phy: int, num_groups: int, num_nodes: int, num_ranks: int):
    """§6 for one layer, as the doc states it; returns (phy2log list, logcnt list)."""
    loads = [np.float32(v) for v in load_row]
    num_log = len(loads)
    if num_groups % num_nodes:                       # global policy
        num_groups, num_nodes = 1, 1
    gsize = num_log // num_groups
    group_load = [np.float32(np.sum(np.array(loads[g * gsize:(g + 1) * gsize], dtype=np.float32)))
                  for g in range(num_groups)]
    phy2log, logcnt = [], [0] * num_log
    for node_groups in _doc_pack(group_load, num_nodes):             # 1. groups -> nodes
        experts = [g * gsize + j for g in node_groups for j in range(gsize)]
        count = [1] * len(experts)                                   # 2. replicate inside the node
        slots = list(range(len(experts)))
        while len(slots) < num_phy // num_nodes:
            ratio = [loads[e] / np.float32(c) for e, c in zip(experts, count)]
            hot = max(range(len(experts)), key=lambda i: (ratio[i], -i))
            slots.append(hot)
            count[hot] += 1
        replica_load = [loads[experts[i]] / np.float32(count[i]) for i in slots]
        for rank_items in _doc_pack(replica_load, num_ranks // num_nodes):   # 3. replicas -> ranks
            phy2log += [experts[slots[i]] for i in rank_items]
        for e, c in zip(experts, count):
            logcnt[e] = c
    return phy2log, logcnt


@pytest.mark.parametrize("num_log,num_phy,groups,nodes,ranks", [
    (16, 24, 4, 2, 4),     # hierarchical
    (16, 24, 3, 2, 4),     # 3 % 2 != 0: global policy (16 % 3 != 0 is fine there)
    (12, 16, 2, 2, 4),     # one group per node: group i -> node i
    (8, 16, 1, 1, 16),     # one slot per rank: replica i -> rank i
])
def test_s6_eplb_placement_as_documented(num_log, num_phy, groups, nodes, ranks):
    from parallel.ep.eplb import rebalance_experts

    g = _gen(num_log * 1000 + num_phy * 10 + groups)
    weight = torch.rand(3, num_log, generator=g) * 1000 + 1   # tie-free loads
    plan = rebalance_experts(weight, num_phy, groups, nodes, ranks)
    for layer in range(3):
        phy2log, logcnt = _doc_eplb(weight[layer].tolist(), num_phy, groups, nodes, ranks)
        assert plan.phy2log[layer].tolist() == phy2log
        assert plan.logcnt[layer].tolist() == logcnt
    # log2phy: each expert's slots in ascending order, -1 padded
    for layer in range(3):
        for e in range(num_log):
            slots = sorted(p for p in range(num_phy) if int(plan.phy2log[layer, p]) == e)
            row = plan.log2phy[layer, e].tolist()
            assert row[:len(slots)] == slots and all(v == -1 for v in row[len(slots):])


def test_s6_replica_choice_and_balancedness():
    from parallel.ep.eplb import balancedness, logical_to_physical, rebalance_experts

    g = _gen(12)
    e, p, ranks, t, k = 8, 12, 4, 10, 4
    weight = torch.rand(1, e, generator=g) * 100 + 1
    plan = rebalance_experts(weight, p, 1, 1, ranks)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[2, 1] = -1
    for offset in (None, 37):
        index = None if offset is None else torch.arange(t) + offset
        got = logical_to_physical(ids, plan.log2phy[0], plan.logcnt[0], index)
        for ti in range(t):
            for ki in range(k):
                ex = int(ids[ti, ki])
                if ex < 0:
                    assert int(got[ti, ki]) == -1
                    continue
                pos = ti + (offset or 0)
                assert int(got[ti, ki]) == int(plan.log2phy[0, ex, (pos + ki) % int(plan.logcnt[0, ex])])
    # balancedness = mean per-rank load / max per-rank load, a replica carrying load / count
    per_rank = [0.0] * ranks
    for slot in range(p):
        ex = int(plan.phy2log[0, slot])
        per_rank[slot // (p // ranks)] += float(weight[0, ex]) / int(plan.logcnt[0, ex])
    bal = balancedness(weight, plan.phy2log, ranks)
    assert bal.overall == pytest.approx(sum(per_rank) / ranks / max(per_rank), rel=1e-9)


def test_s6_old_placement_keeps_slots():
    from parallel.ep.eplb import rebalance_experts

    g = _gen(13)
    weight = torch.rand(2, 16, generator=g) * 100 + 1
    old = rebalance_experts(weight, 24, 4, 2, 4).phy2log
    again = rebalance_experts(weight * (1 + 1e-3 * torch.rand(2, 16, generator=g)), 24, 4, 2, 4, old_phy2log=old)
    per_rank = 24 // 4
    for layer in range(2):
        for rank in range(4):
            span = slice(rank * per_rank, (rank + 1) * per_rank)
            new_r, old_r = again.phy2log[layer, span].tolist(), old[layer, span].tolist()
            for ex in set(new_r):    # an expert that stays on the rank keeps its old slot(s)
                kept = sum(1 for a, b in zip(new_r, old_r) if a == b == ex)
                assert kept == min(new_r.count(ex), old_r.count(ex)), (layer, rank, ex)


# ==================================================================================== §7 LSE merge


def _doc_merge(outs, lses, base):
    """§7 in float64, element by element along N."""
    o64, l64 = outs.double(), lses.double().clone()
    nan_row = torch.isnan(l64).any(0)
    l64 = torch.where(l64 == math.inf, -math.inf, l64)
    m = l64.amax(0)
    m = torch.where(m == -math.inf, 0.0, m)
    m = torch.where(torch.isnan(m), 0.0, m)
    w = torch.pow(2.0, l64 - m) if base == "2" else torch.exp(l64 - m)
    w = torch.where(torch.isnan(w), 0.0, w)
    s = w.sum(0)
    empty = s == 0
    o = (torch.where(w.unsqueeze(-1) > 0, o64, 0.0) * (w / torch.where(empty, 1.0, s)).unsqueeze(-1)).sum(0)
    lse = torch.where(empty, -math.inf, m + (torch.log2(s) if base == "2" else torch.log(s)))
    o = torch.where(nan_row.unsqueeze(-1), math.nan, o)
    lse = torch.where(nan_row, math.nan, lse)
    return o, lse


@pytest.mark.parametrize("base", ["e", "2"])
def test_s7_merge(base):
    from parallel.cp import merge_attn_states

    g = _gen(14)
    n, t, h, d = 3, 6, 4, 8
    outs = torch.randn(n, t, h, d, generator=g)
    lses = torch.randn(n, t, h, generator=g) * 4 + 800   # large lses: o * exp(lse) would overflow
    lses[0, 0, 0] = -math.inf
    lses[1, 0, 0] = math.inf                               # +inf marks an empty partial too
    lses[:, 1, 1] = -math.inf                              # empty everywhere
    lses[:, 1, 2] = torch.tensor([-math.inf, math.inf, -math.inf])
    lses[2, 2, 3] = math.nan                               # NaN makes the merged row NaN
    outs[0, 0, 0] = math.nan                               # an empty partial's out is ignored
    got = merge_attn_states(outs, lses, base=base, backend="torch")
    want_o, want_lse = _doc_merge(outs, lses, base)
    assert got.lse.dtype == torch.float32
    torch.testing.assert_close(got.out.double(), want_o, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got.lse.double(), want_lse, rtol=1e-6, atol=1e-4, equal_nan=True)
    assert bool((got.out[1, 1] == 0).all()) and float(got.lse[1, 1]) == -math.inf
    assert bool((got.out[1, 2] == 0).all()) and float(got.lse[1, 2]) == -math.inf
    assert bool(torch.isnan(got.out[2, 3]).all()) and math.isnan(float(got.lse[2, 3]))
    assert bool(torch.isfinite(got.out[0, 0]).all())


# ==================================================================================== §8 PCP / DCP


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_s81_zigzag_chunks(size):
    from parallel.cp import zigzag_positions, zigzag_shard, zigzag_unshard

    seq = 2 * size * 5
    x = torch.arange(seq)
    chunk = seq // (2 * size)
    shards = []
    for r in range(size):
        want = torch.cat([x[r * chunk:(r + 1) * chunk], x[(2 * size - 1 - r) * chunk:(2 * size - r) * chunk]])
        got = zigzag_shard(x, r, size)
        assert torch.equal(got, want)                          # chunks r and 2P - 1 - r
        assert torch.equal(zigzag_positions(seq, r, size), want)
        shards.append(got)
    assert torch.equal(zigzag_unshard(shards), x)


# ==================================================================================== §8 DCP layout


@pytest.mark.parametrize("n,interleave,block", [(1, 1, 4), (2, 1, 4), (4, 2, 8), (3, 4, 8), (4, 8, 8)])
def test_s82_dcp_layout_formulas(n, interleave, block):
    from parallel.cp import DCPLayout

    g = _gen(15 + n * interleave)
    table = torch.randperm(64, generator=g)[:16]
    positions = torch.arange(16 * block * n)
    seen = set()
    for r in range(n):
        lay = DCPLayout(size=n, rank=r, block_size=block, interleave=interleave)
        owner = lay.owner(positions)
        off = lay.local_offset(positions)
        slots = lay.slot_mapping(positions, table)
        for p in range(0, positions.numel(), 7):
            o = p % (block * n)
            want_owner = (o // interleave) % n
            want_off = (o // (n * interleave)) * interleave + o % interleave
            assert int(owner[p]) == want_owner == (p // interleave) % n
            assert int(off[p]) == want_off
            want_slot = int(table[p // (block * n)]) * block + want_off if want_owner == r else -1
            assert int(slots[p]) == want_slot
        mine = slots[slots >= 0].tolist()
        assert len(mine) == len(set(mine))      # a rank's slots are distinct
        seen.update((r, s) for s in mine)
        assert all(0 <= int(o) < block for o in off)
        # local lengths: base = (L // I // N) * I, rem = L - base * N, base + clip(rem - r I, 0, I)
        for length in range(3 * block * n + 1):
            base = (length // interleave // n) * interleave
            rem = length - base * n
            want = base + min(max(rem - r * interleave, 0), interleave)
            assert lay.local_lengths(length) == want == int((owner[:length] == r).sum())
        lens = torch.arange(0, 2 * block * n)
        assert torch.equal(lay.local_lengths(lens), torch.tensor([lay.local_lengths(int(x)) for x in lens]))
    assert len(seen) == positions.numel()       # every position stored exactly once over the ranks


def test_s82_pcp_dcp_groups_and_total_cp_rank():
    from parallel import ParallelConfig
    from parallel.layout import coords, rank_groups

    cfg = ParallelConfig(world_size=16, tp=4, pcp=2, dcp=2)       # dp 2
    grid = torch.arange(16).reshape(1, 2, 1, 2, 4)                 # ext_dp, dp, pp, pcp, tp
    groups = rank_groups(cfg, derived=True)
    assert groups["dcp"] == grid.reshape(-1, 2).tolist()
    assert groups["pcp"] == grid.transpose(3, 4).reshape(-1, 2).tolist()
    for r in range(16):
        c = coords(cfg, r)
        assert c["cp"] == c["pcp"] * cfg.dcp + c["dcp"]
        cp_group = next(gr for gr in groups["cp"] if r in gr)
        assert cp_group.index(r) == c["cp"]


def test_s82_gqa_dcp_constraint():
    from model.config import ModelConfig, check_layout
    from parallel import ParallelConfig

    for tp in (2, 4, 8):
        for kv in (1, 2, 4, 8, 16):
            for dcp in (d for d in range(2, tp + 1) if tp % d == 0):
                pcfg = ParallelConfig(world_size=tp, tp=tp, dcp=dcp)
                documented = kv < tp and (tp // kv) % dcp == 0
                try:
                    check_layout(ModelConfig(heads=16, kv_heads=kv), pcfg)
                    ok = True
                except ValueError:
                    ok = False
                assert ok == documented, (tp, kv, dcp)


def test_s82_dcp_decode_one_rank_and_empty_shard():
    """One DCP rank (no process group): the decode equals plain attention over the sequence (GQA:
    query head h reads kv head h // (H / Hkv)); a sequence without tokens gives o = 0, lse = -inf."""
    from parallel.cp import PagedKVCache, dcp_decode_attention, dcp_kv_insert

    g = _gen(18)
    block, hkv, d, heads, length = 4, 2, 8, 4, 10
    cache = PagedKVCache.allocate(8, block, hkv, d, dtype=torch.float32)
    table = torch.tensor([[3, 5, 1], [0, 2, 4]])
    k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
    dcp_kv_insert(cache, k, v, torch.arange(length), table[0])
    q = torch.randn(2, heads, d, generator=g)
    res = dcp_decode_attention(q, cache, table, torch.tensor([length, 0]), None, return_lse=True)
    kk = k.double().repeat_interleave(heads // hkv, dim=1)
    vv = v.double().repeat_interleave(heads // hkv, dim=1)
    scores = torch.einsum("hd,thd->ht", q[0].double(), kk) / math.sqrt(d)
    torch.testing.assert_close(res.lse[0].double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.out[0].double(), torch.einsum("ht,thd->hd", scores.softmax(-1), vv),
                               rtol=1e-5, atol=1e-5)
    assert bool((res.out[1] == 0).all()) and bool((res.lse[1] == -math.inf).all())


def test_s83_mla_absorbed_decode_equals_expanded_attention():
    """Absorbed decode (q_lat = W_UK^T q_nope, scores over [c_kv, k_pe], values c_kv, o = W_UV o_lat)
    equals attention with k[h] = [W_UK[h] c_kv, k_pe], v[h] = W_UV[h] c_kv and scale (d_n + d_r)^-1/2."""
    from parallel.cp import MLACache, MLADims, mla_decode_attention, mla_kv_insert

    g = _gen(19)
    dims = MLADims(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    heads, length, block = 3, 9, 4
    cache = MLACache.allocate(6, block, dims, dtype=torch.float32)
    table = torch.tensor([[2, 0, 5]])
    c_kv = torch.randn(length, 16, generator=g)
    k_pe = torch.randn(length, 4, generator=g)
    mla_kv_insert(cache, c_kv, k_pe, torch.arange(length), table[0])
    w_uk, w_uv = torch.randn(heads, 8, 16, generator=g), torch.randn(heads, 6, 16, generator=g)
    q_nope, q_pe = torch.randn(1, heads, 8, generator=g), torch.randn(1, heads, 4, generator=g)
    got = mla_decode_attention(q_nope, q_pe, cache, w_uk, w_uv, table, torch.tensor([length]))
    for h in range(heads):
        k = torch.cat([c_kv.double() @ w_uk[h].double().t(), k_pe.double()], dim=-1)    # [T, d_n + d_r]
        v = c_kv.double() @ w_uv[h].double().t()                                       # [T, d_v]
        q = torch.cat([q_nope[0, h], q_pe[0, h]]).double()
        p = torch.softmax((k @ q) * (8 + 4) ** -0.5, dim=0)
        torch.testing.assert_close(got[0, h].double(), p @ v, rtol=1e-4, atol=1e-5)


def test_s83_mla_plain_scale():
    from parallel.cp import MLADims

    d = MLADims(kv_lora_rank=64, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)
    assert d.scale == (24 + 8) ** -0.5 and d.latent_dim == 64 + 8


# ==================================================================================== §10 thresholds


def test_s10_ubatch_default_thresholds():
    from parallel.ubatch import UBatchRunner

    params = inspect.signature(UBatchRunner.__init__).parameters
    assert params["decode_min_tokens"].default == 32 and params["prefill_min_tokens"].default == 512


# ==================================================================================== §11 mHC


def _doc_sinkhorn(c, iters, eps):
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def test_s11_mhc_pre_post_head():
    from model.mhc import mhc_head, mhc_post, mhc_pre

    g = _gen(16)
    t, m, h, eps, rms_eps = 5, 4, 24, 1e-6, 1e-6
    residual = torch.randn(t, m, h, generator=g)
    fn = torch.randn((2 + m) * m, m * h, generator=g) * 0.1
    base = torch.randn((2 + m) * m, generator=g) * 0.1
    scale = torch.rand(3, generator=g) + 0.5
    layer_input, post, comb = mhc_pre(residual, fn, base, scale, backend="torch")

    xf = residual.double().reshape(t, m * h)
    mix = (xf @ fn.double().t()) / torch.sqrt((xf ** 2).mean(-1, keepdim=True) + rms_eps)
    sc, bs = scale.double(), base.double()
    pre = torch.sigmoid(mix[:, :m] * sc[0] + bs[:m]) + eps
    want_post = 2 * torch.sigmoid(mix[:, m:2 * m] * sc[1] + bs[m:2 * m])
    c = torch.softmax(mix[:, 2 * m:].reshape(t, m, m) * sc[2] + bs[2 * m:].reshape(m, m), dim=-1) + eps
    want_comb = _doc_sinkhorn(c, 20, eps)
    want_input = (pre.unsqueeze(-1) * residual.double()).sum(1)
    torch.testing.assert_close(post.double(), want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), want_comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer_input.double(), want_input, rtol=1e-5, atol=1e-5)
    # post: new_j = sum_i C[i, j] residual_i + post_j * f(x), in the residual's dtype
    out = torch.randn(t, h, generator=g)
    new = mhc_post(out, residual, post, comb, backend="torch")
    want_new = torch.einsum("tij,tih->tjh", comb.double(), residual.double()) \
        + post.double().unsqueeze(-1) * out.double().unsqueeze(1)
    assert new.dtype == residual.dtype
    torch.testing.assert_close(new.double(), want_new, rtol=1e-5, atol=1e-5)
    assert mhc_post(out.bfloat16(), residual.bfloat16(), post, comb, backend="torch").dtype == torch.bfloat16
    # head: pre_h = sigmoid(rmsnorm(xf) @ fn_head^T * scale_head + base_head) + eps
    fn_h, base_h, scale_h = torch.randn(m, m * h, generator=g) * 0.1, torch.randn(m, generator=g), torch.rand(1) + 0.5
    got = mhc_head(residual, fn_h, base_h, scale_h, backend="torch")
    normed = xf / torch.sqrt((xf ** 2).mean(-1, keepdim=True) + rms_eps)
    pre_h = torch.sigmoid(normed @ fn_h.double().t() * float(scale_h) + base_h.double()) + eps
    torch.testing.assert_close(got.double(), (pre_h.unsqueeze(-1) * residual.double()).sum(1), rtol=1e-5, atol=1e-5)


# ==================================================================================== design.md §2, §7


def test_design_public_surface_names_and_results():
    from launch import init_from_env, launch_local, launch_on_ray  # noqa: F401
    from model.mhc import MHCPre, mhc_post, mhc_pre  # noqa: F401
    from moe import Experts, MoEConfig, MoELayer, Router, route  # noqa: F401
    from moe.quant import QuantizedTensor, dequantize, quantize
    from parallel import ParallelConfig, destroy_parallel, get_groups, init_parallel  # noqa: F401
    from parallel.cp import (  # noqa: F401
        AttnState,
        attention_with_lse,
        dcp_decode_attention,
        merge_attn_states,
        ring_attention,
    )
    from parallel.ep import DispatchResult, make_dispatcher
    from parallel.ep.eplb import EplbPlan, rebalance_experts
    from parallel.layout import rank_groups
    from parallel.sp import all_gather_matmul, matmul_reduce_scatter
    from parallel.ubatch import UBatchRunner  # noqa: F401

    g = _gen(17)
    assert list(rank_groups(ParallelConfig(world_size=8, tp=2, pcp=2, dcp=2))) == \
        ["tp", "dcp", "pcp", "pp", "dp", "ep", "edp"]
    for fmt in ("mxfp4", "nvfp4", "fp8_block", "fp8_token", "fp8_group"):
        q = quantize(torch.randn(4, 64, generator=g), fmt)
        assert isinstance(q, QuantizedTensor) and q.fmt == fmt and dequantize(q).shape == (4, 64)
    assert isinstance(rebalance_experts(torch.rand(1, 4, generator=g), 4, 1, 1, 2), EplbPlan)
    assert isinstance(merge_attn_states(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1)), AttnState)
    o, lse = attention_with_lse(torch.randn(3, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4))
    assert o.shape == (3, 2, 4) and lse.shape == (3, 2)
    layer_input, post, comb = mhc_pre(torch.randn(2, 4, 8), torch.randn(24, 32), torch.zeros(24), torch.ones(3))
    assert (layer_input.shape, post.shape, comb.shape) == ((2, 8), (2, 4), (2, 4, 4))
    r = route(torch.randn(3, 8, generator=g), top_k=2)
    assert r.topk_ids.shape == (3, 2) and r.topk_weights.dtype == torch.float32
    # dispatch(x, ids, w) -> DispatchResult; combine(y, handle) -> [T, H] (EP = 1: no process group)
    d = make_dispatcher(None, 4, 8)
    x = torch.randn(5, 8, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    w = torch.full((5, 2), 0.5)
    res = d.dispatch(x, ids, w)
    assert isinstance(res, DispatchResult)
    torch.testing.assert_close(d.combine(res.x, res.handle), x)      # identity experts, weights sum to 1
    # §9: all_gather_matmul returns gathered_x @ w for each w [K, N]; matmul_reduce_scatter x @ w
    ws = [torch.randn(8, 3, generator=g), torch.randn(8, 5, generator=g)]
    outs = all_gather_matmul(x, ws, None)
    for got, wt in zip(outs, ws):
        torch.testing.assert_close(got, x @ wt)
    torch.testing.assert_close(matmul_reduce_scatter(x, ws[0], None), x @ ws[0])


def test_design_rank_layout_rule():
    """design.md §2: ranks form ExtDP x DP x PP x PCP x TP (TP fastest); an axis's groups come from
    moving it last and reshaping to (-1, size); DCP = contiguous sub-blocks of TP; EP spans
    DP x PCP x TP of one PP stage."""
    from parallel import ParallelConfig
    from parallel.layout import rank_groups

    cfg = ParallelConfig(world_size=32, tp=2, pp=2, pcp=2, dcp=2, dp=2)   # ext_dp 2
    grid = torch.arange(32).reshape(2, 2, 2, 2, 2)
    groups = rank_groups(cfg)
    for axis, dim in (("dp", 1), ("pp", 2), ("pcp", 3), ("tp", 4)):
        assert groups[axis] == grid.transpose(dim, 4).reshape(-1, 2).tolist()       # listed in vLLM's order
        assert sorted(groups[axis]) == sorted(grid.movedim(dim, -1).reshape(-1, 2).tolist())
    assert groups["dcp"] == grid.reshape(-1, 2).tolist()
    stages = [sorted(grid[x, :, p].reshape(-1).tolist()) for x in range(2) for p in range(2)]
    assert sorted(map(sorted, groups["ep"])) == sorted(stages)


def test_design_typed_configs_frozen_and_validated():
    from parallel.ep import DeepEPConfig, DispatcherConfig, EplbConfig, NvshmemConfig

    fields = {c.__name__: [f.name for f in dataclasses.fields(c)]
              for c in (DispatcherConfig, NvshmemConfig, DeepEPConfig)}
    assert set(fields["DispatcherConfig"]) == {"backend", "layout", "align", "capacity", "drop_policy", "check_ids",
                                               "comm_thread", "backend_config"}
    assert {"mode", "max_tokens", "hidden", "top_k", "num_experts", "scale_width", "capacity", "drop_policy",
            "max_iters", "min_region_bytes"} <= set(fields["NvshmemConfig"])
    assert set(fields["DeepEPConfig"]) == {"num_nvl_bytes", "num_rdma_bytes", "num_qps_per_rank", "low_latency_mode",
                                           "max_dispatch_tokens_per_rank", "hidden", "num_experts", "use_fp8"}
    for c in (DispatcherConfig, NvshmemConfig, DeepEPConfig, EplbConfig):
        assert c.__dataclass_params__.frozen
    with pytest.raises(ValueError):
        DispatcherConfig(layout="bogus")
    with pytest.raises(ValueError):
        NvshmemConfig(mode="normal", max_tokens=128)      # a field of the other mode is refused


def test_design_layering_and_lazy_imports():
    """design.md §1: `parallel` imports nothing from moe / model / launch; importing parallel, moe and
    model.mhc loads none of triton, ray, nvshmem, deep_ep, deep_gemm."""
    code = (
        "import sys\n"
        "import parallel, parallel.ep, parallel.cp, parallel.sp, parallel.quant, parallel.ubatch, parallel.impl\n"
        "up = [m for m in sys.modules if m.split('.')[0] in ('moe', 'model', 'launch')\n"
        "      or m.startswith(('megapar.moe', 'megapar.model', 'megapar.launch'))]\n"
        "import moe, moe.quant, model.mhc\n"
        "lazy = [m for m in sys.modules if m.split('.')[0] in ('triton', 'ray', 'nvshmem', 'deep_ep', 'deep_gemm')]\n"
        "print(up, lazy)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []"
