"""mHC (model/mhc.py, the mHC parts of model/reference.py) against HF transformers' DeepSeek-V4
modules themselves: DeepseekV4HyperConnection, DeepseekV4HyperHead, DeepseekV4DecoderLayer's
mixing and DeepseekV4Model's expand / collapse, built with random weights at small sizes.

The weights go through the project's checkpoint mapping (`mhc_checkpoint_params`, HF names and
DeepSeek's, the latter checked against HF's own conversion rules), never by hand.

What the references agree on and the project follows: RMS over the flattened M*H streams with
rms_norm_eps, one projection fn [(2+M)M, M*H], pre = sigmoid(.) + hc_eps, post = 2 sigmoid(.),
comb = row softmax + hc_eps then Sinkhorn (columns first, then rows / columns, eps in every
denominator), new_j = sum_i comb[i, j] x_i + post_j f(x), all of it fp32, the layer input and
the head in fp32 rounded once to the residual's dtype.

The one place HF differs: its decoder layer rounds post and comb to the residual's dtype and
mixes in that dtype (`post.to(dtype) * out + comb.to(dtype).T @ residual`); DeepSeek's own
inference code (hc_post: fp32 post and comb times the bf16 tensors, i.e. fp32 products and sums,
then `type_as`) and the project mix in fp32 and round once. On bf16 that is a few bf16 ulps
between HF and the project; `test_bf16_post_is_fp32_math_rounded_once` pins that the project is
the correctly rounded one (and never further from the exact value than HF).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from model import reference  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.mhc import (mhc_broadcast, mhc_checkpoint_params, mhc_head, mhc_post, mhc_post_pre,  # noqa: E402
                       mhc_pre, mhc_pre_broadcast)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

H = 16


def _config(m: int = 4, *, iters: int = 20, hc_eps: float = 1e-6, rms_eps: float = 1e-6, layers: int = 1):
    return transformers.DeepseekV4Config(
        hidden_size=H, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, vocab_size=32,
        num_hidden_layers=layers, mlp_layer_types=["moe"] * layers, num_attention_heads=2, hc_mult=m,
        hc_sinkhorn_iters=iters, hc_eps=hc_eps, rms_norm_eps=rms_eps)


def _randomize_hc(module: torch.nn.Module, seed: int, spread: float = 1.0) -> None:
    """fn so that the mix logits are O(1-3) (per-token coefficients that differ), base off-centre,
    scales away from 1: every gate and the Sinkhorn input far from trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("fn"):
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 * spread / math.sqrt(p.shape[1]))
            elif name.endswith("base"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def _state(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in module.state_dict().items()}


def _residual(kind: str, t: int, m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, m, H, generator=g)
    if kind == "zero_rows":      # all-zero tokens (coefficients from base alone) and one zero stream
        x[::3] = 0
        x[1, 0] = 0
    elif kind == "large":        # 1e4 .. 1e12 per token; one whose squares overflow fp32 (rstd = 0 in both)
        x = x * torch.logspace(4, 12, t).reshape(t, 1, 1)
        x[-1] = x[-1].sign() * 1e25
    elif kind == "tiny":         # RMS near and below sqrt(rms_eps): rms_eps matters
        x = x * torch.logspace(-8, -2, t).reshape(t, 1, 1)
    elif kind == "equal":        # the first layer: M equal streams
        x = x[:, :1].expand(t, m, H).contiguous()
    return x.to(dtype)


@pytest.fixture(scope="module")
def interpreted_kernels():
    """model/triton_mhc.py under Triton's interpreter (CPU only; the GPU tests cover CUDA)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run where there is no GPU")
    pytest.importorskip("triton")
    import importlib

    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction

    import model.triton_mhc as kernels

    if not isinstance(tl_standard.zeros, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 earlier in this session")
    if not isinstance(kernels._mix_kernel, InterpretedFunction):
        importlib.reload(kernels)
    return kernels


BACKENDS = ["torch", "triton"]


def _need(request, backend: str, m: int = 4) -> None:
    """backend "triton": the kernels under the interpreter (a power-of-two M only)."""
    if backend == "triton":
        if m & (m - 1):
            pytest.skip("the Triton kernels need a power-of-two M")
        request.getfixturevalue("interpreted_kernels")


# ---- DeepseekV4HyperConnection / HyperHead against mhc_pre / mhc_post / mhc_head, fp32 -------------

CASES = [  # (M, T, iterations, hc_eps, rms_eps, residual kind)
    (4, 7, 20, 1e-6, 1e-6, "normal"),
    (4, 9, 20, 1e-6, 1e-6, "zero_rows"),
    (4, 6, 20, 1e-6, 1e-6, "large"),
    (4, 6, 20, 1e-6, 1e-5, "tiny"),
    (4, 5, 20, 1e-6, 1e-6, "equal"),
    (4, 5, 3, 1e-3, 1e-4, "normal"),
    (2, 5, 20, 1e-6, 1e-6, "normal"),
    (1, 4, 20, 1e-6, 1e-6, "normal"),
    (1, 4, 1, 0.0, 1e-6, "zero_rows"),
    (3, 5, 7, 1e-6, 1e-6, "normal"),
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's x*x of 1e25
@pytest.mark.parametrize("backend,m,t,iters,hc_eps,rms_eps,kind",
                         [(b, *c) for c in CASES for b in BACKENDS if b == "torch" or not c[0] & (c[0] - 1)],
                         ids=[f"{b}-M{c[0]}-{c[5]}-it{c[2]}" for c in CASES for b in BACKENDS
                              if b == "torch" or not c[0] & (c[0] - 1)])   # (the kernels take power-of-two M)
def test_hyper_connection_and_head_match_hf_fp32(request, backend, m, t, iters, hc_eps, rms_eps, kind):
    _need(request, backend, m)
    config = _config(m, iters=iters, hc_eps=hc_eps, rms_eps=rms_eps)
    hc, head = v4.DeepseekV4HyperConnection(config), v4.DeepseekV4HyperHead(config)
    _randomize_hc(hc, 10 * m + t)
    _randomize_hc(head, 10 * m + t + 1)
    state = {**_state("model.layers.0.ffn_hc", hc), **_state("model.hc_head", head)}
    fn, base, scale = mhc_checkpoint_params(state, "ffn", 0, naming="hf")
    hfn, hbase, hscale = mhc_checkpoint_params(state, "head", naming="hf")
    res = _residual(kind, t, m, torch.float32, seed=t)
    out = torch.randn(t, H, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        post, comb, collapsed = hc(res.reshape(1, t, m, H))
        want_new = post[0].unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), res)
        want_head = head(res.reshape(1, t, m, H))[0]
    kw = dict(sinkhorn_iters=iters, eps=hc_eps, rms_eps=rms_eps, backend=backend)
    got = mhc_pre(res, fn, base, scale, **kw)
    scale_of = res.abs().amax(dim=(1, 2)).clamp_min(1e-30)  # per token: atol relative to its magnitude
    def close(a, b, mag):
        err = (a - b).abs() / mag.reshape(-1, *[1] * (a.dim() - 1))
        assert err.max() <= 2e-6, f"max relative error {err.max().item():.3g}"
    close(got.layer_input, collapsed[0], scale_of)
    torch.testing.assert_close(got.post, post[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.comb, comb[0], rtol=1e-5, atol=1e-6)
    new = mhc_post(out, res, got.post, got.comb, backend=backend)
    close(new, want_new, torch.maximum(scale_of, out.abs().amax(-1)))
    close(mhc_head(res, hfn, hbase, hscale, eps=hc_eps, rms_eps=rms_eps, backend=backend), want_head, scale_of)
    if kind == "equal":  # the first layer's entry without the M copies
        b = mhc_pre_broadcast(res[:, 0], fn, base, scale, **kw)
        close(b.layer_input, collapsed[0], scale_of)
        torch.testing.assert_close(b.post, post[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.comb, comb[0], rtol=1e-5, atol=1e-6)


def test_sinkhorn_order_and_eps_matter_so_the_comparison_can_fail():
    """The fp32 comparison above tells the variants one could get wrong apart: rows first, eps
    outside the denominators, softmax over the other axis, exp without softmax, comb untransposed."""
    config = _config(4, iters=3, hc_eps=1e-2)
    hc = v4.DeepseekV4HyperConnection(config)
    _randomize_hc(hc, 5)
    res = _residual("normal", 6, 4, torch.float32, seed=5)
    with torch.no_grad():
        _, comb, _ = hc(res.reshape(1, 6, 4, H))
    got = mhc_pre(res, hc.fn.detach(), hc.base.detach(), hc.scale.detach(), sinkhorn_iters=3, eps=1e-2,
                  backend="torch")
    torch.testing.assert_close(got.comb, comb[0], rtol=1e-5, atol=1e-6)
    mix = (res.reshape(6, -1) @ hc.fn.detach().t()) * torch.rsqrt(res.reshape(6, -1).square().mean(-1, True) + 1e-6)
    logits = mix[:, 8:].reshape(6, 4, 4) * hc.scale.detach()[2] + hc.base.detach()[8:].reshape(4, 4)

    def sk(c, first, eps_in=True):
        axes = [-2, -1] if first == "cols" else [-1, -2]
        div = (lambda c, ax: c / (c.sum(ax, keepdim=True) + 1e-2)) if eps_in else \
              (lambda c, ax: c / c.sum(ax, keepdim=True) + 1e-2)
        c = div(c, axes[0])
        for _ in range(2):
            c = div(div(c, axes[1]), axes[0])
        return c

    variants = {
        "rows first": sk(logits.softmax(-1) + 1e-2, "rows"),
        "eps outside": sk(logits.softmax(-1) + 1e-2, "cols", eps_in=False),
        "softmax over columns": sk(logits.softmax(-2) + 1e-2, "cols"),
        "exp, no softmax": sk(logits.exp() + 1e-2, "cols"),
        "transposed": sk(logits.softmax(-1) + 1e-2, "cols").transpose(1, 2),
    }
    torch.testing.assert_close(sk(logits.softmax(-1) + 1e-2, "cols"), comb[0].detach(), rtol=1e-5, atol=1e-6)
    for name, c in variants.items():
        assert (c - comb[0]).abs().max() > 1e-4, name


# ---- bf16: the dtypes HF uses (fp32 mHC parameters, bf16 residual) -----------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["normal", "zero_rows", "large"])
def test_hyper_connection_matches_hf_on_a_bf16_residual(request, backend, kind):
    """HF keeps attn_hc / ffn_hc / hc_head in fp32 (_keep_in_fp32_modules_strict) and feeds them the
    bf16 residual: the coefficients are fp32 math on the bf16 values, the layer input and the head
    fp32 sums rounded once to bf16. Same in the project: post / comb to fp32 accuracy, the bf16
    outputs within one bf16 rounding (the fp32 sums differ in their last bits)."""
    _need(request, backend)
    m, t = 4, 8
    config = _config(m)
    hc, head = v4.DeepseekV4HyperConnection(config), v4.DeepseekV4HyperHead(config)
    _randomize_hc(hc, 3)
    _randomize_hc(head, 4)
    res = _residual(kind, t, m, torch.bfloat16, seed=11)
    with torch.no_grad():
        post, comb, collapsed = hc(res.reshape(1, t, m, H))
        want_head = head(res.reshape(1, t, m, H))[0]
    assert collapsed.dtype == want_head.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    fn, base, scale = (p.detach() for p in (hc.fn, hc.base, hc.scale))
    got = mhc_pre(res, fn, base, scale, backend=backend)
    assert got.layer_input.dtype == torch.bfloat16 and got.post.dtype == got.comb.dtype == torch.float32
    torch.testing.assert_close(got.post, post[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.comb, comb[0], rtol=1e-5, atol=1e-6)
    bf16_ulp = dict(rtol=2 ** -7, atol=1e-30)
    torch.testing.assert_close(got.layer_input.float(), collapsed[0].float(), **bf16_ulp)
    got_head = mhc_head(res, *(p.detach() for p in (head.hc_fn, head.hc_base, head.hc_scale)), backend=backend)
    torch.testing.assert_close(got_head.float(), want_head.float(), **bf16_ulp)


@pytest.mark.parametrize("backend,device", [("torch", "cpu"), ("triton", "cpu"),
                                            pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
def test_bf16_post_is_fp32_math_rounded_once(request, backend, device):
    """The one difference: HF's decoder layer mixes in bf16 (post and comb rounded to bf16, a bf16
    product and matmul), DeepSeek's hc_post and the project in fp32 with one rounding at the end.
    The project's new residual is the exact value correctly rounded (within fp32's error), HF's is
    a few bf16 ulps off; both are pinned here, and the project is never further from the exact value.

    Triton's interpreter truncates fp32 -> bf16 casts (triton/runtime/interpreter.py cast_impl
    passes no rounding mode to _convert_float); on CUDA `.to(tl.bfloat16)` rounds to nearest
    even. So interpreted, the kernels' bf16 outputs are pinned within one ulp, on the GPU to half."""
    if device == "cpu":
        _need(request, backend)
    interpreted = backend == "triton" and device == "cpu"
    m, t = 4, 64
    config = _config(m)
    hc = v4.DeepseekV4HyperConnection(config)
    _randomize_hc(hc, 7)
    g = torch.Generator().manual_seed(7)
    res = (torch.randn(t, m, H, generator=g) * 3).bfloat16()
    out = (torch.randn(t, H, generator=g) * 3).bfloat16()
    with torch.no_grad():
        post, comb, _ = hc(res.reshape(1, t, m, H))
    post, comb = post[0], comb[0]
    exact = post.double().unsqueeze(-1) * out.double().unsqueeze(1) + comb.double().transpose(1, 2) @ res.double()
    hf = post.to(res.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(res.dtype).transpose(-1, -2), res)
    ours = mhc_post(out.to(device), res.to(device), post.to(device), comb.to(device), backend=backend).cpu()
    assert ours.dtype == hf.dtype == torch.bfloat16
    # fp32 math may be off the exact value by a few fp32 ulps of the terms (cancellation); above that
    # one rounding to bf16: half a bf16 ulp of the result
    terms = (post.double().unsqueeze(-1) * out.double().unsqueeze(1)).abs() + \
        comb.double().transpose(1, 2) @ res.double().abs()
    half_ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 8)
    slack = terms * 2.0 ** -20
    err_ours, err_hf = (ours.double() - exact).abs(), (hf.double() - exact).abs()
    bound = half_ulp * (2 if interpreted else 1) + slack
    assert (err_ours <= bound).all(), (err_ours - bound).max().item()
    if interpreted:
        return
    assert (err_ours <= err_hf + slack).all()
    # HF's roundings of post, comb, the products and the matmul: up to a few bf16 ulps of the terms
    in_term_ulps = err_hf / (terms * 2.0 ** -8)
    assert 0.5 < in_term_ulps.max().item() <= 4, in_term_ulps.max().item()
    assert (err_hf > err_ours + slack).sum() > exact.numel() // 20   # and it shows on many entries


