"""CPU tests of moe.quant's torch reference against an independent pure-Python oracle.

The oracle works in Python floats (doubles, exact for the values involved) and numpy float32
for the steps the spec defines in fp32, and picks nearest-even values by enumerating every
representable E2M1 / E4M3 value, instead of the threshold and bit tricks of the reference.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moe.quant import (
    FORMATS,
    QuantizedTensor,
    dequantize,
    e2m1_to_float,
    e8m0_to_float,
    mxfp4_fold_plan,
    mxfp4_to_fp8_block,
    pack_fp4,
    quantize,
    unpack_fp4,
)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3_values() -> list[float]:
    out = []
    for b in range(127):  # 0x7f is NaN
        exp, man = b >> 3, b & 7
        out.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return out


E4M3 = _e4m3_values()


def nearest_even(a: float, table: list[float]) -> int:
    """Index into the ascending `table` nearest to a >= 0; ties to the even index; saturating."""
    if a >= table[-1]:
        return len(table) - 1
    best = min(range(len(table)), key=lambda i: (abs(table[i] - a), i % 2))
    return best


def oracle_e2m1_code(y: float) -> int:
    idx = nearest_even(abs(y), E2M1)
    return idx | (8 if math.copysign(1.0, y) < 0 else 0)


def oracle_e4m3(y: float) -> float:
    return math.copysign(E4M3[nearest_even(abs(y), E4M3)], y)


def oracle_mxfp4(x: np.ndarray, rule: str = "ceil") -> tuple[list[int], list[int]]:
    """x: 1-D float32, len % 32 == 0 -> (codes, scale bytes)."""
    codes, scales = [], []
    for blk in x.reshape(-1, 32).astype(np.float64):
        amax = float(np.abs(blk).max())
        if amax == 0:
            e = -127
        elif rule == "ceil":
            e = math.ceil(math.log2(amax / 6))
            while 6 * 2.0**e < amax:
                e += 1
            while 6 * 2.0 ** (e - 1) >= amax:
                e -= 1
        else:
            e = math.frexp(amax)[1] - 1 - 2
        e = max(-127, min(127, e))
        scales.append(e + 127)
        codes += [oracle_e2m1_code(v / 2.0**e) for v in blk]
    return codes, scales


def f32(v) -> np.float32:
    return np.float32(v)


def oracle_nvfp4(x: np.ndarray, gs: float | None = None) -> tuple[list[int], list[float], np.float32]:
    """x: 1-D float32 -> (codes, block scale values, global scale): the scales with the spec's
    fp32 steps, each code rounded from the exact quotient x / (s * g) (Python Fractions)."""
    gs = f32(np.abs(x).max()) / f32(2688.0) if gs is None else f32(gs)
    codes, svals = [], []
    for blk in x.reshape(-1, 16):
        amax = f32(np.abs(blk).max())
        s = oracle_e4m3(float(min(f32(amax / f32(6.0)) / gs, f32(448.0)))) if gs > 0 else 0.0
        denom = Fraction(s) * Fraction(float(gs))
        svals.append(s)
        for v in blk:
            if denom > 0:
                idx = nearest_even_exact(abs(Fraction(float(v))) / denom)
                codes.append(idx | (8 if math.copysign(1.0, float(v)) < 0 else 0))
            else:
                codes.append(oracle_e2m1_code(0.0 * float(v)))
    return codes, svals, gs


def nearest_even_exact(a: Fraction) -> int:
    """E2M1 index nearest to the exact a >= 0, ties to even, saturating at 6."""
    table = [Fraction(v) for v in E2M1]
    if a >= table[-1]:
        return len(table) - 1
    return min(range(len(table)), key=lambda i: (abs(table[i] - a), i % 2))


def decode_codes(codes: list[int]) -> list[float]:
    return [(-1.0 if c & 8 else 1.0) * E2M1[c & 7] for c in codes]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


# ---------------------------------------------------------------- E2M1 and packing


def test_every_e2m1_value_round_trips_mxfp4_at_several_scales():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_to_float(codes)                                       # includes -0.0 and +-6
    assert vals.tolist() == E2M1 + [-v for v in E2M1]
    for k in (-127, -60, -1, 0, 3, 40, 125):
        x = torch.cat([vals, vals.flip(0)]) * 2.0**k                   # 32 values, amax 6 * 2^k
        q = quantize(x, "mxfp4")
        assert q.scale.tolist() == [k + 127]
        assert torch.equal(unpack_fp4(q.data), torch.cat([codes, codes.flip(0)]))
        assert _bits_equal(dequantize(q), x)


def test_every_e2m1_value_round_trips_nvfp4():
    vals = e2m1_to_float(torch.arange(16, dtype=torch.uint8))
    q = quantize(vals, "nvfp4")                                       # block scale 448, g = 6/2688
    assert q.scale.view(torch.float8_e4m3fn).item() == 448.0
    assert torch.equal(unpack_fp4(q.data), torch.arange(16, dtype=torch.uint8))
    # with a power-of-two tensor scale the values come back bit for bit
    q = quantize(vals * 2.0**-20, "nvfp4", global_scale=2.0**-28)     # block scale 2^8
    assert torch.equal(unpack_fp4(q.data), torch.arange(16, dtype=torch.uint8))
    assert _bits_equal(dequantize(q), vals * 2.0**-20)


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 0xF, 0x8, 7, 0]], dtype=torch.uint8)
    data = pack_fp4(codes)
    assert data.tolist() == [[0x21, 0x8F, 0x07]]
    assert torch.equal(unpack_fp4(data), codes)
    x = torch.zeros(32)
    x[0], x[1] = 0.5, -6.0                                            # codes 1 and 0xF
    assert quantize(x, "mxfp4").data[0].item() == 0xF1


def test_views_interoperate_with_torch_fp4_and_e8m0_dtypes():
    x = torch.randn(4, 64)
    q = quantize(x, "mxfp4")
    fp4 = q.data_as_fp4x2()
    assert fp4.dtype == torch.float4_e2m1fn_x2 and torch.equal(fp4.view(torch.uint8), q.data)
    e8 = q.scale_as_e8m0()
    assert e8.dtype == torch.float8_e8m0fnu
    # torch's own E8M0 decoding agrees with ours for every byte (0 -> 2^-127, 255 -> NaN).
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours, torchs = e8m0_to_float(every), every.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], torchs[:255]) and ours[255].isnan() and torchs[255].isnan()
    # a checkpoint given as float4_e2m1fn_x2 / float8_e8m0fnu unpacks to the same codes and values
    assert torch.equal(unpack_fp4(fp4), unpack_fp4(q.data))
    q2 = QuantizedTensor(fp4, e8, "mxfp4", q.shape)
    assert q2.data.dtype == torch.uint8 and torch.equal(dequantize(q2), dequantize(q))
    qn = quantize(x, "nvfp4")
    assert torch.equal(qn.scale_as_e4m3().float(), qn.scale.view(torch.float8_e4m3fn).float())
    with pytest.raises(ValueError, match="mxfp4"):
        qn.scale_as_e8m0()


def test_e8m0_to_float_takes_torch_e8m0_as_its_bytes_and_refuses_float_values():
    """e8m0_to_float(float8_e8m0fnu) converted the scale VALUES to int and read them as bytes
    (1.0 -> byte 1 -> 2^-126; 2^127 -> int overflow -> 0.0), silently; a float scale tensor was
    read the same way. torch's E8M0 dtype is a view of the bytes (as for QuantizedTensor and
    unpack_fp4); other float dtypes are refused."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = [2.0 ** (b - 127) for b in range(255)]                    # hand decode; 255 is NaN
    got = e8m0_to_float(every.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float32 and got[:255].double().tolist() == want and got[255].isnan()
    assert _bits_equal(got[:255], e8m0_to_float(every)[:255])
    with pytest.raises(ValueError, match=r"e8m0_to_float needs uint8 .*E8M0 bytes.*got torch.float32"):
        e8m0_to_float(torch.ones(3))
    with pytest.raises(ValueError, match="bfloat16"):
        e8m0_to_float(torch.ones(3, dtype=torch.bfloat16))


# ---------------------------------------------------------------- MXFP4 scale rules


def test_mxfp4_all_zero_block_gets_smallest_scale():
    x = torch.zeros(2, 64)
    x[1, 40] = 1.0
    q = quantize(x, "mxfp4")
    assert q.scale.tolist() == [[0, 0], [0, 127 - 2]]                 # 1.0 <= 6 * 2^-2 = 1.5
    assert torch.equal(dequantize(q), x)


def test_mxfp4_values_at_six_and_just_above_do_not_clip():
    six = torch.tensor(6.0)
    above = torch.nextafter(six, torch.tensor(7.0))
    for amax, byte in ((six, 127), (above, 128), (six * 2**-5, 122), (torch.tensor(6.0001 * 2**-5), 123)):
        x = torch.zeros(32)
        x[5] = amax
        x[6] = -amax
        q = quantize(x, "mxfp4")
        assert q.scale.item() == byte, (float(amax), q.scale.item())
        deq = dequantize(q)
        # no clipping: the largest value comes back within half an E2M1 gap of its block scale
        assert abs(deq[5] - amax) <= 2.0 ** (byte - 127) and deq[6] == -deq[5]
    x = torch.zeros(32)
    x[0] = 7.9                                                        # OCP floor rule clips this
    assert dequantize(quantize(x, "mxfp4", scale_rule="floor"))[0] == 6.0
    assert dequantize(quantize(x, "mxfp4"))[0] == 8.0


def test_mxfp4_subnormal_inputs():
    tiny = torch.tensor([3 * 2.0**-128, 2.0**-149, -(2.0**-130), 1e-40], dtype=torch.float32)
    x = torch.zeros(32)
    x[:4] = tiny
    q = quantize(x, "mxfp4")
    assert q.scale.item() == 0                                       # 2^-127
    codes = unpack_fp4(q.data)[:4].tolist()
    assert codes == [3, 0, 8, 0]                                     # 1.5 * 2^-127, 0, -0, 0
    assert dequantize(q)[0].item() == 3 * 2.0**-128


def _e8m0_ldexp(byte: int) -> float:
    """Independent E8M0 decode (OCP MX): 2^(byte - 127) by math.ldexp in float64, byte 0 included
    (2^-127, not 0); 255 is NaN."""
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127)


