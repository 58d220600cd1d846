"""LSE merging (docs/numerics.md §7): torch reference, and the Triton kernel (interpreter here, CUDA on GPU)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from parallel.cp import merge_attn_states, merge_two_attn_states
from tests.helpers import reference_attention

LN2 = math.log(2.0)


def _partials_over_key_splits(seed: int, splits: list[int], *, t: int = 5, h: int = 3, d: int = 8):
    """Partial attentions over disjoint key sets (one set may be empty) and the full attention."""
    gen = torch.Generator().manual_seed(seed)
    sk = sum(splits)
    q = torch.randn(t, h, d, generator=gen)
    k = torch.randn(sk, h, d, generator=gen) * 2
    v = torch.randn(sk, h, d, generator=gen)
    outs, lses, start = [], [], 0
    for n in splits:
        o, l = reference_attention(q, k[start:start + n], v[start:start + n], causal=False)
        if n == 0:   # empty key set: what kernels report
            o, l = torch.full_like(o, float("nan")), torch.full_like(l, float("inf"))
        outs.append(o.float())
        lses.append(l.float())
        start += n
    full = reference_attention(q, k, v, causal=False)
    return torch.stack(outs), torch.stack(lses), full


@pytest.mark.parametrize("base", ["e", "2"])
def test_merge_equals_one_softmax_over_all_keys(base):
    outs, lses, (full_out, full_lse) = _partials_over_key_splits(0, [3, 0, 7, 1])
    if base == "2":
        lses = lses / LN2
    out, lse = merge_attn_states(outs, lses, base=base)
    torch.testing.assert_close(out.double(), full_out, rtol=0, atol=2e-6)
    expect_lse = full_lse / LN2 if base == "2" else full_lse
    torch.testing.assert_close(lse.double(), expect_lse, rtol=0, atol=2e-6)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_two_way_merge_equals_n_way_and_accumulates_in_place():
    outs, lses, _ = _partials_over_key_splits(1, [4, 5])
    expect = merge_attn_states(outs, lses)
    acc, acc_lse = outs[0].clone(), lses[0].clone()
    res = merge_two_attn_states(acc, acc_lse, outs[1], lses[1], out=acc, out_lse=acc_lse)
    assert res.out.data_ptr() == acc.data_ptr() and res.lse.data_ptr() == acc_lse.data_ptr()
    torch.testing.assert_close(acc, expect.out, rtol=0, atol=1e-6)
    torch.testing.assert_close(acc_lse, expect.lse, rtol=0, atol=1e-6)


def test_plus_inf_and_minus_inf_lse_count_as_empty_and_all_empty_rows_give_zero():
    gen = torch.Generator().manual_seed(2)
    outs = torch.randn(3, 4, 2, 6, generator=gen)
    lses = torch.randn(3, 4, 2, generator=gen)
    lses[1, 0, 0] = -float("inf")
    outs[1, 0, 0] = float("nan")          # garbage out of an empty partial must not leak
    lses[2, 1, 1] = float("inf")
    outs[2, 1, 1] = float("inf")
    lses[:, 3, :] = torch.tensor([-float("inf"), float("inf"), -float("inf")])[:, None]   # row empty everywhere
    outs[:, 3, :] = float("nan")
    out, lse = merge_attn_states(outs, lses)
    keep = merge_attn_states(outs[[0, 2]], lses[[0, 2]])
    torch.testing.assert_close(out[0, 0], keep.out[0, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(lse[0, 0], keep.lse[0, 0], rtol=0, atol=1e-6)
    keep = merge_attn_states(outs[[0, 1]], lses[[0, 1]])
    torch.testing.assert_close(out[1, 1], keep.out[1, 1], rtol=0, atol=1e-6)
    assert torch.equal(out[3], torch.zeros(2, 6)) and (lse[3] == -math.inf).all()
    assert torch.isfinite(out[:3]).all()


def _nan_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three partials [3, T=4, H=2, D=6] with a NaN lse at (t=0, h=0) of partial 1 (its out is
    finite), an empty (+inf) partial at (1, 1), a row empty everywhere (t=3) -> the expected
    (out, lse) from the formula in float64, rows with a NaN lse NaN."""
    gen = torch.Generator().manual_seed(12)
    outs = torch.randn(3, 4, 2, 6, generator=gen)
    lses = torch.randn(3, 4, 2, generator=gen) * 3
    lses[1, 0, 0] = float("nan")
    lses[2, 1, 1] = float("inf")
    outs[2, 1, 1] = float("nan")
    lses[:, 3, :] = -float("inf")
    outs[:, 3, :] = float("nan")
    l64 = lses.double()
    empty = torch.isinf(l64)
    m = torch.where(empty, -math.inf, l64).amax(0)
    w = torch.where(empty, 0.0, torch.exp(l64 - torch.where(torch.isinf(m), 0.0, m)))     # NaN stays NaN
    total = w.sum(0)
    want_out = (torch.where(w[..., None] > 0, outs.double(), 0.0) * (w / total.clamp_min(1e-300))[..., None]).sum(0)
    want_lse = torch.where(total > 0, m + torch.log(total), -math.inf)
    nan_row = torch.isnan(l64).any(0)
    want_out = torch.where(nan_row[..., None], math.nan, want_out)
    want_lse = torch.where(nan_row, math.nan, want_lse)
    return outs, lses, want_out, want_lse