# ---- DeepseekV4DecoderLayer / DeepseekV4Model with stub sublayers --------------------------------------

class _Attn(torch.nn.Module):
    """Stands in for DeepseekV4Attention: (f(x), None), any dtype in and out."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.w = torch.randn(H, H, generator=torch.Generator().manual_seed(seed)) / math.sqrt(H)

    def forward(self, x, **kwargs):
        return torch.tanh(x.float() @ self.w).to(x.dtype) * 2, None


class _Mlp(_Attn):
    def forward(self, x, input_ids=None, **kwargs):  # noqa: ARG002
        return (torch.sin(x.float() @ self.w) * 1.5).to(x.dtype)


def _stub_model(m: int, layers: int, seed: int):
    config = _config(m, layers=layers, iters=20)
    model = v4.DeepseekV4Model(config).eval()
    for i, layer in enumerate(model.layers):
        layer.self_attn, layer.mlp = _Attn(seed + 2 * i), _Mlp(seed + 2 * i + 1)
        _randomize_hc(layer.attn_hc, seed + 10 * i + 3)
        _randomize_hc(layer.ffn_hc, seed + 10 * i + 4)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            with torch.no_grad():
                norm.weight.copy_(1 + 0.2 * torch.randn(H, generator=torch.Generator().manual_seed(seed + i)))
    _randomize_hc(model.hc_head, seed + 1)
    return config, model


def _deepseek_names(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mHC tensors of an HF state dict under DeepSeek's checkpoint names, each checked to be
    what HF's own conversion rules (conversion_mapping "deepseek_v4", then base_model_prefix
    "model.") turn back into the HF name."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    rules = [r for r in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(r, WeightRenaming)]

    def to_hf(name: str) -> str:
        for r in rules:
            name, _ = r.rename_source_key(name)
        return "model." + name

    out = {}
    for hf_name, tensor in hf_state.items():
        if "hc" not in hf_name:
            continue
        body = hf_name.removeprefix("model.")
        ds = (body.replace("attn_hc.", "hc_attn_").replace("ffn_hc.", "hc_ffn_")
              .replace("hc_head.hc_", "hc_head_"))
        assert to_hf(ds) == hf_name, (ds, to_hf(ds), hf_name)
        out[ds] = tensor
    return out


def _ours_trunk(x, model, state, naming, m, backend, fused=True):
    """The project's chain as model/model.py runs it: broadcast, pre, norm, f, post(+next pre), head, norm."""
    kw = dict(sinkhorn_iters=20, eps=1e-6, rms_eps=1e-6, backend=backend)
    sites = [s for i, layer in enumerate(model.layers) for s in (
        (mhc_checkpoint_params(state, "attn", i, naming=naming), layer.input_layernorm,
         lambda h, l=layer: l.self_attn(h)[0]),
        (mhc_checkpoint_params(state, "ffn", i, naming=naming), layer.post_attention_layernorm,
         lambda h, l=layer: l.mlp(h)))]
    residual = mhc_broadcast(x, m)
    pre = mhc_pre_broadcast(x, *sites[0][0], **kw)
    for j, (_, norm, f) in enumerate(sites):
        out = f(norm(pre.layer_input))
        if j + 1 < len(sites):
            if fused:
                residual, pre = mhc_post_pre(out, residual, pre.post, pre.comb, *sites[j + 1][0], **kw)
            else:
                residual = mhc_post(out, residual, pre.post, pre.comb, backend=backend)
                pre = mhc_pre(residual, *sites[j + 1][0], **kw)
        else:
            residual = mhc_post(out, residual, pre.post, pre.comb, backend=backend)
    fh, bh, sh = mhc_checkpoint_params(state, "head", naming=naming)
    return model.norm(mhc_head(residual, fh, bh, sh, eps=1e-6, rms_eps=1e-6, backend=backend)), residual


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("naming", ["hf", "deepseek"])
def test_model_trunk_matches_hf_model_fp32(request, backend, naming):
    """DeepseekV4Model (2 layers, attention and MoE stubbed, everything else HF's): the embedding
    expanded into M streams, two mHC-wrapped sublayers per layer, hc_head and the final norm,
    against the project's chain on weights read through mhc_checkpoint_params (both namings)."""
    _need(request, backend)
    m, b, s = 4, 2, 5
    config, model = _stub_model(m, 2, seed=20)
    hf_state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state = hf_state if naming == "hf" else _deepseek_names(hf_state)
    x = torch.randn(b, s, H, generator=torch.Generator().manual_seed(21)) * 2
    with torch.no_grad():
        want = model(inputs_embeds=x).last_hidden_state
        got, _ = _ours_trunk(x.reshape(b * s, H), model, state, naming, m, backend)
        got_unfused, _ = _ours_trunk(x.reshape(b * s, H), model, state, naming, m, backend, fused=False)
    torch.testing.assert_close(got.reshape(b, s, H), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_unfused.reshape(b, s, H), want, rtol=2e-5, atol=2e-5)


