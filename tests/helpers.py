"""Independent references shared by several test modules (test modules never import each other).

Everything here is written from the conventions in docs/numerics.md, on purpose differently from
the library code it checks: float64, explicit tables, one head / one token at a time where that
keeps the formula visible.

- `reference_attention`: full attention with LSE (docs/numerics.md §7), for the CP tests.
- `E2M1`, `e4m3_values`, `weight_values`: the bit meaning of the low-precision weight formats
  (docs/numerics.md §4), for the GEMM and FFN tests.
- `plain_moe_reference`: one MoE layer (routing §2, SwiGLU §3, shared expert) in plain torch
  float64, differentiable, for gradient checks of `moe.MoELayer`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from parallel.cp import DCPLayout, PagedKVCache
from parallel.cp.dcp import write_kv_slots

# ---------------------------------------------------------------------------- attention


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Sq, Hq, D], k [Sk, Hkv, D], v [Sk, Hkv, Dv] -> (out [Sq, Hq, Dv], lse [Sq, Hq]) in float64.

    causal: key j visible from query i iff k_pos[j] <= q_pos[i] (positions default to arange).
    Rows with no visible key: out 0, lse -inf. Differentiable. Checked against PyTorch's
    scaled_dot_product_attention in tests/test_cp_reference.py.
    """
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    scale = d ** -0.5 if scale is None else scale
    q_pos = torch.arange(sq) if q_pos is None else q_pos
    k_pos = torch.arange(sk) if k_pos is None else k_pos
    hidden = k_pos[None, :] > q_pos[:, None]
    outs, lses = [], []
    for h in range(hq):
        kv_head = h * hkv // hq
        scores = (q[:, h].double() @ k[:, kv_head].double().T) * scale
        if causal:
            scores = scores.masked_fill(hidden, -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        outs.append(probs @ v[:, kv_head].double())
        lses.append(torch.logsumexp(scores, dim=-1))
    return torch.stack(outs, 1), torch.stack(lses, 1)


# ---------------------------------------------------------------------------- formats

# E2M1 code -> value: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def e4m3_values(b: np.ndarray) -> np.ndarray:
    """FP8 E4M3 bytes -> float64 values (bias 7, subnormals below exponent 1, 0x7F/0xFF NaN)."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    val = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return sign * np.where((e == 15) & (m == 7), np.nan, val)


def weight_values(q) -> np.ndarray:
    """[E, N, K] float64 values of an mxfp4 / nvfp4 / fp8_block `moe.quant.QuantizedTensor`."""
    if q.fmt in ("mxfp4", "nvfp4"):
        d = q.data.numpy().astype(np.int64)
        codes = np.empty((*d.shape[:-1], 2 * d.shape[-1]), dtype=np.int64)
        codes[..., 0::2], codes[..., 1::2] = d & 15, d >> 4  # element 2i in the low nibble
        vals = E2M1[codes]
        s = q.scale.numpy().astype(np.int64)
        if q.fmt == "mxfp4":
            return vals * np.repeat(np.ldexp(1.0, s - 127), 32, axis=-1)  # E8M0: 2^(byte - 127)
        gs = q.global_scale.numpy().astype(np.float64).reshape(-1, 1, 1)
        return vals * np.repeat(e4m3_values(s), 16, axis=-1) * gs
    assert q.fmt == "fp8_block", q.fmt
    vals = e4m3_values(q.data.view(torch.uint8).numpy())
    s = q.scale.numpy().astype(np.float64)
    s = np.repeat(np.repeat(s, 128, axis=-2), 128, axis=-1)[..., :vals.shape[-2], :vals.shape[-1]]
    return vals * s


# ---------------------------------------------------------------------------- MoE layer


def plain_moe_reference(x: torch.Tensor, params: dict[str, torch.Tensor], *, top_k: int, scoring: str,
                        n_group: int | None = None, topk_group: int | None = None, renormalize: bool = True,
                        scaling: float = 1.0, swiglu_limit: float | None = None) -> torch.Tensor:
    """One MoE layer in plain torch, in the dtype of `x` (use float64), differentiable.

    x: [T, H]. params: DeepSeek names -> tensors of x's dtype: gate.weight [E, H], optional
    gate.e_score_correction_bias [E], experts.{e}.w1/w3.weight [I, H], experts.{e}.w2.weight [H, I],
    optional shared_experts.w1/w3.weight [S, H] and w2.weight [H, S]. Returns [T, H].

    Routing (docs/numerics.md §2) token by token: the bias only selects; grouped top-k keeps the
    `topk_group` groups with the largest sum of their top-2 biased scores; weights are the unbiased
    scores, renormalized, times `scaling`. Selection happens on detached values (it is a
    discrete choice); the weights carry the gradient to the gate.
    """
    logits = x @ params["gate.weight"].t()  # [T, E]
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    elif scoring == "sqrt_softplus":
        scores = torch.sqrt(torch.where(logits > 20, logits, torch.log1p(torch.exp(logits.clamp(max=20)))))
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    bias = params.get("gate.e_score_correction_bias")
    num_tokens, num_experts = scores.shape
    rows = []
    for t in range(num_tokens):
        select = (scores[t] + bias if bias is not None else scores[t]).detach().tolist()
        allowed = list(range(num_experts))
        if n_group is not None and n_group > 1:
            size = num_experts // n_group
            group_score = []
            for g in range(n_group):
                members = sorted(select[g * size:(g + 1) * size], reverse=True)
                group_score.append(sum(members[:2]) if bias is not None else members[0])
            kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
            allowed = [e for e in allowed if e // size in kept]
        chosen = sorted(allowed, key=lambda e: (-select[e], e))[:top_k]
        w = scores[t, chosen]
        if renormalize:
            w = w / w.sum()
        w = w * scaling
        row = torch.zeros_like(x[t])
        for weight, e in zip(w, chosen):
            g = x[t] @ params[f"experts.{e}.w1.weight"].t()
            u = x[t] @ params[f"experts.{e}.w3.weight"].t()
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
            row = row + weight * ((F.silu(g) * u) @ params[f"experts.{e}.w2.weight"].t())
        rows.append(row)
    out = torch.stack(rows) if rows else torch.zeros_like(x)
    if "shared_experts.w1.weight" in params:
        s1, s3, s2 = (params[f"shared_experts.{n}.weight"] for n in ("w1", "w3", "w2"))
        out = out + (F.silu(x @ s1.t()) * (x @ s3.t())) @ s2.t()
    return out


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; a must be finite (a NaN would compare as no error)."""
    assert torch.isfinite(a).all()
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def w4a16_config(**kw):
    """A W4A16 kernel config for the interpreter tests: fp32 math, 32-row programs of 16, oct
    packing, one chunk, one stage; `kw` overrides."""
    from moe.kernels.triton_w4a16 import W4A16Config
    base = dict(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f32", packing="oct")
    return W4A16Config(**{**base, **kw})



def outcome(fn) -> str:
    """'ok', or the ValueError (or subclass) fn raised as 'TypeName: message': what a rank of a
    multi-rank test reports back for each case, so the test can compare every rank's outcome."""
    try:
        fn()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def launch_once(fn, world_size: int, *args, timeout: float = 120):
    """Every rank's return of `fn(rank, world_size, *args)` from one `launch_local` of `world_size`
    gloo ranks, or the launch's error as text; kept per (fn, world_size, args), so a test module's
    cases share one launch and a crash is not relaunched per case."""
    key = (fn, world_size, args)
    if key not in _LAUNCHED:
        from launch.local import launch_local

        try:
            _LAUNCHED[key] = tuple(launch_local(fn, world_size, args=(world_size, *args), timeout=timeout))
        except Exception as e:  # RankError with the failing rank's traceback, or a timeout
            _LAUNCHED[key] = f"{type(e).__name__}: {e}"
    return _LAUNCHED[key]


_LAUNCHED: dict = {}


def run_tp_cases(rank: int, world_size: int, module: str, any_error: bool) -> dict:
    """A rank's part of running every case of the test module `module` (its CASES, each
    `case(tp, rank, size)`) on one TP group of all ranks: {case name: None, or its traceback}.
    any_error: report every exception per case (cases whose ValueErrors every rank raises
    alike), else AssertionErrors only. A barrier after each case leaves no collective
    half-done for the next one."""
    import importlib
    import traceback

    from parallel import ParallelConfig, destroy_parallel, init_parallel

    torch.set_num_threads(1)
    cases = importlib.import_module(module).CASES
    tp = init_parallel(ParallelConfig(world_size=world_size, tp=world_size)).tp
    caught = Exception if any_error else AssertionError
    out: dict = {}
    try:
        for case in cases:
            try:
                case(tp, tp.rank, tp.size)
                out[case.__name__] = None
            except caught:
                out[case.__name__] = traceback.format_exc()
            if tp.size > 1:
                torch.distributed.barrier(group=tp.group)
    finally:
        destroy_parallel()
    return out


def assert_case_passed(results, case: str) -> None:
    """`launch_once(run_tp_cases, ...)`'s results: the launch worked and no rank failed `case`."""
    assert not isinstance(results, str), results
    failures = [f"rank {r}:\n{res[case]}" for r, res in enumerate(results) if res[case]]
    assert not failures, "\n".join(failures)


def assert_value_error(fn, *needles: str) -> None:
    """fn() raises ValueError whose message holds every one of `needles` (from a rank's case, where
    pytest.raises' context would not report back)."""
    try:
        fn()
    except ValueError as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return
    raise AssertionError(f"no ValueError (wanted one naming {needles})")


# ---- paged decode tests: caches, checks and the compiled-kernel guard (test_cp_decode_*) ----


def compiled_decode_kernels(monkeypatch):
    """A GPU test's first step: Triton makes each kernel compiled or interpreted when the module
    that defines it is imported (TRITON_INTERPRET then), and the decode tests' autouse fixture
    turns the interpreter on, so a GPU test that imported the kernel modules before turning it off left every
    later test of its process running the kernels in the interpreter (the GPU tests failed in
    seconds when run alone or in another order). Returns triton_decode."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from triton.runtime.interpreter import InterpretedFunction

    from parallel.cp import triton_decode
    assert not isinstance(triton_decode._paged_decode_kernel, InterpretedFunction), \
        "the decode kernels were defined under TRITON_INTERPRET=1 (a CPU test imported them first in this process)"
    return triton_decode


def fill_paged_cache(lens, hkv, d, dv, block, size, rank, interleave, dtype, seed, device="cpu", num_blocks=None):
    """Dense k/v per sequence and this rank's shard of them in a paged cache with a shuffled table."""
    gen = torch.Generator().manual_seed(seed)
    layout = DCPLayout(size=size, rank=rank, block_size=block, interleave=interleave)
    per_seq = max(1, -(-max(lens) // (block * size)))
    nb = num_blocks or len(lens) * per_seq + 3
    table = torch.randperm(nb, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int()
    gen = torch.Generator().manual_seed(seed + 1)       # the same k/v whatever the table
    cache = PagedKVCache.allocate(nb, block, hkv, d, dtype=dtype, head_dim_v=dv)
    ks, vs = [], []
    for i, n in enumerate(lens):
        k = torch.randn(n, hkv, d, generator=gen)
        v = torch.randn(n, hkv, dv, generator=gen)
        ks.append(k)
        vs.append(v)
        if n:
            write_kv_slots(cache, k, v, layout.slot_mapping(torch.arange(n), table[i]))
    to = lambda c: PagedKVCache(c.k.to(device), c.v.to(device), None if c.k_scale is None else c.k_scale.to(device),
                                None if c.v_scale is None else c.v_scale.to(device))
    return to(cache), table.to(device), layout, ks, vs


def check_state(a, b, atol):
    torch.testing.assert_close(a.lse, b.lse, atol=atol, rtol=0)
    torch.testing.assert_close(a.out, b.out, atol=atol, rtol=0)


def mla_paged_cache(lens, block, dtype, seed, device="cpu"):
    """A latent cache (one 576-wide head, v = its first 512) whose slots past each sequence's length
    hold NaN (a kernel must never let them reach the output), and its block table."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-max(lens) // block)
    nb = len(lens) * per_seq + 2
    table = torch.randperm(nb, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int()
    kv = torch.full((nb, block, 1, 576), float("nan"))
    scale = torch.full((nb, block, 1), float("nan")) if dtype == torch.float8_e4m3fn else None
    for i, n in enumerate(lens):
        for t in range(n):
            row = torch.randn(576, generator=gen)
            b, o = int(table[i, t // block]), t % block
            if scale is None:
                kv[b, o, 0] = row
            else:
                sc = row.abs().max() / 448.0
                kv[b, o, 0] = (row / sc).to(torch.float8_e4m3fn).float()
                scale[b, o, 0] = sc
    kv = kv.to(dtype).to(device)
    scale = None if scale is None else scale.to(device)
    return PagedKVCache(kv, kv[..., :512], scale, scale), table.to(device)