def _check_nan_case(out: torch.Tensor, lse: torch.Tensor, want_out: torch.Tensor, want_lse: torch.Tensor) -> None:
    assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0]), (out[0, 0], lse[0, 0])
    assert torch.equal(out[3], torch.zeros(2, 6, dtype=out.dtype)) and (lse[3] == -math.inf).all()
    assert torch.isfinite(out[:3].flatten(0, 1)[1:]).all()          # the NaN stays on its row
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-6, equal_nan=True)


def test_a_nan_lse_propagates_to_its_row_and_is_not_an_empty_partial():
    outs, lses, want_out, want_lse = _nan_case()
    got = merge_attn_states(outs, lses, backend="torch")
    _check_nan_case(got.out, got.lse, want_out, want_lse)
    # two-way, and the lse part alone (what the DCP all-gather + reduce-scatter path uses)
    pair = merge_two_attn_states(outs[0], lses[0], outs[1], lses[1], backend="torch")
    assert torch.isnan(pair.out[0, 0]).all() and torch.isnan(pair.lse[0, 0])
    assert torch.isfinite(pair.out[:3].flatten(0, 1)[1:]).all()
    from parallel.cp.merge import combine_lse

    lse, nonempty, scales = combine_lse(list(lses.unbind(0)))
    assert torch.isnan(lse[0, 0]) and bool(nonempty[0, 0]) and all(torch.isnan(s[0, 0]) for s in scales)
    assert not bool(nonempty[3].any()) and all((s[3] == 0).all() for s in scales)


def test_a_nan_lse_propagates_in_the_triton_kernels_under_interpreter(monkeypatch):
    mod = _triton_merge_module(monkeypatch)
    outs, lses, want_out, want_lse = _nan_case()
    got = mod.merge_states_triton(outs, lses)                                       # N-way kernel
    _check_nan_case(got.out, got.lse, want_out, want_lse)
    pair = mod.merge_states_triton([outs[0], outs[1]], [lses[0], lses[1]])           # pair kernel
    expect = merge_two_attn_states(outs[0], lses[0], outs[1], lses[1], backend="torch")
    assert torch.isnan(pair.out[0, 0]).all() and torch.isnan(pair.lse[0, 0])
    torch.testing.assert_close(pair.out, expect.out, rtol=0, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(pair.lse, expect.lse, rtol=0, atol=1e-6, equal_nan=True)


def test_large_lse_values_do_not_overflow_and_one_partial_passes_through():
    outs = torch.randn(2, 3, 1, 4)
    lses = torch.tensor([[[9000.0], [-60.0], [100.0]], [[-float("inf")], [-60.0 + math.log(3.0)], [100.0]]])
    out, lse = merge_attn_states(outs, lses)
    torch.testing.assert_close(out[0], outs[0, 0], rtol=0, atol=0)        # the other partial is empty
    assert lse[0, 0].item() == 9000.0
    torch.testing.assert_close(out[1], 0.25 * outs[0, 1] + 0.75 * outs[1, 1], rtol=0, atol=2e-5)
    torch.testing.assert_close(lse[1, 0], torch.tensor(-60.0 + math.log(4.0)), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[2], 0.5 * (outs[0, 2] + outs[1, 2]), rtol=0, atol=1e-6)
    assert lse[2, 0].item() == pytest.approx(100.0 + math.log(2.0), abs=1e-5)


def test_low_precision_outs_keep_their_dtype_with_fp32_lse():
    outs, lses, (full_out, _) = _partials_over_key_splits(3, [6, 6])
    out, lse = merge_attn_states(outs.bfloat16(), lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), full_out, rtol=0, atol=2e-2)


def test_fp32_accumulator_merges_with_a_low_precision_block():
    outs, lses, _ = _partials_over_key_splits(4, [5, 6])
    block = outs[1].bfloat16()
    expect = merge_two_attn_states(outs[0], lses[0], block.float(), lses[1])
    acc = outs[0].clone()
    merge_two_attn_states(acc, lses[0].clone(), block, lses[1], out=acc)
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc, expect.out, rtol=0, atol=1e-6)


