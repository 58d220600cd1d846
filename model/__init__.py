"""megapar.model: a reference DeepSeek-V4-style block wiring mHC, attention (TP/SP, PCP, DCP) and the FP4 MoE."""

# Exports load lazily so that `import model.mhc` stays light (no moe / parallel imports).
_EXPORTS = {
    "ModelConfig": "model.config",
    "check_layout": "model.config",
    "DemoModel": "model.model",
    "make_state_dict": "model.weights",
    "served_expert_weights": "model.weights",
    "reference_logits": "model.reference",
    "Timer": "model.profile",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
