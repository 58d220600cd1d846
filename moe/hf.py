"""MoEConfig from a checkpoint's config: HF transformers' DeepSeek V3 / V4 configs (objects or
config.json dicts) and DeepSeek's own inference `config.json` (ModelArgs names).

Every field that changes the MoE math is read (docs/numerics.md §2-3):

| MoEConfig | HF (deepseek_v3 / deepseek_v4) | DeepSeek inference config |
|---|---|---|
| hidden, inter | hidden_size, moe_intermediate_size | dim, moe_inter_dim |
| num_experts, top_k | n_routed_experts, num_experts_per_tok | n_routed_experts, n_activated_experts |
| scoring | V3: sigmoid (HF's router always uses it); V4: scoring_func | score_func |
| use_bias | always (HF's V3 / V3.2 routers have e_score_correction_bias whatever topk_method says; V4: non-hash layers) | V3: dim == 7168; V4: always |
| n_group, topk_group | V3: n_group, topk_group; V4: none (HF's V4 router has no groups) | n_expert_groups, n_limited_groups |
| renormalize | V3: norm_topk_prob; V4: always (HF's V4 routers ignore norm_topk_prob) | V3: sigmoid; V4: `score_func != "softmax"` |
| routed_scaling | routed_scaling_factor | route_scale |
| swiglu_limit | V4: swiglu_limit (routed experts) | swiglu_limit |
| shared_swiglu_limit | V4: swiglu_limit (HF's DeepseekV4MLP clamps as well) | swiglu_limit |
| num_shared, shared_inter | V3: n_shared_experts, moe_intermediate_size; V4: 1 (HF's one DeepseekV4MLP), moe_intermediate_size | n_shared_experts, moe_inter_dim |
| num_hash_layers, vocab | V4: leading "hash_moe" of mlp_layer_types (or num_hash_layers, else HF's default 3; at most num_hidden_layers), vocab_size | n_hash_layers, vocab_size |
| expert_format | quantization_config: expert_dtype "fp4" -> mxfp4, fp8 -> fp8_block (else quant_method fp8 / mxfp4); other values, and fp8 blocks other than [128, 128], refused | expert_dtype |

A field an HF config.json dict leaves out takes the HF config class's default (`_HF_DEFAULTS`:
e.g. V3 routed_scaling_factor 2.5, n_shared_experts 1, n_group 8 / topk_group 4; V4 1.5), as
`AutoConfig` gives it. V4's mlp_bias=True (biases in HF's shared DeepseekV4MLP) is refused.

Where HF and DeepSeek could disagree: the V4 shared expert's clamp. DeepSeek's inference code
(V4 `MoE`: `Expert(dim, moe_inter_dim, swiglu_limit=args.swiglu_limit)` for the shared expert,
as ports that follow it, e.g. sglang's DeepSeek-V4 MLP, also do) and HF agree that it is clamped
with the routed experts' limit; we follow both. Layer indices: `MoEConfig.for_layer(i)` takes the
index among MoE layers (V3's first `first_k_dense_replace` decoder layers are dense MLPs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SCORING = {"sigmoid": "sigmoid", "softmax": "softmax", "sqrtsoftplus": "sqrt_softplus",
            "sqrt_softplus": "sqrt_softplus"}
MODEL_TYPES: tuple[str, ...] = ("deepseek_v3", "deepseek_v32", "deepseek_v4")
_HF_V4_HASH_LAYERS = 3  # DeepseekV4Config.default_num_hash_layers (mlp_layer_types and num_hash_layers absent)
# HF's config-class defaults of the fields read here: a config.json dict that leaves one out gets
# this value from AutoConfig / DeepseekV3Config(**d), so it gets it here too (V3.2 shares V3's)
_HF_V3_DEFAULTS: dict[str, Any] = dict(
    hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True, hidden_act="silu")
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": _HF_V3_DEFAULTS, "deepseek_v32": _HF_V3_DEFAULTS,
    "deepseek_v4": dict(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6,
                        routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0, vocab_size=129280,
                        num_hidden_layers=43, norm_topk_prob=True, hidden_act="silu", mlp_bias=False),
}


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        d = dict(config)
    elif hasattr(config, "to_dict"):
        d = config.to_dict()
        for k in ("mlp_layer_types",):  # (set in __post_init__; to_dict keeps them, but be safe)
            if getattr(config, k, None) is not None:
                d[k] = getattr(config, k)
    else:
        raise ValueError(f"config must be a transformers config or a config.json dict, got {type(config).__name__}")
    text = d.get("text_config")
    if isinstance(text, Mapping) and "hidden_size" not in d:
        d = {**dict(text), "quantization_config": d.get("quantization_config", text.get("quantization_config"))}
    return d


_UNQUANTIZED = (None, "bf16", "bfloat16")


def _expert_format(d: dict) -> str | None:
    """The routed experts' format from expert_dtype (DeepSeek's name) or quantization_config's
    quant_method; None: the layer's default. A value it does not know is a ValueError: taken as
    the default, the checkpoint's quantized tensors failed to load (or loaded as something else)."""
    q = d.get("quantization_config") or {}
    dtype = q.get("expert_dtype", d.get("expert_dtype"))
    method = q.get("quant_method")
    if dtype in ("fp4", "mxfp4"):
        return "mxfp4"
    block = q.get("weight_block_size")
    if (dtype == "fp8" or dtype is None and method == "fp8") and block is not None and list(block) != [128, 128]:
        raise ValueError(f"quantization_config weight_block_size {list(block)} is not supported: fp8 experts "
                         f"take [128, 128] blocks")
    if dtype == "fp8":
        return "fp8_block"
    if dtype not in _UNQUANTIZED:
        raise ValueError(f"expert_dtype {dtype!r} is not supported (fp4 / mxfp4, fp8, bf16)")
    if dtype is None and method == "fp8":
        return "fp8_block"
    if dtype is None and method == "mxfp4":
        return "mxfp4"
    if dtype is None and method is not None:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported (fp8 with [128, 128] "
                         f"blocks, mxfp4)")
    return None