def _tiny_blocks() -> torch.Tensor:
    """[8, 32] fp32 blocks whose amax sits at the bottom of the E8M0 range: 0, the smallest
    subnormal, subnormals, 2^-126 (the smallest normal), 6 * 2^-127 (the largest amax byte 0
    holds without clipping), the next fp32 above it (byte 1), and random values of each size."""
    g = torch.Generator().manual_seed(7)
    x = torch.zeros(8, 32)
    amaxes = [0.0, 2.0**-149, 2.0**-133, 2.0**-127, 2.0**-126, 6 * 2.0**-127,
              float(torch.nextafter(torch.tensor(6 * 2.0**-127), torch.tensor(1.0))), 2.0**-124]
    for i, a in enumerate(amaxes):
        x[i] = (torch.rand(32, generator=g) * 2 - 1) * a
        x[i, i] = -a if i % 2 else a
    return x


def test_e8m0_byte_0_decodes_to_2_pow_minus_127_and_tiny_blocks_encode_to_it():
    """E8M0 byte 0 is 2^-127 (an exact fp32 subnormal), not 0 (a decode by bits b << 23 gives 0):
    e8m0_to_float and mxfp4 dequantize on fresh random bytes plus 0, 1, 254, 255 against math.ldexp.
    Encode: a block whose ceil(log2(amax / 6)) is below -127 clamps to byte 0, and the codes are
    those of x * 2^127, so dequantize(quantize(x)) is what the oracle gives with byte 0 = 2^-127."""
    g = torch.Generator().manual_seed(29)
    edges = torch.tensor([0, 1, 254, 255, 0, 127], dtype=torch.uint8)
    b = torch.cat([edges, torch.randint(0, 256, (58,), generator=g, dtype=torch.uint8)])
    want = torch.tensor([_e8m0_ldexp(v) for v in b.tolist()], dtype=torch.float64)
    for scale in (b, b.view(torch.float8_e8m0fnu)):
        got = e8m0_to_float(scale)
        assert got.dtype == torch.float32 and torch.equal(torch.isnan(got), torch.isnan(want))
        assert got.double()[~torch.isnan(want)].tolist() == want[~torch.isnan(want)].tolist()
    assert e8m0_to_float(edges)[0].item() == 2.0**-127 != 0
    codes = torch.randint(0, 16, (64, 32), generator=g, dtype=torch.uint8)
    q = QuantizedTensor(pack_fp4(codes), b.reshape(64, 1), "mxfp4", torch.Size((64, 32)))
    vals = torch.tensor(decode_codes(codes.reshape(-1).tolist()), dtype=torch.float64).reshape(64, 32)
    exact = (vals * want[:, None]).float()                            # fp32 rounding: 6 * 2^127 -> inf
    deq = dequantize(q, torch.float32)
    assert torch.equal(torch.isnan(deq), torch.isnan(exact)) and _bits_equal(deq[~deq.isnan()], exact[~exact.isnan()])
    # encode: tiny blocks clamp to byte 0 and round-trip through the same 2^-127
    x = _tiny_blocks()
    qx = quantize(x, "mxfp4", backend="torch")
    assert qx.scale.reshape(-1).tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    ocodes, oscales = oracle_mxfp4(x.numpy().reshape(-1))
    assert qx.scale.reshape(-1).tolist() == oscales and unpack_fp4(qx.data).reshape(-1).tolist() == ocodes
    back = [v * _e8m0_ldexp(oscales[i // 32]) for i, v in enumerate(decode_codes(ocodes))]
    assert dequantize(qx, torch.float64).reshape(-1).tolist() == back
    assert dequantize(qx)[5, 5].item() == -6 * 2.0**-127                 # the largest byte-0 value, exact
    on_grid = torch.tensor([2.0**-128, -(2.0**-127), 1.5 * 2.0**-127, 3 * 2.0**-127, 6 * 2.0**-127] + [0.0] * 27)
    assert torch.equal(dequantize(quantize(on_grid, "mxfp4", backend="torch")), on_grid)
    assert quantize(on_grid, "mxfp4", scale_rule="floor", backend="torch").scale.item() == 0


def test_negative_zero_keeps_its_sign():
    x = torch.zeros(32)
    x[0] = -0.0
    x[1] = -1e-3                                                      # rounds to -0 in its block
    x[2] = 6.0
    q = quantize(x, "mxfp4")
    assert unpack_fp4(q.data)[:3].tolist() == [8, 8, 7]
    deq = dequantize(q)
    assert torch.signbit(deq[0]) and torch.signbit(deq[1]) and deq[0] == 0
    qn = quantize(x, "nvfp4")
    assert unpack_fp4(qn.data)[:2].tolist() == [8, 8] and torch.signbit(dequantize(qn)[0])


def test_round_to_e2m1_of_every_float_dtype():
    """round_to_e2m1 read the sign by viewing y as int32: a bf16 / fp16 row of 2 values became one
    int32 whose sign went to both codes ([-1, 2] -> [2, 4]), other shapes (and float64) raised a
    broadcasting RuntimeError. Each dtype now gives the codes of its own values (all of them are
    exact in the dtype, and so are the E2M1 midpoints), checked against the oracle."""
    from moe.quant import round_to_e2m1

    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = [0.0, -0.0, 6.0, 7.0, 4096.0, float("inf"), float("-inf"), float("nan"), 2.0**-20, -(2.0**-20)]
    vals += mids + [-m for m in mids] + [m * (1 + 2.0**-5) for m in mids] + [-m * (1 - 2.0**-5) for m in mids]
    want = [0 if math.isnan(v) else oracle_e2m1_code(v) for v in vals]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        y = torch.tensor(vals, dtype=dtype)
        assert torch.equal(y.double().nan_to_num(0.0), torch.tensor(vals, dtype=torch.float64).nan_to_num(0.0))   # exact
        assert round_to_e2m1(y).tolist() == want, dtype
        assert round_to_e2m1(y[:2].reshape(1, 2)).tolist() == [want[:2]], dtype
        pair = torch.tensor([[-1.0, 2.0]], dtype=dtype)
        assert round_to_e2m1(pair).tolist() == [[10, 4]], dtype


def test_nan_block_dequantizes_to_nan_and_spares_other_blocks():
    x = torch.randn(64)
    x[3] = float("nan")
    q = quantize(x, "mxfp4")
    assert q.scale[0].item() == 255
    deq = dequantize(q)
    assert deq[:32].isnan().all() and not deq[32:].isnan().any()
    qn = quantize(torch.where(torch.arange(64) == 3, float("nan"), torch.randn(64)), "nvfp4", global_scale=0.01)
    d = dequantize(qn)
    assert d[:16].isnan().all() and not d[16:].isnan().any()


@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_mxfp4_matches_oracle_on_random_blocks(rule):
    g = torch.Generator().manual_seed(1)
    mags = torch.exp2(torch.randint(-30, 30, (12, 1), generator=g).float())
    x = torch.randn(12, 64, generator=g) * mags
    x[0, :32] = 0
    x[1, 3] = 6 * 2.0**-3                                              # exact power-of-two boundary
    q = quantize(x, "mxfp4", scale_rule=rule)
    codes, scales = oracle_mxfp4(x.numpy().reshape(-1), rule)
    assert unpack_fp4(q.data).reshape(-1).tolist() == codes
    assert q.scale.reshape(-1).tolist() == scales
    want = [v * 2.0 ** (scales[i // 32] - 127) for i, v in enumerate(decode_codes(codes))]
    assert dequantize(q, torch.float64).reshape(-1).tolist() == want


def test_dequantize_accepts_any_e8m0_byte():
    """Checkpoints made with other rules: every byte 0..254 and every code decode exactly."""
    g = torch.Generator().manual_seed(2)
    scale = torch.arange(255, dtype=torch.int32).to(torch.uint8).reshape(255, 1)
    codes = torch.randint(0, 16, (255, 32), generator=g, dtype=torch.uint8)
    q = QuantizedTensor(pack_fp4(codes), scale, "mxfp4", torch.Size((255, 32)))
    deq = dequantize(q, torch.float64)                               # fp32 math, exact as doubles
    for b in (0, 1, 100, 127, 200, 254):
        want = [v * 2.0 ** (b - 127) for v in decode_codes(codes[b].tolist())]
        got = deq[b].tolist()
        assert all(w == gv or (math.isinf(w) and w == gv) or (abs(w) > 3.4e38 and math.isinf(gv))
                   for w, gv in zip(want, got)), b


# ---------------------------------------------------------------- NVFP4


def test_nvfp4_matches_oracle():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 48, generator=g) * torch.exp2(torch.randint(-8, 8, (6, 1), generator=g).float())
    x[2, :16] = 0
    q = quantize(x, "nvfp4")
    codes, svals, gs = oracle_nvfp4(x.numpy().reshape(-1))
    assert q.global_scale.item() == float(gs) and q.global_scale.dim() == 0
    assert q.scale.view(torch.float8_e4m3fn).float().reshape(-1).tolist() == svals
    assert unpack_fp4(q.data).reshape(-1).tolist() == codes
    want = [float(f32(f32(v) * f32(svals[i // 16])) * gs) for i, v in enumerate(decode_codes(codes))]
    assert dequantize(q).reshape(-1).tolist() == want


def test_nvfp4_rounds_midpoints_from_the_exact_quotient():
    """fp32 rounds s * g = 448 * RN(1/448) to exactly 1.0, which makes 1.75 and 3.5 ties (-> 4, 6);
    the exact quotients are just below them (-> 3, 5)."""
    x = torch.tensor([6.0, 1.75, 3.5] + [0.0] * 13)
    q = quantize(x, "nvfp4")
    assert unpack_fp4(q.data)[:3].tolist() == [7, 3, 5]
    assert unpack_fp4(q.data).tolist() == oracle_nvfp4(x.numpy())[0]
    # many tensor scales; values at RN32(m * s * g) for every midpoint m and their fp32 neighbours
    g = torch.Generator().manual_seed(5)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    for gv in (torch.rand(12, generator=g) * 0.01 + 1e-4).tolist():
        d = 448.0 * float(f32(gv))
        blk = torch.cat([torch.tensor([6 * d]), mids * d, torch.zeros(8, dtype=torch.float64)]).float()
        x = torch.cat([blk, torch.nextafter(blk, torch.full_like(blk, 1e9)),
                       -torch.nextafter(blk, torch.zeros_like(blk))])
        q = quantize(x, "nvfp4", global_scale=gv)
        codes, svals, _ = oracle_nvfp4(x.numpy(), gv)
        assert q.scale.view(torch.float8_e4m3fn).float().tolist() == svals
        assert unpack_fp4(q.data).tolist() == codes, gv


def test_nvfp4_zeros_and_bad_global_scale():
    for shape, opts in (((4, 32), {}), ((2, 3, 16), {"global_scale": "matrix"})):
        q = quantize(torch.zeros(shape), "nvfp4", **opts)
        assert (q.global_scale == 0).all() and (q.scale == 0).all() and (q.data == 0).all()
        d = dequantize(q)
        assert not torch.isnan(d).any() and (d == 0).all()          # zeros, not NaN block scales
    for bad in (0.0, -1.0, float("nan"), torch.tensor([0.1, -0.1])):
        with pytest.raises(ValueError, match="global_scale must be > 0"):
            quantize(torch.randn(2, 4, 16), "nvfp4", global_scale=bad)


def test_nvfp4_rejects_a_non_finite_given_global_scale():
    """A given tensor scale of inf (or one that overflows fp32) made every block scale
    amax / 6 / inf = 0 and every dequantized value (e2m1 * 0) * inf = NaN, silently."""
    x = torch.randn(2, 4, 16)
    for bad in (float("inf"), 1e39, torch.tensor([0.1, float("inf")]), torch.tensor([-float("inf")])):
        with pytest.raises(ValueError, match="global_scale must be > 0"):
            quantize(x, "nvfp4", global_scale=bad)
    q = quantize(x, "nvfp4", global_scale=torch.tensor([0.01, 3e38]))   # large but finite: accepted
    assert not dequantize(q)[0].isnan().any()


def test_nvfp4_per_matrix_global_scale():
    x = torch.randn(3, 4, 32) * torch.tensor([1.0, 100.0, 1e-3]).reshape(3, 1, 1)
    q = quantize(x, "nvfp4", global_scale="matrix")
    assert q.global_scale.shape == (3,)
    for e in range(3):
        qe = quantize(x[e], "nvfp4")
        assert torch.equal(q.data[e], qe.data) and torch.equal(q.scale[e], qe.scale)
        assert torch.equal(dequantize(q)[e], dequantize(qe))


# ---------------------------------------------------------------- FP8


def oracle_fp8_rows(rows: np.ndarray, ue8m0: bool) -> tuple[list[float], list[float]]:
    """rows: [R, G] float32, one scale per row -> (scales, dequantized values)."""
    scales, out = [], []
    for r in rows:
        amax = max(f32(np.abs(r).max()), f32(1e-12))
        if ue8m0:
            e = math.ceil(math.log2(amax / 448))
            while 448 * 2.0**e < amax:
                e += 1
            while 448 * 2.0 ** (e - 1) >= amax:
                e -= 1
            s = f32(2.0**e)
        else:
            s = f32(amax) / f32(448)
        scales.append(float(s))
        out += [float(f32(oracle_e4m3(float(max(min(f32(v) / s, 448), -448)))) * s) for v in r]
    return scales, out


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_token_and_group_match_oracle(ue8m0):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 200, generator=g) * torch.exp2(torch.randint(-10, 10, (5, 1), generator=g).float())
    x[1] = 0
    x[2, 7] = 1e-3 * 2.0**-140                                        # subnormal-ish tiny row
    qt = quantize(x, "fp8_token", ue8m0=ue8m0)
    scales, want = oracle_fp8_rows(x.numpy(), ue8m0)
    assert qt.scale.shape == (5, 1) and qt.scale.reshape(-1).tolist() == scales
    assert torch.equal(dequantize(qt, torch.float64).reshape(-1), torch.tensor(want, dtype=torch.float64))
    qg = quantize(x, "fp8_group", ue8m0=ue8m0)                        # K=200: groups 128 + 72
    assert qg.scale.shape == (5, 2)
    for grp, (lo, hi) in enumerate(((0, 128), (128, 200))):
        scales, want = oracle_fp8_rows(x[:, lo:hi].numpy(), ue8m0)
        assert qg.scale[:, grp].tolist() == scales
        assert torch.equal(dequantize(qg, torch.float64)[:, lo:hi].reshape(-1), torch.tensor(want, dtype=torch.float64))
    if ue8m0:
        m, _ = torch.frexp(qg.scale)
        assert (m == 0.5).all()


def test_fp8_block_partial_tiles_match_oracle():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 130, 260, generator=g)
    x[1, 128:, 256:] *= 1000
    q = quantize(x, "fp8_block")
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 2, 3)
    deq = dequantize(q)
    for e, (i, j) in ((1, (1, 2)), (0, (0, 1)), (1, (0, 0))):
        tile = x[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
        scales, want = oracle_fp8_rows(tile.reshape(1, -1).numpy(), False)
        assert q.scale[e, i, j].item() == scales[0]
        assert torch.equal(deq[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].reshape(-1), torch.tensor(want))


def test_fp8_amax_floor_that_gives_no_finite_nonzero_scale_is_refused():
    """amax_floor = 1e-44 passed the "> 0" check, but 1e-44 / 448 is 0 in fp32: an all-zero row
    quantized to 0 / 0 = NaN. An infinite floor made every scale inf and every value 0."""
    x = torch.zeros(2, 128)
    x[1, 0] = 1.0
    for fmt in ("fp8_token", "fp8_group", "fp8_block"):
        for bad in (1e-44, 1e-45, float("inf"), 1e39, 0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="amax_floor must be > 0 and finite"):
                quantize(x, fmt, amax_floor=bad)
        q = quantize(x, fmt, amax_floor=1e-40)                       # subnormal scale, still > 0
        assert q.scale.min() > 0 and torch.equal(dequantize(q), x)


# ---------------------------------------------------------------- error bounds (hypothesis)

# |x| <= 2^120 after the shift below: near fp32's max a value may round up to 4 * 2^126 = inf
_finite32 = st.floats(min_value=-(2.0**80), max_value=2.0**80, allow_nan=False, allow_infinity=False, width=32)
_rows = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])), elements=_finite32)


@settings(max_examples=60, deadline=None)
@given(_rows, st.integers(-40, 40))
def test_mxfp4_error_bound_and_oracle(x, shift):
    x = torch.from_numpy(x) * 2.0**shift
    x = torch.where(torch.isfinite(x), x, 0.0)
    q = quantize(x, "mxfp4")
    err = (dequantize(q, torch.float64) - x.double()).abs()
    step = e8m0_to_float(q.scale).double().repeat_interleave(32, -1)
    half_gap = torch.where(x.abs() >= 4 * step, 1.0, torch.where(x.abs() >= 2 * step, 0.5, 0.25)) * step
    assert (err <= half_gap).all()
    codes, scales = oracle_mxfp4(x.numpy().reshape(-1))
    assert unpack_fp4(q.data).reshape(-1).tolist() == codes and q.scale.reshape(-1).tolist() == scales


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.sampled_from([(2, 32), (1, 64)]),
                  elements=st.floats(-1e4, 1e4, allow_nan=False, width=32)))
def test_nvfp4_error_bound(x):
    x = torch.from_numpy(x)
    q = quantize(x, "nvfp4")
    denom = (q.scale.view(torch.float8_e4m3fn).float() * q.global_scale).double().repeat_interleave(16, -1)
    err = (dequantize(q, torch.float64) - x.double()).abs()
    # half an E2M1 gap (<= 1 unit), or saturation where the E4M3 block scale rounded down
    assert (err <= denom + (x.abs().double() - 6 * denom).clamp(min=0) + 1e-30).all()
    # the block scale itself: E4M3 rounding of amax/6/g, relative 2^-4 or absolute 2^-10
    amax = x.abs().reshape(*x.shape[:-1], -1, 16).amax(-1).double().repeat_interleave(16, -1)
    g = q.global_scale.double()
    assert (denom <= (amax / 6) * (1 + 2.0**-4) * (1 + 1e-6) + 2.0**-10 * g).all()


@settings(max_examples=40, deadline=None)
@given(_rows, st.sampled_from(["fp8_token", "fp8_group"]), st.booleans())
def test_fp8_relative_error_bound(x, fmt, ue8m0):
    x = torch.from_numpy(x)
    q = quantize(x, fmt, ue8m0=ue8m0)
    err = (dequantize(q, torch.float64) - x.double()).abs()
    scale = q.scale.double().expand(x.shape) if fmt == "fp8_token" else q.scale.double().repeat_interleave(128, -1)[:, : x.shape[1]]
    # E4M3: relative half-ulp 2^-4 for normals, absolute 2^-10 * scale in the subnormal range
    assert (err <= torch.maximum(x.abs().double() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)).all()


# ---------------------------------------------------------------- MXFP4 -> FP8 fold


def test_fold_is_exact_when_block_exponents_span_at_most_14():
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (4, 256), generator=g, dtype=torch.uint8)
    base = torch.randint(20, 200, (4, 1), generator=g)
    scale = (base + torch.randint(0, 15, (4, 8), generator=g)).to(torch.uint8)   # spread <= 14 per row
    q = QuantizedTensor(pack_fp4(codes), scale, "mxfp4", torch.Size((4, 256)))
    scale_t = (base[0] + torch.randint(0, 15, (4, 8), generator=g)).to(torch.uint8)  # and per 128x128 tile
    q_t = QuantizedTensor(pack_fp4(codes), scale_t, "mxfp4", torch.Size((4, 256)))
    for tile_rows, q in ((1, q), (128, q_t)):
        f = mxfp4_to_fp8_block(q, tile_rows=tile_rows, strict=True)
        assert f.fmt == ("fp8_group" if tile_rows == 1 else "fp8_block")
        assert torch.equal(dequantize(f), dequantize(q))
        m, _ = torch.frexp(f.scale)
        assert (m == 0.5).all()                                      # power-of-two scales
    plan = mxfp4_fold_plan(scale)
    assert plan.shift.max() <= 6 and plan.scale.shape == (4, 2)


def test_fold_rounds_or_raises_beyond_the_exact_span():
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 0] = 7                                                   # 6 * 2^e_max
    codes[0, 32], codes[0, 33], codes[0, 34] = 1, 3, 2                # 0.5, 1.5, 1.0 * 2^(e_max - 15)
    scale = torch.tensor([[150, 135, 150, 150]], dtype=torch.uint8)   # spread 15
    q = QuantizedTensor(pack_fp4(codes), scale, "mxfp4", torch.Size((1, 128)))
    with pytest.raises(ValueError, match="inexact"):
        mxfp4_to_fp8_block(q, strict=True)
    f = mxfp4_to_fp8_block(q)
    ref = f.scale.item()
    got = (f.data.float() * ref)[0, 32:35].tolist()
    want = [oracle_e4m3(v * 2.0 ** (135 - 127) / ref) * ref for v in (0.5, 1.5, 1.0)]
    assert got == want and got[0] == 0.0 and got[2] == 2.0 ** (135 - 127)  # 2^-10 ties to 0; 2^-9 exact


