"""The FlashMLA anchor of `megapar bench cp`'s MLA rows (launch/bench/flashmla.py).

On the CPU: the source-folder check, the split plan kept after the first call (as FlashMLA's
Python interface keeps it), and the bench columns against a stand-in module that computes the
absorbed MLA decode over the paged cache (a correct one matches our torch path; one off by a
little more than the tolerance is flagged). On the GPU (where
MEGAPAR_FLASHMLA_SRC names a source folder packed by bench/fetch_flashmla.sh): the real build
against a plain torch MLA decode, with uneven lengths, a one-token sequence and 16 / 128 heads."""

from __future__ import annotations

import os

import pytest
import torch

from megapar.launch.bench import flashmla
from megapar.launch.bench.common import BenchContext
from megapar.launch.bench.cp import _mla_decode_setup, flashmla_columns
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention


def mla_decode_reference(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                         scale: float, dv: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode in float64, one sequence at a time: q [B, H, D], kv [nb, page, 1, D]
    (values: the first dv dims), the sequence's tokens = its pages in table order, the first
    lens[b]. Returns (out [B, H, dv], lse [B, H]) (natural log)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        tokens = kv[table[b].long()].reshape(-1, kv.shape[-1])[: int(lens[b])].double()
        s = q[b].double() @ tokens.T * scale
        outs.append(torch.softmax(s, -1) @ tokens[:, :dv])
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


class StandIn:
    """FlashMLA's `dense_decode_fwd` in torch (its argument order and returns); `bias` / `lse_bias` are
    added to the output / the lse (a wrong kernel); records the plan each call was given."""

    def __init__(self, bias: float = 0.0, lse_bias: float = 0.0):
        self.bias, self.lse_bias, self.given, self.lens = bias, lse_bias, [], []

    def dense_decode_fwd(self, q, cache, dv, lens, table, scale, causal, meta, splits):
        self.given.append(meta)
        self.lens.append(lens.clone())
        assert q.dim() == 4 and q.shape[1] == 1 and dv == 512 and not causal
        out, lse = mla_decode_reference(q[:, 0], cache, table, lens, scale, dv)
        plan = meta if meta is not None else torch.zeros(3, dtype=torch.int32)
        return ((out + self.bias).to(q.dtype).unsqueeze(1), (lse + self.lse_bias).float().unsqueeze(-1), plan,
                torch.zeros(q.shape[0] + 1, dtype=torch.int32))


def test_missing_files_and_build_refuse_a_folder_without_the_sources(tmp_path):
    assert "csrc/sm90/decode/dense/instantiations/bf16.cu" in flashmla.missing_files(tmp_path)
    (tmp_path / "csrc/api").mkdir(parents=True)
    (tmp_path / "csrc/api/dense_decode.h").write_text("")
    missing = flashmla.missing_files(tmp_path)
    assert "csrc/api/dense_decode.h" not in missing and "csrc/cutlass/include" in missing
    with pytest.raises(ValueError, match="not a FlashMLA source folder.*csrc/cutlass/include"):
        flashmla.build(tmp_path)


def test_load_from_env_is_none_without_the_variable(monkeypatch):
    monkeypatch.delenv(flashmla.ENV, raising=False)
    assert flashmla.load_from_env() is None


def test_decode_plans_once_and_reuses_the_plan():
    torch.manual_seed(0)
    kv = torch.randn(6, 64, 1, 576)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([150, 7], dtype=torch.int32)
    q = torch.randn(2, 16, 576)
    module = StandIn()
    run = flashmla.FlashMLADecode(module, 0.1)
    out, lse = run(q, kv, table, lens)
    run(q, kv, table, lens)
    assert module.given[0] is None and module.given[1] is run.meta and run.meta is not None
    ref, ref_lse = mla_decode_reference(q, kv, table, lens, 0.1)
    assert out.shape == (2, 16, 512) and torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse[..., 0].double(), ref_lse, atol=1e-5)


@pytest.mark.parametrize("off, lse_off, ok", [(0.0, 0.0, True), (0.01, 0.005, True), (0.05, 0.0, False),
                                              (0.0, 0.05, False)], ids=["same", "within", "out-off", "lse-off"])
def test_bench_columns_check_flashmla_against_our_result(off, lse_off, ok):
    """flashmla_columns on rank 0 of 4 of a DCP cache: FlashMLA gets this rank's lengths; a stand-in
    whose out is off by more than 2% of the output's largest value, or whose lse is off by more than
    1e-2, is flagged (flashmla_matches False, a note) without failing our row."""
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    dims, n, block, context = MLADims(), 4, 64, 1000
    latent, table = _mla_decode_setup(2, context, dims, block, n, ctx.device, torch.float32)
    layout = DCPLayout(size=n, rank=0, block_size=block)
    q = torch.randn(2, 16, dims.latent_dim)
    seq = torch.tensor([context, 300])
    short = torch.full_like(seq, n * block)
    ours = paged_decode_attention(q, latent.paged, table, seq, layout=layout, scale=dims.scale, backend="torch")
    module = StandIn(off * ours.out.abs().max().item(), lse_off)
    cols = flashmla_columns(ctx, module, [(latent.paged, table, q)], layout, seq, short, dims.scale, ours, 10.0)
    assert cols["flashmla_matches"] is ok
    assert any("FlashMLA's result differs" in note for note in ctx.notes) is (not ok)
    assert set(cols) >= {"flashmla_us", "speedup_vs_flashmla", "flashmla_fixed_us", "flashmla_max_abs_diff",
                         "flashmla_max_lse_diff", "flashmla_timing"}
    # this rank's lengths (of the global ones and of the one-page-per-rank ones), the plan made by the
    # first call of each
    assert torch.equal(module.lens[0], layout.local_lengths(seq).int()) and module.lens[0].dtype == torch.int32
    assert torch.equal(module.lens[1], layout.local_lengths(short).int())
    assert module.given[0] is None and module.given[1] is None and module.given[2] is not None
    row = ctx.record("MLA row", 10.0, **cols)
    assert "[WRONG RESULT]" not in row["case"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not os.environ.get(flashmla.ENV),
                    reason="needs CUDA and MEGAPAR_FLASHMLA_SRC (bench/fetch_flashmla.sh)")