def _limit(v: Any) -> float | None:
    return float(v) if v else None  # 0 / None: no clamp (DeepSeek's Expert uses 0 for "none")


def _num_hash_layers(d: dict) -> int:
    types = d.get("mlp_layer_types")
    if types:
        n = 0
        while n < len(types) and types[n] == "hash_moe":
            n += 1
        later = [i for i, t in enumerate(types) if t == "hash_moe" and i >= n]
        if later:  # (MoEConfig.for_layer makes the first num_hash_layers layers the hash ones)
            raise ValueError(f"mlp_layer_types has hash_moe layers at {later}, after the leading {n}; "
                             "only leading hash layers are supported")
        return n
    n = d.get("num_hash_layers", d.get("n_hash_layers"))
    if n is None:  # neither given: HF's DeepseekV4Config makes its first 3 layers hash layers
        n = _HF_V4_HASH_LAYERS
    layers = d.get("num_hidden_layers")
    return min(int(n), int(layers)) if layers is not None else int(n)


def moe_kwargs_from_hf(config: Any) -> dict:
    """MoEConfig keyword arguments for a DeepSeek V3 / V4 config (see the module docstring)."""
    d = _as_dict(config)
    if "dim" in d and "hidden_size" not in d:
        return _from_deepseek_args(d)
    model_type = d.get("model_type", "")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; valid: {', '.join(MODEL_TYPES)} "
                         "(or DeepSeek's inference config.json)")
    d = {**_HF_DEFAULTS[model_type], **d}
    act = d["hidden_act"]
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: the MoE layer implements SwiGLU (silu) experts only")
    v4 = model_type == "deepseek_v4"
    kw: dict[str, Any] = dict(
        hidden=int(d["hidden_size"]), inter=int(d["moe_intermediate_size"]),
        num_experts=int(d["n_routed_experts"]), top_k=int(d["num_experts_per_tok"]),
        renormalize=bool(d.get("norm_topk_prob", True)),
        # (None: 1; a 0 is kept, HF multiplies the weights by it: `or 1.0` had made it 1)
        routed_scaling=1.0 if d.get("routed_scaling_factor") is None else float(d["routed_scaling_factor"]),
        num_shared=int(d.get("n_shared_experts") or 0), shared_inter=int(d["moe_intermediate_size"]),
    )
    if v4:
        scoring = d["scoring_func"]
        if scoring not in _SCORING:
            raise ValueError(f"unknown scoring_func {scoring!r}; valid: {', '.join(_SCORING)}")
        if d["mlp_bias"]:  # (HF's DeepseekV4MLP, the shared expert, then has biases; SharedExpert has none)
            raise ValueError(f"mlp_bias ({d['mlp_bias']!r}): the shared expert has no bias terms here; "
                             "only mlp_bias=False is supported")
        limit = _limit(d["swiglu_limit"])
        hashes = _num_hash_layers(d)
        # HF's DeepseekV4TopKRouter and DeepseekV4HashRouter divide by the weights' sum whatever
        # norm_topk_prob says (DeepSeek's V4 code does too for its non-softmax scores)
        # HF's DeepseekV4SparseMoeBlock always has one shared DeepseekV4MLP of width moe_intermediate_size
        # (n_shared_experts does not enter it): 0 would drop it, 2 double its width
        kw.update(scoring=_SCORING[scoring], use_bias=True, n_group=None, topk_group=None, swiglu_limit=limit,
                  renormalize=True, num_shared=1,
                  shared_swiglu_limit=limit, num_hash_layers=hashes, vocab=int(d["vocab_size"]) if hashes else None)
    else:
        n_group = d.get("n_group")
        # HF's DeepseekV3TopkRouter (and V3.2's) always adds its e_score_correction_bias buffer and
        # ranks groups by their top-2 sums, whatever topk_method says (HF's config has no such field)
        kw.update(scoring="sigmoid", use_bias=True,
                  n_group=int(n_group) if n_group and n_group > 1 else None,
                  topk_group=int(d["topk_group"]) if n_group and n_group > 1 else None,
                  swiglu_limit=None, shared_swiglu_limit=None)
    fmt = _expert_format(d)
    if fmt is not None:
        kw["expert_format"] = fmt
    return kw