def test_model_trunk_matches_hf_model_bf16():
    """The same with a bf16 embedding (HF's mHC and norms fp32, the residual bf16): equal within
    the bf16 roundings HF's decoder layer adds in its mixing (test_bf16_post_is_fp32_math_rounded_once)."""
    m, b, s = 4, 2, 6
    config, model = _stub_model(m, 2, seed=30)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    x = (torch.randn(b, s, H, generator=torch.Generator().manual_seed(31)) * 2).bfloat16()
    with torch.no_grad():
        want = model(inputs_embeds=x).last_hidden_state
        got, _ = _ours_trunk(x.reshape(b * s, H), model, state, "hf", m, "torch")
    assert want.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().reshape(b, s, H), want.float(), rtol=5e-2, atol=5e-2)


def test_decoder_layer_and_reference_mhc_match_hf():
    """model/reference.py's mhc_sublayer (float64) twice and mhc_collapse against one HF decoder
    layer and hc_head (fp32), on the demo model's names (layers.{i}.attn_mhc.*, head_mhc.*)."""
    m, b, s = 4, 2, 5
    config, model = _stub_model(m, 1, seed=40)
    layer = model.layers[0]
    cfg = ModelConfig(mhc_streams=m, hidden=H, sinkhorn_iters=20, mhc_eps=1e-6, norm_eps=1e-6, quant="bf16")
    state = {}
    for site, hc in (("attn_mhc", layer.attn_hc), ("ffn_mhc", layer.ffn_hc)):
        state.update({f"layers.0.{site}.{k}": v for k, v in hc.state_dict().items()})
    state["layers.0.attn_norm.weight"] = layer.input_layernorm.weight.detach()
    state["layers.0.ffn_norm.weight"] = layer.post_attention_layernorm.weight.detach()
    state.update({"head_mhc.fn": model.hc_head.hc_fn.detach(), "head_mhc.base": model.hc_head.hc_base.detach(),
                  "head_mhc.scale": model.hc_head.hc_scale.detach()})
    streams = torch.randn(b, s, m, H, generator=torch.Generator().manual_seed(41))
    with torch.no_grad():
        want = layer(streams)
        want_head = model.hc_head(want)
    f_attn = lambda h: layer.self_attn(h.float())[0].double()  # noqa: E731
    f_mlp = lambda h: layer.mlp(h.float()).double()  # noqa: E731
    with torch.no_grad():
        got = reference.mhc_sublayer(streams.double(), state, cfg, "layers.0.attn_mhc", "layers.0.attn_norm.weight",
                                     f_attn)
        got = reference.mhc_sublayer(got, state, cfg, "layers.0.ffn_mhc", "layers.0.ffn_norm.weight", f_mlp)
        got_head = reference.mhc_collapse(got, state, cfg)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_head.float(), want_head, rtol=1e-5, atol=1e-5)
