"""megapar.model: a reference DeepSeek-V4-style block wiring mHC, attention (TP/SP, PCP, DCP) and the FP4 MoE."""


import megapar as _megapar

_megapar.alias_short_name(__name__)  # `import model` is `megapar.model` (see megapar/__init__.py)
# Exports load lazily so that `import model.mhc` stays light (no moe / parallel imports).
_EXPORTS = {
    "ModelConfig": "megapar.model.config",
    "check_layout": "megapar.model.config",
    "DemoModel": "megapar.model.model",
    "make_state_dict": "megapar.model.weights",
    "served_expert_weights": "megapar.model.weights",
    "reference_logits": "megapar.model.reference",
    "Timer": "megapar.model.profile",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