def _from_deepseek_args(d: dict) -> dict:
    """DeepSeek's inference config.json (ModelArgs: dim, moe_inter_dim, score_func, route_scale, ...)."""
    scoring = d.get("score_func", "softmax")
    if scoring not in _SCORING:
        raise ValueError(f"unknown score_func {scoring!r}; valid: {', '.join(_SCORING)}")
    limit = _limit(d.get("swiglu_limit"))
    hashes = int(d.get("n_hash_layers", 0) or 0)
    n_group = int(d.get("n_expert_groups", 1) or 1)
    kw: dict[str, Any] = dict(
        hidden=int(d["dim"]), inter=int(d["moe_inter_dim"]), num_experts=int(d["n_routed_experts"]),
        top_k=int(d["n_activated_experts"]), scoring=_SCORING[scoring],
        # V3 inference: the bias exists at dim 7168 (its noaux_tc); V4: always
        use_bias=scoring == "sqrtsoftplus" or int(d["dim"]) == 7168,
        n_group=n_group if n_group > 1 else None,
        topk_group=int(d.get("n_limited_groups", 1)) if n_group > 1 else None,
        renormalize=scoring != "softmax", routed_scaling=float(d.get("route_scale", 1.0)),
        swiglu_limit=limit, shared_swiglu_limit=limit, num_shared=int(d.get("n_shared_experts", 0)),
        shared_inter=int(d["moe_inter_dim"]), num_hash_layers=hashes,
        vocab=int(d["vocab_size"]) if hashes else None,
    )
    fmt = _expert_format(d)
    if fmt is not None:
        kw["expert_format"] = fmt
    return kw