def test_merge_rejects_bad_input():
    outs, lses = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="base"):
        merge_attn_states(outs, lses, base="10")
    with pytest.raises(ValueError, match="lse"):
        merge_attn_states(outs, lses[:, :2])
    with pytest.raises(ValueError, match="out has shape"):
        merge_attn_states(outs, lses, out=torch.empty(3, 4, 4))
    with pytest.raises(ValueError, match="unknown implementation 'cuda'; valid: auto, triton, torch"):
        merge_attn_states(outs, lses, backend="cuda")


def test_merge_rejects_out_buffers_of_an_integer_dtype_or_another_device():
    """`out` is documented as any float dtype on the inputs' device: an int buffer truncated the
    merged values silently, one on another device took them nowhere (meta) or crashed the kernel.
    A valid bf16 `out` gets the exact LSE merge, checked against the formula in float64."""
    gen = torch.Generator().manual_seed(21)
    outs, lses = torch.randn(3, 4, 2, 6, generator=gen), torch.randn(3, 4, 2, generator=gen) * 3
    lses[:, 1, 0] = -math.inf                                       # a row empty everywhere
    with pytest.raises(ValueError, match=r"out must have a float dtype, got torch.int32"):
        merge_attn_states(outs, lses, out=torch.zeros(4, 2, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out is on meta, the inputs on cpu"):
        merge_attn_states(outs, lses, out=torch.empty(4, 2, 6, device="meta"))
    with pytest.raises(ValueError, match=r"out_lse is on meta, the inputs on cpu"):
        merge_attn_states(outs, lses, out_lse=torch.empty(4, 2, device="meta"))
    out, out_lse = torch.full((4, 2, 6), 7.0, dtype=torch.bfloat16), torch.full((4, 2), 7.0)
    merge_attn_states(outs, lses, out=out, out_lse=out_lse)
    l64 = lses.double()
    want_lse = torch.logsumexp(l64, dim=0)                          # -inf on the empty row
    w = torch.exp(l64 - torch.where(torch.isinf(want_lse), 0.0, want_lse)).nan_to_num(0.0)
    want_out = (w[..., None] * outs.double()).sum(0)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2e-2)
    torch.testing.assert_close(out_lse.double(), want_lse, rtol=0, atol=1e-5)
    assert torch.equal(out[1, 0], torch.zeros(6, dtype=torch.bfloat16)) and out_lse[1, 0] == -math.inf


def _triton_merge_module(monkeypatch):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CUDA test covers the kernel on this machine")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import sys

    sys.modules.pop("parallel.cp.triton_merge", None)   # decorate the kernels in interpreter mode
    return importlib.import_module("parallel.cp.triton_merge")


def _edge_case_states(seed: int, n: int, t: int = 6, h: int = 3, d: int = 20):
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, t, h, d, generator=gen)
    lses = torch.randn(n, t, h, generator=gen) * 4
    lses[0, 0, 0] = float("nan")
    lses[-1, 1, 2] = float("inf")
    outs[-1, 1, 2] = float("nan")
    lses[:, 2, 1] = -float("inf")
    outs[:, 2, 1] = float("nan")
    if n >= 3:           # a row whose first inputs are empty (garbage outs) and later ones are not
        lses[:2, 3, 0] = -float("inf")
        outs[:2, 3, 0] = float("nan")
    return outs, lses