def test_fold_of_quantized_weights_matches_dequantize():
    w = torch.randn(2, 130, 288)                                      # partial row tile and K group
    q = quantize(w, "mxfp4")
    for tile_rows, scale_shape in ((1, (2, 130, 3)), (128, (2, 2, 3))):
        f = mxfp4_to_fp8_block(q, tile_rows=tile_rows, strict=True)
        assert f.scale.shape == scale_shape and torch.equal(dequantize(f), dequantize(q))


# ---------------------------------------------------------------- API and errors


def test_bad_inputs_raise_value_errors_naming_choices():
    with pytest.raises(ValueError, match="valid formats: mxfp4"):
        quantize(torch.randn(4, 32), "int4")
    with pytest.raises(ValueError, match=r"K \(33\).*32"):
        quantize(torch.randn(4, 33), "mxfp4")
    with pytest.raises(ValueError, match="16"):
        quantize(torch.randn(4, 40), "nvfp4")
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.ones(4, 32, dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="2 dims"):
        quantize(torch.randn(32), "fp8_block")
    with pytest.raises(ValueError, match="valid: auto, triton, torch"):
        quantize(torch.randn(4, 32), "mxfp4", backend="cuda")
    with pytest.raises(ValueError, match="scale_rule"):
        quantize(torch.randn(4, 32), "mxfp4", scale_rule="round")
    q = quantize(torch.randn(4, 32), "mxfp4")
    with pytest.raises(ValueError, match="scale"):
        dequantize(QuantizedTensor(q.data, q.scale[:, :0], "mxfp4", q.shape))


