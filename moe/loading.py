"""Checkpoint reading for the MoE layer: lazy tensor mappings and the DeepSeek / HF name maps.

The MoE layer loads from DeepSeek names relative to its module (`MoELayer.load_deepseek`):

    gate.weight [E, H], gate.bias | gate.e_score_correction_bias [E], gate.tid2eid [vocab, K]
    experts.{e}.w1 / w3 [I, H], experts.{e}.w2 [H, I]   (.weight [+ .scale | .weight_scale[_inv]])
    shared_experts.w1 / w2 / w3.weight

DeepSeek's original checkpoints (V3 inference conversion, V4 as published) use exactly these
under `layers.{i}.ffn.`. HF transformers names under `model.layers.{i}.mlp.` map onto them
(`HFNames`): `gate.e_score_correction_bias`, `shared_experts.{gate,up,down}_proj`, and the routed
experts either fused as transformers 5 stores them, `experts.gate_up_proj` [E, 2I, H] (gate rows
then up rows) and `experts.down_proj` [E, H, I] (a quantized model's with `experts.gate_up_proj_scale_inv`
/ `experts.down_proj_scale_inv`, the per-expert scales stacked the same way: FP8 [E, 2I/128, H/128],
FP4 [E, 2I, H/32]), or per expert, `experts.{e}.{gate,up,down}_proj.weight` [+ `weight_scale_inv`]
(transformers 4, the V3 hub files).

What transformers 5 writes (`save_pretrained`): V3 / V3.2 per expert under `model.layers.{i}.mlp.`
(it fuses the experts in memory only); V4 under DeepSeek's names below `model.`
(`model.layers.{i}.ffn.experts.{e}.w1.weight`, `gate.bias`, `gate.tid2eid`): `find_moe_prefix`
tells which of the three prefixes a checkpoint uses. Keys the layer does not look up (other
layers, experts past its `num_experts`, tensors it has no use for) are ignored, as HF's
`from_pretrained` ignores unexpected keys (tests/test_hf_checkpoint_e2e.py).

Every mapping here is lazy: a key is read when it is looked up, so a layer that takes its own
experts reads only those. `SafetensorsState` reads from `.safetensors` files (one file, a list,
or a directory with or without `model.safetensors.index.json`), a fused expert tensor one
expert's slice at a time (`get_slice`); `reads` lists what was read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

NAMINGS: tuple[str, ...] = ("auto", "deepseek", "hf")


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - exercised only without the package
        raise ImportError("loading .safetensors files needs safetensors: pip install 'megapar[load]'") from exc
    return safe_open


def safetensors_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A file, a list of files, or a directory (every *.safetensors in it, sorted) -> file paths."""
    if isinstance(paths, (str, os.PathLike)):
        p = os.fspath(paths)
        if os.path.isdir(p):
            files = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"no .safetensors files in {p}")
            return files
        paths = [p]
    files = [os.fspath(p) for p in paths]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"checkpoint files not found: {', '.join(missing)}")
    return files