@pytest.mark.parametrize("heads", [16, 128])
def test_flashmla_build_matches_torch_mla_decode(heads):
    module = flashmla.load_from_env()
    torch.manual_seed(heads)
    lens = torch.tensor([1, 64, 65, 1000, 4097], dtype=torch.int32, device="cuda")
    pages = [-(-int(n) // 64) for n in lens]
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32, device="cuda")
    ids = torch.randperm(sum(pages), device="cuda").to(torch.int32)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = ids[at:at + p]
        at += p
    kv = torch.randn(sum(pages), 64, 1, 576, device="cuda").to(torch.bfloat16)
    q = torch.randn(len(pages), heads, 576, device="cuda").to(torch.bfloat16)
    scale = 192 ** -0.5
    run = flashmla.FlashMLADecode(module, scale)
    out, lse = run(q, kv, table, lens)
    again, _ = run(q, kv, table, lens)               # (the kept plan)
    ref, ref_lse = mla_decode_reference(q, kv, table, lens, scale)
    assert out.shape == (len(pages), heads, 512) and out.dtype == torch.bfloat16
    assert torch.equal(out, again)
    assert (out.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    assert torch.allclose(lse.double().reshape(ref_lse.shape), ref_lse, atol=1e-2)   # (natural log, as FA's)


def test_dcp_rows_time_flashmla_over_the_same_shards(monkeypatch):
    """bench cp's DCP section puts FlashMLA beside our MLA rows (not the GQA ones): over the full KV
    and over rank 0's 1/N, with this rank's lengths, checked against our result, and its own
    N x local / full (flashmla_work_ratio_local_x_n_over_full) from its own times. The --quick
    sizes with DeepSeek's MLA dims (FlashMLA's only value width, 512) and a stand-in module."""
    from megapar.launch.bench import cp as bench_cp
    from megapar.parallel.cp import mla as mla_module

    real = mla_module.MLADims
    monkeypatch.setattr(mla_module, "MLADims", lambda **kw: real())
    module = StandIn()
    monkeypatch.setattr(bench_cp, "_flashmla_anchor", lambda ctx: module)
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    with torch.no_grad():
        bench_cp._dcp_breakdown(ctx)
    rows = [r for r in ctx.rows if r["case"].startswith("dcp decode")]
    assert not [r for r in rows if " gqa " in r["case"] and "flashmla_us" in r]
    mla = [r for r in rows if " mla " in r["case"]]
    full = next(r for r in mla if "full KV" in r["case"])
    assert len(mla) == 3 and full["flashmla_matches"] is True and full["flashmla_us"] > 0, ctx.notes
    assert not [note for note in ctx.notes if "FlashMLA" in note and "differs" in note]
    seen = {int(lens.sum()) for lens in module.lens}
    for row in mla:
        if "full KV" in row["case"]:
            continue
        n = int(row["case"].split("over 1/")[1].split(" ")[0])
        # (the row keeps 4 decimals of a ratio: a stand-in much faster than ours on a loaded CPU gives a
        # speedup of ~0.01, where that rounding alone is over 1e-3 of it)
        assert row["flashmla_matches"] is True and row["speedup_vs_flashmla"] == pytest.approx(
            row["flashmla_us"] / row["time_us"], rel=1e-3, abs=1e-4)
        assert row["flashmla_work_ratio_local_x_n_over_full"] == pytest.approx(
            row["flashmla_us"] * n / full["flashmla_us"], rel=1e-3, abs=1e-4)
        # FlashMLA was given rank 0's share of the lengths, not the global ones
        layout = DCPLayout(size=n, rank=0, block_size=16)
        assert int(layout.local_lengths(torch.full((2,), 256)).sum()) in seen


def test_a_failing_anchor_leaves_its_columns_out_with_a_note_and_keeps_the_row(monkeypatch):
    """A FlashMLA that raises (a build for another card, a shape it refuses) costs its columns on the
    DCP rows and a note naming the row, not the rows themselves."""
    from megapar.launch.bench import cp as bench_cp
    from megapar.parallel.cp import mla as mla_module

    class Broken:
        def dense_decode_fwd(self, *args):
            raise RuntimeError("no kernel image for this device")

    real = mla_module.MLADims
    monkeypatch.setattr(mla_module, "MLADims", lambda **kw: real())
    monkeypatch.setattr(bench_cp, "_flashmla_anchor", lambda ctx: Broken())
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    with torch.no_grad():
        bench_cp._dcp_breakdown(ctx)
    mla = [r for r in ctx.rows if r["case"].startswith("dcp decode mla")]
    assert len(mla) == 3 and not [r for r in mla if "flashmla_us" in r] and all(r["time_us"] > 0 for r in mla)
    assert any(n.startswith("FlashMLA anchor, dcp H=2 N=1: RuntimeError: no kernel image") for n in ctx.notes)