def test_quantized_tensor_helpers():
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    for fmt in FORMATS:
        q = quantize(x, fmt)
        assert q.shape == x.shape and q.fmt == fmt and dequantize(q, torch.bfloat16).dtype == torch.bfloat16
        assert q.to("cpu").data.data_ptr() == q.data.data_ptr() and fmt in repr(q)
        assert torch.equal(q.dequantize(), dequantize(q))
    for fmt in FORMATS:                                               # empty tensors keep their shapes
        e = quantize(torch.empty(2, 0, 128), fmt)
        assert e.data.shape[:2] == (2, 0) and dequantize(e).shape == (2, 0, 128)
    q = quantize(x, "mxfp4")
    assert q.nbytes == 2 * 8 * 32 + 2 * 8 * 2
    assert quantize(x, "nvfp4").nbytes == 2 * 8 * 32 + 2 * 8 * 4 + 4


def test_formats_live_in_parallel_quant_and_moe_quant_reexports_them():
    import moe.quant
    import parallel.quant
    from moe.quant import reference as mref
    from parallel.quant import reference as pref

    for name in ("quantize", "dequantize", "QuantizedTensor", "mxfp4_to_fp8_block", "E4M3_MAX", "FORMATS"):
        assert getattr(moe.quant, name) is getattr(parallel.quant, name)
    assert mref is pref


