"""moe.router against the routing of HF transformers (DeepseekV2/V3 TopkRouter, DeepseekV4 TopK and
hash routers) and vLLM (grouped_topk, fused_topk_bias, the DeepSeek-V4 top-k kernel), as a reference
written here from scratch in the references' own shape: whole-tensor masks (a dropped group masked to
-inf, as HF and vLLM do) instead of the per-token sorts of test_router.py's references, and a K-round
"largest, then the lowest index holding it" selection for the order the references leave open.

What the references agree on and this file checks on both backends (torch; the Triton kernel under
TRITON_INTERPRET=1 on CPU):

- scores in fp32 from the logits (softmax over experts, sigmoid, sqrt(softplus) with softplus = x
  above 20); the correction bias added for the choice only; the weights the unbiased scores;
- group score = sum of the two largest biased scores of the group (a repeated maximum counts
  twice, as torch.topk(2) and vLLM's CUDA top-2 do), the largest unbiased score without a bias
  (vLLM, DeepSeek's gate, HF's V2 group_limited_greedy); the topk_group best groups kept, the top-k
  over their experts;
- renormalize (sum over the K), then times routed_scaling_factor: the weights sum to the factor;
- groups of one expert, topk_group == n_group and n_group == 1 all route as no group limit
  (vLLM falls back to its ungrouped router for one-expert groups);
- ids int64 (HF; vLLM's int32 is a storage choice), weights fp32.

Where the references differ among themselves or leave a choice open, the tests below pin the
project's choice and say why (ties, NaN, the renormalization guard, the logits' dtype).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # triton reads this once, when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe.router import route  # noqa: E402

BACKENDS = ["torch", "triton"]


@pytest.fixture(scope="module")
def kernel_ok():
    """The fused kernel runs here: interpreted on CPU (CUDA machines run the GPU tests instead)."""
    pytest.importorskip("triton")
    from moe.kernels import routing

    if type(routing._route_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    return routing


# ---------------------------------------------------------------- the reference
def ref_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """fp32 scores, computed in float64 and rounded once (so equal logits score equal)."""
    x = logits.double()
    if scoring == "softmax":
        s = torch.softmax(x, dim=-1)
    elif scoring == "sigmoid":
        s = torch.sigmoid(x)
    else:
        s = torch.where(x > 20, x, torch.nn.functional.softplus(x, threshold=1e9)).sqrt()
    return s.float()


def _pick(values: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[T, N] -> [T, k] indices: k rounds of the largest value, lowest index among equals; NaN ranks
    above every number (torch.topk's order). Only `allowed` entries take part; picked ones leave."""
    T, N = values.shape
    live = torch.ones(T, N, dtype=torch.bool) if allowed is None else allowed.clone()
    idx = torch.arange(N).expand(T, N)
    out = []
    for _ in range(k):
        nan = torch.isnan(values) & live
        best = torch.where(live & ~nan, values, -math.inf).amax(dim=1, keepdim=True)
        hit = torch.where(nan.any(dim=1, keepdim=True), nan, live & ~nan & (values == best))
        choice = torch.where(hit, idx, N).amin(dim=1)
        out.append(choice)
        live = live & (idx != choice[:, None])
    return torch.stack(out, dim=1)