class SafetensorsState(Mapping):
    """Lazy `{name: tensor}` over safetensors files: a tensor is read on lookup (to CPU).

    The key -> file index comes from `model.safetensors.index.json` when a directory has one,
    else from each file's header (no tensor data is read for it). `reads` records every key
    read (a slice read records `key[index]`, and `slices` the (key, index) pairs)."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]) -> None:
        safe_open = _safe_open()
        self.files = safetensors_files(paths)
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        index = None
        if isinstance(paths, (str, os.PathLike)) and os.path.isdir(os.fspath(paths)):
            cand = os.path.join(os.fspath(paths), "model.safetensors.index.json")
            if os.path.isfile(cand):
                with open(cand) as f:
                    index = json.load(f)["weight_map"]
                self._where = {k: os.path.join(os.fspath(paths), v) for k, v in index.items()}
        if index is None:
            for path in self.files:
                for k in self._handle(path, safe_open).keys():
                    self._where[k] = path
        self.reads: list[str] = []
        self.slices: list[tuple[str, Any]] = []  # (key, index) of each slice read

    def _handle(self, path: str, safe_open: Any = None) -> Any:
        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = (safe_open or _safe_open())(path, framework="pt", device="cpu")
        return h

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self._where[key]  # KeyError names the key
        self.reads.append(key)
        return self._handle(path).get_tensor(key)

    def get_slice(self, key: str, index: Any) -> torch.Tensor:
        """tensor[index] reading only that part of the file (e.g. one expert of a fused tensor)."""
        path = self._where[key]
        self.reads.append(f"{key}[{index}]")
        self.slices.append((key, index))
        return self._handle(path).get_slice(key)[index]

    def shape(self, key: str) -> list[int]:
        return list(self._handle(self._where[key]).get_slice(key).get_shape())

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _slice(state: Mapping, key: str, index: Any) -> torch.Tensor:
    if hasattr(state, "get_slice"):
        return state.get_slice(key, index)
    return state[key][index]


def _shape(state: Mapping, key: str) -> list[int]:
    if hasattr(state, "shape"):
        return state.shape(key)
    return list(state[key].shape)


class Prefixed(Mapping):
    """state's keys under `prefix`, with the prefix removed (lazy)."""

    def __init__(self, state: Mapping, prefix: str) -> None:
        self.state, self.prefix = state, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.state[self.prefix + key]

    def get_slice(self, key: str, index: Any) -> torch.Tensor:
        return _slice(self.state, self.prefix + key, index)

    def shape(self, key: str) -> list[int]:
        return _shape(self.state, self.prefix + key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.prefix + key in self.state

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return (k[n:] for k in self.state if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


_HF_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_SUFFIX = {"scale": "weight_scale_inv"}  # DeepSeek V4 ".scale" -> HF's FP8 name


class HFNames(Mapping):
    """HF transformers MoE names (relative to `mlp.`) seen under DeepSeek names (lazy).

    gate.bias -> gate.e_score_correction_bias; shared_experts.w1/w3/w2 -> gate_proj/up_proj/
    down_proj; experts.{e}.w1/w3 -> experts.gate_up_proj[e, :I] / [e, I:] (fused, read one
    expert at a time) or experts.{e}.gate_proj / up_proj (per expert); experts.{e}.w2 ->
    experts.down_proj[e] or experts.{e}.down_proj. Scales (`.scale` / `.weight_scale_inv`) map to
    `weight_scale_inv`, fused: `experts.gate_up_proj_scale_inv[e]` split into its gate and up rows
    (per-row FP4 scales at I, 128-row FP8 tiles at I / 128: ValueError when I is not a multiple of
    128, whose tile would hold gate and up rows) and `experts.down_proj_scale_inv[e]`. An expert
    past the fused tensors' first dimension is absent (KeyError), as a missing per-expert key is."""

    def __init__(self, state: Mapping) -> None:
        self.state = state
        self.fused = "experts.gate_up_proj" in state

    def _map(self, key: str) -> tuple[str, Any] | None:
        """DeepSeek key -> (HF key, slice or None), None when it has no HF counterpart here."""
        parts = key.split(".")
        if parts[0] == "gate":
            name = "e_score_correction_bias" if parts[1:] == ["bias"] else ".".join(parts[1:])
            return f"gate.{name}", None
        if parts[0] == "shared_experts" and len(parts) == 3 and parts[1] in _HF_PROJ:
            return f"shared_experts.{_HF_PROJ[parts[1]]}.{_HF_SUFFIX.get(parts[2], parts[2])}", None
        if parts[0] == "experts" and len(parts) == 4 and parts[2] in _HF_PROJ and parts[1].isdigit():
            e, w, suffix = int(parts[1]), parts[2], parts[3]
            if not self.fused:
                return f"experts.{e}.{_HF_PROJ[w]}.{_HF_SUFFIX.get(suffix, suffix)}", None
            if suffix == "weight":
                hf = "experts.down_proj" if w == "w2" else "experts.gate_up_proj"
            elif _HF_SUFFIX.get(suffix, suffix) == "weight_scale_inv":   # transformers' FP8Experts
                hf = "experts.down_proj_scale_inv" if w == "w2" else "experts.gate_up_proj_scale_inv"
            else:
                return None
            if hf not in self.state or e >= _shape(self.state, hf)[0]:
                return None
            if w == "w2":
                return hf, e
            half = self._gate_rows(hf)
            return hf, (e, slice(0, half) if w == "w1" else slice(half, 2 * half))
        return key, None

    def _gate_rows(self, hf: str) -> int:
        """Rows of the gate half of the fused `hf` (gate_up_proj or its scale): the up half follows."""
        rows = _shape(self.state, hf)[1]
        inter, odd = divmod(_shape(self.state, "experts.gate_up_proj")[1], 2)
        if odd:
            raise ValueError(f"experts.gate_up_proj has {2 * inter + 1} rows per expert; gate then up rows "
                             "need an even count (2 x moe_intermediate_size)")
        if hf == "experts.gate_up_proj" or rows == 2 * inter:       # the weight, or per-row scales
            return inter
        if inter % 128 == 0 and rows == 2 * inter // 128:          # 128-row tiles, none across the halves
            return inter // 128
        raise ValueError(f"{hf} has {rows} rows per expert for the {2 * inter} of experts.gate_up_proj; "
                         f"only per-row scales ({2 * inter}) or 128-row tiles with moe_intermediate_size "
                         f"({inter}) a multiple of 128 ({2 * inter // 128} rows) split into the gate and up halves")

    def __getitem__(self, key: str) -> torch.Tensor:
        m = self._map(key)
        if m is None or m[0] not in self.state:
            raise KeyError(key)
        hf, index = m
        return self.state[hf] if index is None else _slice(self.state, hf, index)

    def shape(self, key: str) -> list[int]:
        """The shape `self[key]` has, from the stored shapes (a lazy state reads no data)."""
        m = self._map(key)
        if m is None or m[0] not in self.state:
            raise KeyError(key)
        hf, index = m
        stored = _shape(self.state, hf)
        return stored if index is None else list(torch.empty(stored, device="meta")[index].shape)

    def __contains__(self, key: object) -> bool:
        m = self._map(key) if isinstance(key, str) else None
        return m is not None and m[0] in self.state

    def __iter__(self) -> Iterator[str]:
        raise TypeError("HFNames maps names on lookup; it does not list them")

    def __len__(self) -> int:
        return len(self.state)


def checkpoint_key(state: Mapping, key: str) -> str:
    """The name `key` of a (possibly wrapped) view of this module has in the checkpoint itself:
    the prefixes of `Prefixed` views added, `HFNames`' DeepSeek names mapped to HF's."""
    while True:
        if isinstance(state, Prefixed):
            state, key = state.state, state.prefix + key
        elif isinstance(state, HFNames):
            m = state._map(key)
            if m is None:
                return key
            state, key = state.state, m[0]
        else:
            return key


def detect_naming(state: Mapping) -> str:
    """"hf" or "deepseek" for a state relative to one MoE module."""
    if "experts.gate_up_proj" in state or "shared_experts.gate_proj.weight" in state \
            or "experts.0.gate_proj.weight" in state:
        return "hf"
    return "deepseek"


def moe_state(state: Mapping, prefix: str = "", naming: str = "auto") -> Mapping:
    """state (full checkpoint names) -> a lazy mapping of DeepSeek names relative to the MoE module
    at `prefix` (e.g. "layers.3.ffn." in DeepSeek files, "model.layers.3.mlp." in HF ones)."""
    if naming not in NAMINGS:
        raise ValueError(f"unknown checkpoint naming {naming!r}; valid: {', '.join(NAMINGS)}")
    sub = Prefixed(state, prefix) if prefix else state
    if naming == "auto":
        naming = detect_naming(sub)
    return HFNames(sub) if naming == "hf" else sub


def moe_prefix(layer: int, naming: str) -> str:
    """The MoE module prefix of decoder layer `layer` in a checkpoint of `naming`."""
    if naming == "hf":
        return f"model.layers.{layer}.mlp."
    if naming == "deepseek":
        return f"layers.{layer}.ffn."
    raise ValueError(f"unknown checkpoint naming {naming!r}; valid: deepseek, hf")


_PREFIXES = ("model.layers.{}.mlp.", "layers.{}.ffn.", "model.layers.{}.ffn.")


def find_moe_prefix(state: Mapping, layer: int) -> str:
    """The MoE module prefix of decoder layer `layer` that `state` (full checkpoint names) holds:
    HF's `model.layers.{i}.mlp.`, DeepSeek's `layers.{i}.ffn.`, or `model.layers.{i}.ffn.` (a V4
    model written by transformers' save_pretrained). ValueError when none or several hold a router."""
    found = [p.format(layer) for p in _PREFIXES if f"{p.format(layer)}gate.weight" in state]
    if len(found) != 1:
        tried = ", ".join(p.format(layer) for p in _PREFIXES)
        raise ValueError(f"{'no' if not found else 'more than one'} MoE router (gate.weight) for layer {layer} "
                         f"under {', '.join(found) if found else tried}")
    return found[0]