def test_sp_and_dcp_fp8_quantizers_are_the_fp8_token_format():
    from parallel.cp.dcp import _quantize_fp8
    from parallel.quant import DEFAULT_AMAX_FLOOR, E4M3_MAX
    from parallel.sp.fp8 import quantize_fp8_per_token, quantize_fp8_weight

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 64, generator=g) * torch.logspace(-3, 3, 6)[:, None, None]
    x[2, 1] = 0.0
    amax = x.abs().amax(-1, keepdim=True).clamp(min=DEFAULT_AMAX_FLOOR)
    scale = amax / E4M3_MAX                                        # independent of parallel.quant's code
    data = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    a = quantize_fp8_per_token(x)
    assert torch.equal(a.scale, scale) and torch.equal(a.data.view(torch.uint8), data.view(torch.uint8))
    kq, ks = _quantize_fp8(x)
    assert torch.equal(ks, scale[..., 0]) and torch.equal(kq.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(ks[2, 1], torch.tensor(DEFAULT_AMAX_FLOOR) / E4M3_MAX) and (kq[2, 1].float() == 0).all()
    w = x[:, 0].t()                                                # [K=64, N=6]: one scale per column
    qw = quantize_fp8_weight(w)
    assert qw.scale.shape == (1, 6) and torch.equal(qw.scale[0], scale[:, 0, 0]) and qw.data.t().is_contiguous()
    assert torch.equal(qw.data.view(torch.uint8), data[:, 0].t().view(torch.uint8))