def ref_route(logits, *, top_k, scoring, bias=None, n_group=None, topk_group=None, renormalize=True,
              scaling=1.0, input_ids=None, tid2eid=None, token_mask=None):
    """HF / vLLM routing as whole-tensor operations. Returns (ids int64 [T, K], weights fp32 [T, K])."""
    scores = ref_scores(logits, scoring)
    T, E = scores.shape
    if tid2eid is not None:
        tok = input_ids.long() if token_mask is None else torch.where(token_mask, input_ids.long(), 0)
        ids = tid2eid.long()[tok]
    else:
        choice = scores if bias is None else scores + bias.float()
        keep = None
        if n_group is not None and n_group > 1:
            size = E // n_group
            grouped = choice.view(T, n_group, size)
            if bias is not None and size > 1:
                group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # a repeated maximum counts twice
            else:  # (one expert a group: its value; twice it would rank the groups the same)
                group_score = torch.where(torch.isnan(grouped).any(-1), math.nan, grouped.amax(dim=-1))
            keep = torch.zeros(T, n_group, dtype=torch.bool)
            keep.scatter_(1, _pick(group_score, topk_group), True)
            # HF and vLLM fill the dropped groups with -inf and run the top-k over all E; the same
            # thing unless a kept expert's own score is -inf (a bias of -inf): then it ties with the
            # fill, and docs/numerics.md 2.4 keeps the top-k inside the kept groups
            keep = keep.repeat_interleave(size, dim=1)
        ids = _pick(choice, top_k, keep)
    w = scores.gather(1, ids)
    if renormalize:
        total = w.sum(dim=-1, keepdim=True)
        w = torch.where(total > 0, w / total, w)  # vLLM's grouped_topk and V4 kernel: a plain division
    w = w * scaling
    if token_mask is not None:
        ids = torch.where(token_mask[:, None], ids, -1)
        w = torch.where(token_mask[:, None], w, 0.0)
    return ids, w.float()