@pytest.mark.parametrize("base", ["e", "2"])
def test_triton_merge_matches_torch_under_interpreter(monkeypatch, base):
    """The N-way kernel against the torch merge, with NaN, +inf and all-empty rows among the inputs
    (the garbage outs of empty inputs must not leak), and N up to 5 (the first inputs of a row empty)."""
    mod = _triton_merge_module(monkeypatch)
    for n in (1, 2, 3, 5):
        outs, lses = _edge_case_states(n, n)
        expect = merge_attn_states(outs, lses, base=base, backend="torch")
        got = mod.merge_states_triton(outs, lses, base=base)                      # stacked (N-way kernel)
        torch.testing.assert_close(got.out, expect.out, rtol=0, atol=1e-6, equal_nan=True)   # row (0, 0): NaN
        torch.testing.assert_close(got.lse, expect.lse, rtol=0, atol=1e-6, equal_nan=True)
    # pair kernel, strided inputs ([T, H, D] views of [H, T, D] memory), in place into the first
    outs, lses = _edge_case_states(7, 2)
    a = outs[0].transpose(0, 1).contiguous().transpose(0, 1)
    la = lses[0].t().contiguous().t()
    expect = merge_two_attn_states(outs[0], lses[0], outs[1], lses[1], base=base, backend="torch")
    merge_two_attn_states(a, la, outs[1], lses[1], base=base, backend="triton", out=a, out_lse=la)
    torch.testing.assert_close(a, expect.out, rtol=0, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(la, expect.lse, rtol=0, atol=1e-6, equal_nan=True)
    # fp32 accumulator + fp16 block (the interpreter mishandles bf16), as the ring merges
    block = outs[1].half()
    expect = merge_two_attn_states(outs[0], lses[0], block.float(), lses[1], base=base, backend="torch")
    acc = outs[0].clone()
    merge_two_attn_states(acc, lses[0].clone(), block, lses[1], base=base, backend="triton", out=acc)
    torch.testing.assert_close(acc, expect.out, rtol=0, atol=1e-6, equal_nan=True)


def test_min_programs_shrinks_only_small_merges_and_keeps_every_bit(monkeypatch):
    """CONFIG min_programs: a merge of few rows runs in more, smaller programs (down to one row),
    a large one keeps its tile (the GPU's launch; the interpreter keeps the tile, as the grid only
    costs it time there). Smaller tiles give the same output to the bit (the same arithmetic per
    row): run here through block_elems, down to one row a program."""
    mod = _triton_merge_module(monkeypatch)
    warps = mod.CONFIG["num_warps"]
    assert mod._launch_config(128, 1024, 0) == (32, 128, warps)
    assert mod._launch_config(128, 1024, 528) == (1, 128, warps)     # 1024 programs of one row (>= 528)
    assert mod._launch_config(128, 1024, 264) == (2, 128, warps)
    assert mod._launch_config(128, 40000, 528) == (32, 128, warps)   # 1250 programs at the tile already
    assert mod._launch_config(512, 4096, 528) == (4, 512, warps)     # MLA: 8 -> 4 rows, 1024 programs
    outs, lses = _edge_case_states(11, 3, t=9, h=4, d=24)
    results = []
    for elems in (4096, 64, 32):                                      # 32 x 4 rows... 1 row a program
        monkeypatch.setitem(mod.CONFIG, "block_elems", elems)
        results.append(mod.merge_states_triton(outs, lses))
    assert mod._launch_config(24, 36, 0)[0] == 1
    for got in results[1:]:
        assert torch.equal(torch.nan_to_num(got.out, nan=7.0), torch.nan_to_num(results[0].out, nan=7.0))
        assert torch.equal(torch.nan_to_num(got.lse, nan=7.0), torch.nan_to_num(results[0].lse, nan=7.0))
    expect = merge_attn_states(outs, lses, backend="torch")
    torch.testing.assert_close(results[-1].out, expect.out, rtol=0, atol=1e-6, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_merge_matches_torch_on_cuda(dtype):
    for n, (t, h, d), base in ((2, (1000, 16, 128), "e"), (4, (333, 8, 64), "2"), (3, (64, 5, 96), "e"),
                               (4, (32, 16, 512), "e"), (8, (7, 16, 512), "e")):
        outs, lses = _edge_case_states(n, n, t, h, d)
        outs, lses = outs.cuda().to(dtype), lses.cuda()
        expect = merge_attn_states(outs, lses, base=base, backend="torch")
        got = merge_attn_states(outs, lses, base=base)          # auto picks Triton on CUDA
        torch.testing.assert_close(got.out.float(), expect.out.float(), rtol=1e-2 if dtype != torch.float32 else 0,
                                   atol=1e-2 if dtype != torch.float32 else 1e-5, equal_nan=True)
        torch.testing.assert_close(got.lse, expect.lse, rtol=0, atol=1e-5, equal_nan=True)
        # the ring's step: fp32 accumulator, block in the attention dtype, in place
        ref2 = merge_two_attn_states(outs[0].float(), lses[0], outs[1].float(), lses[1], base=base, backend="torch")
        acc, acc_lse = outs[0].float().clone(), lses[0].clone()
        merge_two_attn_states(acc, acc_lse, outs[1], lses[1], base=base, out=acc, out_lse=acc_lse)
        torch.testing.assert_close(acc, ref2.out, rtol=0, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(acc_lse, ref2.lse, rtol=0, atol=1e-5, equal_nan=True)


@pytest.mark.gpu
def test_n_way_merge_of_inputs_past_2_to_the_31_elements_on_cuda():
    """Five stacked inputs of 2^29 elements each (bf16 [131072, 32, 128]): input i starts i x 2^29
    elements in, past 2^31 from i = 4, while the stride itself fits in 32 bits (the kernel widens it
    before the product). Rows at both ends checked against the torch merge."""
    n, t, h, d = 5, 131072, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    outs = torch.randn(n, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    lses = torch.randn(n, t, h, device="cuda", generator=gen) * 3
    lses[:4, -1] = -float("inf")                     # the last row: only input 4 (past 2^31) counts
    got = merge_attn_states(outs, lses)
    for rows in (slice(0, 64), slice(t - 64, t)):
        expect = merge_attn_states(outs[:, rows].float(), lses[:, rows], backend="torch")
        torch.testing.assert_close(got.out[rows].float(), expect.out, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got.lse[rows], expect.lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.out[-1].float(), outs[4, -1].float(), rtol=0, atol=0)



# ---- an independent float64 reference on fresh random inputs ---------------------------------------


def _merge_float64(outs: torch.Tensor, lses: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge computed in float64 from its definition (docs/numerics.md §7), written apart from
    merge.py: lse = torch.logsumexp over the non-empty parts (+inf counts as empty), out = the sum
    of exp(lse_i - lse) * out_i over them; 0 and -inf where every part is empty; NaN rows where
    some lse is NaN."""
    l64 = lses.double() * (LN2 if base == "2" else 1.0)
    nan_row = torch.isnan(l64).any(0)
    empty = torch.isnan(l64) | torch.isinf(l64)
    l64 = l64.masked_fill(empty, -math.inf)
    lse = torch.logsumexp(l64, 0)
    all_empty = empty.all(0)
    w = torch.exp(l64 - lse.masked_fill(all_empty, 0.0)).masked_fill(empty, 0.0)
    # normalized by sum(w), not 1: at |lse| ~ 3e38 even float64 loses the log(2) of two equal parts
    out = torch.einsum("n...,n...d->...d", w, outs.double().masked_fill(empty[..., None], 0.0))
    out = out / w.sum(0).masked_fill(all_empty, 1.0)[..., None]
    out = out.masked_fill(nan_row[..., None], math.nan)
    lse = (lse / (LN2 if base == "2" else 1.0)).masked_fill(nan_row, math.nan)
    return out, lse


def _awkward_states(seed: int, n: int, t: int = 12, h: int = 3, d: int = 10):
    """Random partial states [n, t, h, d] / [n, t, h] with: rows empty in every part (some -inf,
    some +inf), rows with one non-empty part, -inf / +inf mixed with finite values, lse gaps up to
    ~1e4 (exp underflows), magnitudes near the fp32 limit, a NaN lse; garbage (NaN / inf) outs
    wherever a part is empty."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, t, h, d, generator=gen)
    lses = torch.randn(n, t, h, generator=gen) * 20
    pick = lambda: (torch.rand(n, t, h, generator=gen) < 0.2)
    lses[pick()] = -math.inf
    lses[pick()] = math.inf
    lses[:, 0] = -math.inf                                               # empty everywhere
    lses[:, 1, 0] = math.inf
    lses[:, 1, 1:] = torch.tensor([-math.inf, math.inf])[torch.arange(n) % 2][:, None]
    lses[:, 2] = -math.inf
    lses[n - 1, 2] = torch.randn(h, generator=gen)                       # one part only
    lses[0, 3] += 1e4                                                    # the others underflow
    lses[:, 4] = torch.tensor([3e38, -3e38, 1e38])[torch.arange(n) % 3][:, None]
    if n > 1:
        lses[1, 5, 1] = math.nan
    outs[torch.isinf(lses)] = torch.tensor([math.nan, math.inf])[torch.randint(0, 2, (1,), generator=gen)]
    return outs, lses


def _assert_merge(out, lse, want_out, want_lse, dtype, what):
    assert out.dtype == dtype and lse.dtype == torch.float32, what
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=atol, equal_nan=True, msg=what)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-7, atol=1e-5, equal_nan=True, msg=what)


@pytest.mark.parametrize("base", ["e", "2"])
def test_torch_merge_matches_a_float64_reference_on_random_awkward_states(base):
    """N-way (stacked and as a list) and pairwise merges, N = 1..6, several seeds, fp32 / bf16 outs:
    every row against `_merge_float64` (no defect found; a check of the whole contract)."""
    for seed in range(4):
        for n in (1, 2, 3, 6):
            outs, lses = _awkward_states(100 * seed + n, n)
            want_out, want_lse = _merge_float64(outs, lses, base)
            for dtype in (torch.float32, torch.bfloat16):
                x = outs.to(dtype)
                want = want_out if dtype == torch.float32 else _merge_float64(x.float(), lses, base)[0]
                for form in ("stacked", "list"):
                    got = merge_attn_states(x if form == "stacked" else list(x), lses if form == "stacked"
                                            else list(lses), base=base, backend="torch")
                    _assert_merge(*got, want, want_lse, dtype, (seed, n, dtype, form))
                if n == 2:
                    got = merge_two_attn_states(x[0], lses[0], x[1], lses[1], base=base, backend="torch")
                    _assert_merge(*got, want, want_lse, dtype, (seed, n, dtype, "pair"))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # numpy: -3e38 - 3e38 = -inf, meant
@pytest.mark.parametrize("base", ["e", "2"])
def test_triton_merges_match_a_float64_reference_under_interpreter(monkeypatch, base):
    """The N-way kernel (stacked / list) and the pair kernel on the same awkward random states,
    fp32 and fp16 outs, against `_merge_float64` (no defect found)."""
    mod = _triton_merge_module(monkeypatch)
    for seed in range(2):
        for n in (1, 2, 3, 5):
            outs, lses = _awkward_states(7 + 100 * seed + n, n, t=8)
            for dtype in (torch.float32, torch.float16):
                x = outs.to(dtype)
                want_out, want_lse = _merge_float64(x.float(), lses, base)
                got = mod.merge_states_triton(x, lses, base=base)                 # N-way, stacked
                _assert_merge(*got, want_out, want_lse, dtype, (seed, n, dtype, "stacked"))
                if n == 2:                                                       # pair kernel
                    got = mod.merge_states_triton(list(x), list(lses), base=base)
                    _assert_merge(*got, want_out, want_lse, dtype, (seed, n, dtype, "pair"))


def test_merge_gradient_matches_autograd_of_the_plain_formula():
    """Gradients of the torch merge (fp32, base e and 2) through out and lse against autograd of
    lse = logsumexp(lse_i), out = sum exp(lse_i - lse) out_i in float64, with empty (-inf) parts
    among finite ones; on a row empty in every part every gradient is 0 (no defect found)."""
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        outs = torch.randn(3, 5, 2, 6, generator=gen, dtype=torch.float64)
        lses = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64) * 5
        lses[0, 1] = -math.inf
        lses[1:, 2, 1] = -math.inf
        g_out = torch.randn(5, 2, 6, generator=gen, dtype=torch.float64)
        g_lse = torch.randn(5, 2, generator=gen, dtype=torch.float64)
        o64, l64 = outs.clone().requires_grad_(), lses.clone().requires_grad_()
        lse = torch.logsumexp(l64, 0)
        out = (torch.exp(l64 - lse)[..., None] * o64).sum(0)
        ((out * g_out).sum() + (lse * g_lse).sum()).backward()
        for base in ("e", "2"):
            o32, l32 = outs.float().requires_grad_(), (lses / (LN2 if base == "2" else 1.0)).float().requires_grad_()
            got = merge_attn_states(list(o32.unbind(0)), list(l32.unbind(0)), base=base)
            lse_e = got.lse.double() * (LN2 if base == "2" else 1.0)
            ((got.out.double() * g_out).sum() + (lse_e * g_lse).sum()).backward()
            torch.testing.assert_close(o32.grad.double(), o64.grad, rtol=0, atol=1e-5)
            l_grad = l32.grad.double() / (LN2 if base == "2" else 1.0)
            torch.testing.assert_close(l_grad, l64.grad, rtol=0, atol=1e-5)
    o32, l32 = torch.randn(2, 1, 1, 4, requires_grad=True), torch.full((2, 1, 1), -math.inf, requires_grad=True)
    got = merge_attn_states(o32, l32)
    (got.out.sum() + torch.where(torch.isfinite(got.lse), got.lse, 0.0).sum()).backward()
    assert torch.equal(o32.grad, torch.zeros_like(o32)) and torch.equal(l32.grad, torch.zeros_like(l32))


def test_merge_rejects_integer_outs_naming_the_dtype():
    """The merged out takes input 0's dtype: integer outs were merged in fp32 and truncated back
    to integers silently (the `out` destination was already refused for an integer dtype)."""
    outs, lses = torch.randint(-3, 4, (2, 3, 2, 4), dtype=torch.int32), torch.randn(2, 3, 2)
    with pytest.raises(ValueError, match=r"input 0: out must have a float dtype, got torch.int32"):
        merge_attn_states(outs, lses)
    with pytest.raises(ValueError, match=r"input 1: out must have a float dtype, got torch.int64"):
        merge_two_attn_states(outs[0].float(), lses[0], outs[1].long(), lses[1])


# ---- one partial's share of a merge (DCP's all-gather + reduce-scatter combine) ----------------------


def _share_float64(outs: torch.Tensor, lses: torch.Tensor, base: str, i: int) -> torch.Tensor:
    """Partial i's out times exp(lse_i - lse) in float64 (0 where part i is empty, NaN on NaN rows),
    written apart from merge.py as `_merge_float64` is."""
    l64 = lses.double() * (LN2 if base == "2" else 1.0)
    nan_row = torch.isnan(l64).any(0)
    empty = torch.isnan(l64) | torch.isinf(l64)
    l64 = l64.masked_fill(empty, -math.inf)
    m = l64.max(0).values.masked_fill(empty.all(0), 0.0)
    w = torch.exp(l64 - m).masked_fill(empty, 0.0)
    scale = w[i] / w.sum(0).masked_fill(empty.all(0), 1.0)
    out = outs[i].double().masked_fill(empty[i][..., None], 0.0) * scale[..., None]
    return out.masked_fill(nan_row[..., None], math.nan)


def _check_shares(rescale, seeds, ns, dtypes, base):
    for seed in seeds:
        for n in ns:
            outs, lses = _awkward_states(300 + 100 * seed + n, n, t=8)
            for dtype in dtypes:
                x = outs.to(dtype)
                want_out, want_lse = _merge_float64(x.float(), lses, base)
                total = None
                for i in range(n):
                    got = rescale(x[i], lses if i % 2 else list(lses), i)
                    what = (seed, n, dtype, i)
                    assert got.out.dtype == torch.float32 and got.lse.dtype == torch.float32, what
                    torch.testing.assert_close(got.out.double(), _share_float64(x.float(), lses, base, i), rtol=0,
                                               atol=1e-5, equal_nan=True, msg=what)
                    torch.testing.assert_close(got.lse.double(), want_lse, rtol=2e-7, atol=1e-5, equal_nan=True,
                                               msg=what)
                    total = got.out.double() if total is None else total + got.out.double()
                # the reduce-scatter's sum of every share is the merge
                torch.testing.assert_close(total, want_out, rtol=0, atol=1e-5, equal_nan=True, msg=(seed, n, dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("base", ["e", "2"])
def test_rescale_to_merged_is_a_partials_share_of_the_merge(base):
    """`rescale_to_merged` (torch): each partial's scaled out against a float64 reference on the
    awkward states (empty / +inf / NaN rows, garbage outs of empty parts, huge lse gaps), N = 1..6,
    every index, fp32 / bf16 outs; the shares sum to the merge and carry its lse."""
    from parallel.cp.merge import rescale_to_merged

    _check_shares(lambda o, l, i: rescale_to_merged(o, l, i, base=base, backend="torch"), range(3), (1, 2, 3, 6),
                  (torch.float32, torch.bfloat16), base)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("base", ["e", "2"])
def test_rescale_kernel_matches_the_float64_share_under_interpreter(monkeypatch, base):
    """The one-kernel form (`triton_merge.rescale_triton`) on the same states, fp32 / fp16 outs,
    strided outs ([T, H, D] views of [H, T, D] memory)."""
    mod = _triton_merge_module(monkeypatch)

    def rescale(o, l, i):
        stacked = l if isinstance(l, torch.Tensor) else torch.stack(l)
        strided = o.transpose(0, 1).contiguous().transpose(0, 1)
        return mod.rescale_triton(strided.unsqueeze(0), stacked.unsqueeze(1), i, base=base)

    _check_shares(rescale, range(2), (1, 2, 3, 5), (torch.float32, torch.float16), base)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("kernel", [False, True])
def test_rescale_parts_is_the_sum_of_a_ranks_partials_shares(monkeypatch, base, kernel):
    """`rescale_parts_to_merged` (torch, and the kernel under the interpreter): rank i's P partials'
    shares of the N x P-way merge summed, against the float64 shares of the awkward states (empty /
    +inf / NaN rows, garbage outs of empty parts, huge lse gaps), fp32 / bf16 outs, N x P from 1 x 1
    to 4 x 3; the ranks' results sum to the merge of all N x P partials and carry its lse."""
    if kernel:
        rescale = _triton_merge_module(monkeypatch).rescale_triton
    else:
        from parallel.cp.merge import rescale_parts_to_merged

        rescale = lambda o, l, i, base: rescale_parts_to_merged(o, l, i, base=base, backend="torch")
    for n, p in ((1, 1), (1, 3), (2, 2), (3, 1), (4, 3)):
        outs, lses = _awkward_states(700 + 10 * n + p, n * p, t=8)
        for dtype in (torch.float32, torch.bfloat16):
            x = outs.to(dtype)
            want_out, want_lse = _merge_float64(x.float(), lses, base)
            total = None
            for i in range(n):
                got = rescale(x[i * p:(i + 1) * p], lses.view(n, p, *lses.shape[1:]), i, base=base)
                share = sum(_share_float64(x.float(), lses, base, i * p + j) for j in range(p))
                what = (n, p, dtype, i)
                assert got.out.dtype == torch.float32 and got.lse.dtype == torch.float32, what
                torch.testing.assert_close(got.out.double(), share, rtol=0, atol=1e-5, equal_nan=True, msg=what)
                torch.testing.assert_close(got.lse.double(), want_lse, rtol=2e-7, atol=1e-5, equal_nan=True,
                                           msg=what)
                total = got.out.double() if total is None else total + got.out.double()
            torch.testing.assert_close(total, want_out, rtol=0, atol=1e-5, equal_nan=True, msg=(n, p, dtype))


def test_rescale_parts_rejects_bad_input():
    from parallel.cp.merge import MAX_RESCALE_PARTIALS, rescale_parts_to_merged, rescale_to_merged

    outs, lses = torch.randn(2, 4, 3, 8), torch.randn(3, 2, 4, 3)
    with pytest.raises(ValueError, match=r"outs \(2, 4, 3, 8\) must be \[P, ..., T, H, D\] and lses \(3, 3, 4, 3\)"):
        rescale_parts_to_merged(outs, torch.randn(3, 3, 4, 3), 0)             # another P
    with pytest.raises(ValueError, match="must be"):
        rescale_parts_to_merged(outs[0, 0], lses[:, 0, 0], 0)                  # [H, D]: no partials axis
    with pytest.raises(ValueError, match=r"index 3 must be an int in \[0, 3\)"):
        rescale_parts_to_merged(outs, lses, 3)
    with pytest.raises(ValueError, match="float dtypes"):
        rescale_parts_to_merged(outs.to(torch.int32), lses, 0)
    with pytest.raises(ValueError, match="P >= 1"):
        rescale_parts_to_merged(outs[:0], lses[:, :0], 0)
    # past what one kernel merges, "auto" runs the torch form (here on CPU it does anyway): still exact
    n, p = 5, -(-(MAX_RESCALE_PARTIALS + 1) // 5)
    many_lses = torch.randn(n, p, 2, 3)
    got = rescale_parts_to_merged(torch.randn(p, 2, 3, 8), many_lses, 4)
    torch.testing.assert_close(got.lse, torch.logsumexp(many_lses.reshape(n * p, 2, 3), 0))
    # one partial a rank is `rescale_to_merged`
    got = rescale_parts_to_merged(outs[:1], lses[:, :1], 1)
    want = rescale_to_merged(outs[0], lses[:, 0], 1)
    assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)


def test_rescale_to_merged_rejects_bad_input():
    from parallel.cp.merge import rescale_to_merged

    out, lses = torch.randn(4, 2, 8), torch.randn(3, 4, 2)
    for index in (3, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"index .* must be an int in \[0, 3\)"):
            rescale_to_merged(out, lses, index)
    with pytest.raises(ValueError, match=r"lse 1 is \(4, 3\)"):
        rescale_to_merged(out, [lses[0], torch.randn(4, 3), lses[2]], 0)
    with pytest.raises(ValueError, match="out"):
        rescale_to_merged(torch.randn(4, 3, 8), lses, 0)
    with pytest.raises(ValueError, match="float dtype"):
        rescale_to_merged(out.to(torch.int32), lses, 0)
    with pytest.raises(ValueError, match="N >= 1"):
        rescale_to_merged(out, [], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rescale_to_merged_on_cuda_is_one_kernel_matching_torch(dtype):
    """On CUDA without autograd the Triton kernel runs (one launch, captured in a CUDA graph) and
    matches the torch form, DCP's shapes included (B 32, 128 heads x 512 latent, N 8)."""
    from parallel.cp.merge import rescale_to_merged

    for n, (t, h, d) in ((2, (1000, 16, 128)), (8, (32, 128, 512)), (3, (7, 5, 96))):
        outs, lses = _edge_case_states(n, n, t, h, d)
        outs, lses = outs.cuda().to(dtype), lses.cuda()
        for i in (0, n - 1):
            want = rescale_to_merged(outs[i], lses, i, backend="torch")
            got = rescale_to_merged(outs[i], lses, i)
            torch.testing.assert_close(got.out, want.out, rtol=0, atol=1e-5, equal_nan=True)
            torch.testing.assert_close(got.lse, want.lse, rtol=0, atol=1e-5, equal_nan=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rescale_to_merged(outs[0], lses, 0)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rescale_to_merged(outs[0], lses, 0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured.out, rescale_to_merged(outs[0], lses, 0, backend="torch").out, rtol=0,
                               atol=1e-5, equal_nan=True)
    # several partials a rank (the split-KV kernel's splits, unmerged): one kernel too
    from parallel.cp.merge import rescale_parts_to_merged

    outs, lses = _edge_case_states(9, 8 * 3, 32, 128, 512)
    outs, lses = outs.cuda().to(dtype).view(8, 3, 32, 128, 512), lses.cuda().view(8, 3, 32, 128)
    for i in (0, 5):
        want = rescale_parts_to_merged(outs[i], lses, i, backend="torch")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = rescale_parts_to_merged(outs[i], lses, i)
            torch.cuda.synchronize()
        assert len([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]) == 1
        torch.testing.assert_close(got.out, want.out, rtol=0, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(got.lse, want.lse, rtol=0, atol=1e-5, equal_nan=True)