def _assert_routes_alike(res, ref_ids, ref_w, ordered: bool, what=""):
    """ids equal (in order, or as sets per token), weights matched id by id (NaN equal to NaN)."""
    assert res.topk_ids.dtype == torch.int64 and res.topk_weights.dtype == torch.float32, what
    ids, w = res.topk_ids, res.topk_weights
    if not ordered:
        ids, o = ids.sort(dim=1)
        w = w.gather(1, o)
        ref_ids, o = ref_ids.sort(dim=1)
        ref_w = ref_w.gather(1, o)
    assert torch.equal(ids, ref_ids), f"{what}\n{ids}\n{ref_ids}"
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- fresh random inputs
_PRESETS = {  # name: (E, K, scoring, bias, n_group, topk_group, renormalize, scaling)
    "V3 (sigmoid + bias, 8 groups keep 4)": (64, 8, "sigmoid", True, 8, 4, True, 2.5),
    "V4 (sqrt_softplus + bias)": (48, 6, "sqrt_softplus", True, None, None, True, 1.5),
    "V2 (softmax, groups by max, no renorm)": (32, 6, "softmax", False, 4, 2, False, 16.0),
    "softmax + bias, groups": (24, 4, "softmax", True, 3, 2, True, 1.0),
    "sigmoid, no bias, groups by max": (32, 4, "sigmoid", False, 8, 3, True, 1.0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", list(_PRESETS))
def test_fresh_random_logits_route_as_the_reference(kernel_ok, backend, preset):
    """Gaussian logits (std 0.5 to 4) and biases: no exact ties, and near-ties (4 ulps) are too rare to
    meet at these seeds; ids compared as sets (the references return them unsorted)."""
    E, K, scoring, has_bias, n_group, topk_group, renormalize, scaling = _PRESETS[preset]
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    for std in (0.5, 4.0):
        kw = dict(logits=torch.randn(33, E, generator=g) * std, top_k=K, scoring=scoring,
                  bias=torch.randn(E, generator=g) * 0.2 if has_bias else None, n_group=n_group,
                  topk_group=topk_group, renormalize=renormalize, scaling=scaling)
        _assert_routes_alike(route(backend=backend, **kw), *ref_route(**kw), ordered=False,
                             what=f"{preset} std {std} seed {seed}")


def _awkward_cases(n=60, seed=3):
    """Logits on a grid of 0.5 (many exact ties) with NaN, +inf and -inf sprinkled in, biases on a grid
    of 0.25 with some -inf and +inf (a group holding both scores NaN), one-expert groups, top_k up to
    what the kept groups hold, renormalize on and off, padding rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        n_group = (1, 2, 4, 8)[i % 4]
        size = (1, 2, 3, 4)[(i // 4) % 4]
        E = n_group * size
        grouped = n_group > 1 and i % 5 != 0
        topk_group = int(torch.randint(1, n_group + 1, (1,), generator=g)) if grouped else None
        K = int(torch.randint(1, min(8, topk_group * size if grouped else E) + 1, (1,), generator=g))
        logits = torch.randint(-3, 4, (5, E), generator=g).float() / 2
        u = torch.rand(5, E, generator=g)
        logits = torch.where(u < 0.05, math.nan, torch.where(u < 0.1, math.inf, torch.where(u < 0.15, -math.inf, logits)))
        bias = None
        if i % 2:
            bias = torch.randint(-2, 3, (E,), generator=g).float() / 4
            if i % 4 == 1:
                v = torch.rand(E, generator=g)
                bias = torch.where(v < 0.15, -math.inf, torch.where(v < 0.25, math.inf, bias))
        mask = torch.rand(5, generator=g) > 0.2 if i % 3 == 0 else None
        out.append(dict(logits=logits, top_k=K, scoring=("softmax", "sigmoid", "sqrt_softplus")[i % 3], bias=bias,
                        n_group=n_group if grouped else None, topk_group=topk_group, renormalize=i % 5 != 2,
                        scaling=(1.0, 2.5)[i % 2], token_mask=mask))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_awkward_inputs_route_as_the_reference_in_order(kernel_ok, backend):
    """Ties, NaN and infinities: the ids in order (ties to the lowest index, NaN first), weights NaN
    where the reference's are."""
    for i, kw in enumerate(_awkward_cases()):
        _assert_routes_alike(route(backend=backend, **kw), *ref_route(**kw), ordered=True, what=f"case {i}: {kw}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_layers_route_as_the_reference(kernel_ok, backend):
    g = torch.Generator().manual_seed(5)
    table = torch.randint(0, 24, (50, 6), generator=g, dtype=torch.int32)
    for scoring in ("sqrt_softplus", "sigmoid", "softmax"):
        kw = dict(logits=torch.randn(17, 24, generator=g) * 3, top_k=6, scoring=scoring, scaling=1.5,
                  bias=torch.randn(24, generator=g), tid2eid=table, input_ids=torch.randint(0, 50, (17,), generator=g),
                  token_mask=torch.rand(17, generator=g) > 0.3)
        _assert_routes_alike(route(backend=backend, **kw), *ref_route(**kw), ordered=True, what=scoring)


# ---------------------------------------------------------------- HF transformers' routers themselves
def _hf(module: str):
    pytest.importorskip("transformers")
    return pytest.importorskip(f"transformers.models.{module}.modeling_{module}")


def _randomized(router, seed, bias_scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * bias_scale)
    return router, torch.randn(40, router.hidden_dim, generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_deepseek_v3_router(kernel_ok, backend):
    v3 = _hf("deepseek_v3")
    config = v3.DeepseekV3Config(hidden_size=16, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                                 routed_scaling_factor=2.5, norm_topk_prob=True)
    hf, x = _randomized(v3.DeepseekV3TopkRouter(config), 21)
    with torch.no_grad():
        logits, w, ids = hf(x)
    res = route(logits, top_k=8, scoring="sigmoid", bias=hf.e_score_correction_bias, n_group=8, topk_group=4,
                scaling=2.5, backend=backend)
    _assert_routes_alike(res, ids.long(), w, ordered=False, what="HF DeepseekV3TopkRouter")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_hf_deepseek_v2_router(kernel_ok, backend, topk_method):
    """V2: softmax, no renormalization, groups ranked by their max score (HF masks the dropped groups
    with 0, which for positive softmax scores is -inf's order)."""
    v2 = _hf("deepseek_v2")
    config = v2.DeepseekV2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=32, num_experts_per_tok=6, n_group=4, topk_group=2,
                                 topk_method=topk_method, routed_scaling_factor=16.0)
    hf, x = _randomized(v2.DeepseekV2TopkRouter(config), 22)
    with torch.no_grad():
        logits, w, ids = hf(x)
    grouped = topk_method == "group_limited_greedy"
    res = route(logits, top_k=6, scoring="softmax", n_group=4 if grouped else None, topk_group=2 if grouped else None,
                renormalize=False, scaling=16.0, backend=backend)
    _assert_routes_alike(res, ids.long(), w, ordered=False, what=f"HF DeepseekV2TopkRouter {topk_method}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_deepseek_v4_routers(kernel_ok, backend):
    v4 = _hf("deepseek_v4")
    config = v4.DeepseekV4Config(hidden_size=16, n_routed_experts=48, num_experts_per_tok=6, vocab_size=64,
                                 routed_scaling_factor=1.5)
    hf, x = _randomized(v4.DeepseekV4TopKRouter(config).float(), 23)
    with torch.no_grad():
        logits, w, ids = hf(x)
    res = route(logits, top_k=6, scoring="sqrt_softplus", bias=hf.e_score_correction_bias, scaling=1.5,
                backend=backend)
    _assert_routes_alike(res, ids.long(), w, ordered=False, what="HF DeepseekV4TopKRouter")

    hash_hf, x = _randomized(v4.DeepseekV4HashRouter(config).float(), 24)
    g = torch.Generator().manual_seed(25)
    with torch.no_grad():
        hash_hf.tid2eid.copy_(torch.randint(0, 48, (64, 6), generator=g))
        input_ids = torch.randint(0, 64, (40,), generator=g)
        logits, w, ids = hash_hf(x, input_ids)
    res = route(logits, top_k=6, scoring="sqrt_softplus", scaling=1.5, tid2eid=hash_hf.tid2eid, input_ids=input_ids,
                backend=backend)
    _assert_routes_alike(res, ids.long(), w, ordered=True, what="HF DeepseekV4HashRouter")


# ---------------------------------------------------------------- where the references leave it open or differ
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lowest_index_as_vllms_kernels_choose(kernel_ok, backend):
    """Equal selection scores: HF's torch.topk(sorted=False) leaves the winner to the topk
    implementation (torch's CPU topk returns experts 9-12 of 16 equal ones, CUDA others); vLLM's fused
    kernels (the DeepSeek-V4 top-k, the CUDA grouped top-k's stable sort) take the lowest index. It
    matters: tied experts have the same weight but run different FFNs. The project follows vLLM, in
    the group choice and in the expert choice."""
    logits = torch.zeros(2, 16)
    res = route(logits, top_k=4, scoring="sigmoid", bias=torch.zeros(16), n_group=4, topk_group=2, backend=backend)
    assert res.topk_ids.tolist() == [[0, 1, 2, 3]] * 2
    res = route(logits, top_k=4, scoring="sigmoid", bias=torch.tensor([0.0, 1.0] * 8), n_group=4, topk_group=2,
                backend=backend)
    assert res.topk_ids.tolist() == [[1, 3, 5, 7]] * 2          # groups 0 and 1 (all four tie), odd experts
    torch.testing.assert_close(res.topk_weights, torch.full((2, 4), 0.25))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_expert_groups_and_keeping_every_group_route_as_no_group_limit(kernel_ok, backend):
    """HF's and vLLM's torch top-2 needs two experts a group; vLLM routes a layer with one-expert groups
    (num_experts <= n_group) by its ungrouped router. A one-expert group scores its one value, whose
    order is twice its order, so the kept groups are the topk_group best experts and the top-k of
    them the top-k overall (top_k <= topk_group there). topk_group == n_group and n_group == 1 keep
    everything."""
    g = torch.Generator().manual_seed(31)
    logits, bias = torch.randn(25, 16, generator=g) * 2, torch.randn(16, generator=g) * 0.3
    free = route(logits, top_k=5, scoring="sigmoid", bias=bias, scaling=2.5, backend=backend)
    for n_group, topk_group in ((16, 5), (16, 16), (4, 4), (1, 1)):
        res = route(logits, top_k=5, scoring="sigmoid", bias=bias, n_group=n_group, topk_group=topk_group,
                    scaling=2.5, backend=backend)
        assert torch.equal(res.topk_ids, free.topk_ids), (n_group, topk_group)
        assert torch.equal(res.topk_weights, free.topk_weights), (n_group, topk_group)


@pytest.mark.parametrize("backend", BACKENDS)
def test_renormalize_then_scale_and_tiny_sums(kernel_ok, backend):
    """All references renormalize first and scale after: the weights sum to routed_scaling_factor. For
    the guard they differ: vLLM's grouped_topk divides by the sum as it is (0/0 = NaN), its V4 kernel
    and the project divide only a sum > 0, HF adds 1e-20 to the sum (V3 and V4) and vLLM's V4 torch
    fallback clamps it at 1e-20. They agree for any sum above ~1e-13; below, HF's weights no longer sum
    to the factor (here 8 scores of sigmoid(-60) = 8.8e-27: HF's sum is 2.5 * 7e-6). The project keeps
    the defining property (sum = factor) as vLLM's grouped_topk and V4 kernel do, and a sum of
    exactly 0 stays 0 as in HF."""
    logits = torch.full((1, 16), -60.0) + torch.arange(16.0) * 1e-3
    res = route(logits, top_k=8, scoring="sigmoid", scaling=2.5, backend=backend)
    torch.testing.assert_close(res.topk_weights.sum(), torch.tensor(2.5))
    w = torch.sigmoid(logits).gather(1, res.topk_ids)
    hf_like = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    assert hf_like.sum() < 1e-4                                   # HF's, for the record
    zero = route(torch.full((1, 8), -math.inf), top_k=3, scoring="sigmoid", scaling=2.5, backend=backend)
    assert torch.equal(zero.topk_weights, torch.zeros(1, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_among_the_k_weights(kernel_ok, backend):
    """A NaN logit: its expert ranks first (torch.topk's order, so HF and vLLM's torch paths; vLLM's V4
    kernel maps NaN to -1e30 and ranks it last instead) and its weight is NaN. HF and vLLM's torch paths
    then divide every weight by a NaN sum (all K NaN); the project, like vLLM's V4 kernel, divides only
    by a sum > 0 and leaves the other K-1 weights unnormalized (docs/numerics.md 2.6). The token's
    output, sum_k w_k * y_k, is NaN either way, so no routed result differs."""
    logits = torch.tensor([[0.3, math.nan, -1.0, 2.0, 0.1, -0.5]])
    res = route(logits, top_k=3, scoring="sigmoid", backend=backend)
    assert res.topk_ids.tolist() == [[1, 3, 0]]
    assert torch.isnan(res.topk_weights[0, 0]) and not torch.isnan(res.topk_weights[0, 1:]).any()
    y = torch.randn(3, 4)
    assert torch.isnan((res.topk_weights[0, :, None] * y).sum(0)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_logits_are_scored_in_fp32(kernel_ok, backend):
    """HF's V3 router computes fp32 logits (x and the gate weight taken to fp32), vLLM's DeepSeek router
    GEMMs return fp32 (its V4 kernel requires fp32 logits); vLLM's torch grouped_topk would score bf16
    logits in bf16 (0.5 granularity of ties). route() takes any float logits to fp32 first: the same
    result as the fp32 copy of the bf16 logits, ids int64, weights fp32."""
    g = torch.Generator().manual_seed(41)
    logits = (torch.randn(20, 32, generator=g) * 3).to(torch.bfloat16)
    kw = dict(top_k=4, scoring="sigmoid", bias=torch.randn(32, generator=g) * 0.1, n_group=4, topk_group=2,
              scaling=2.5, backend=backend)
    low, high = route(logits, **kw), route(logits.float(), **kw)
    assert low.topk_ids.dtype == torch.int64 and low.topk_weights.dtype == torch.float32
    assert torch.equal(low.topk_ids, high.topk_ids) and torch.equal(low.topk_weights, high.topk_weights)
