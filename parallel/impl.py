"""Which implementation runs here: the one place for capability checks and the rule for "auto".

Every op with more than one implementation (a torch reference, Triton kernels, a library
backend) registers them here, in order of preference, each with a check that says whether it
can run for the given inputs:

    from megapar.parallel import impl

    MERGE = impl.Op("cp.merge", [
        impl.Impl("triton", impl.all_of(impl.needs_triton, impl.needs_gpu_tensor, impl.forward_only)),
        impl.Impl("torch"),                       # no check: runs everywhere
    ])
    chosen = MERGE.resolve(backend, device=out.device, needs_grad=impl.grad_needed(out, lse))

The rule:
- ``"auto"`` takes the first usable implementation in the registered order.
- A name asked for explicitly that cannot run raises ``ValueError`` with the reason and, where
  a package is missing, the install hint. Unknown names raise with the valid choices.
- When ``"auto"`` passes over an implementation that *would* apply to these inputs but lacks
  something installable (say CUDA tensors but no Triton), it logs one warning per (op,
  implementation, reason); passing over one that does not apply (a CUDA kernel for CPU
  tensors) is silent.

Capabilities are read here only: CUDA, whether Triton imports, whether the Triton interpreter
is on (``TRITON_INTERPRET=1``, read at each call so tests can set it), autograd, and optional
packages. `report()` lists every registered op and what is usable (``megapar env``): it has no
inputs, so a check that reads a fact of the inputs it was not given (a dtype, a head dim, a
group's size) is passed over there, and the answer is about this machine's capabilities.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("megapar.impl")


@dataclass(frozen=True)
class Unusable:
    """Why an implementation cannot run. `installable`: something the user could install (the
    "auto" fallback then warns once); False: it simply does not apply to these inputs."""

    reason: str
    installable: bool = False
    hint: str = ""

    def message(self) -> str:
        return f"{self.reason} ({self.hint})" if self.hint else self.reason


class UnknownFact(Exception):
    """A check read a fact of the inputs that `Op.usable` / `report()` was not given (see
    `Facts.inputs_unknown`); the check is passed over there."""


@dataclass
class Facts:
    """What a check may look at: the device of the inputs, whether autograd needs the op, and
    op-specific facts passed to `Op.resolve` as keywords (read as attributes; absent = None)."""

    device: torch.device | None = None
    needs_grad: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    asked: bool = False
    """the implementation was asked for by name (not chosen by "auto"); set by `Op.resolve`"""
    inputs_unknown: bool = False
    """`Op.usable` / `report()`: there are no inputs, so reading an op-specific fact that was not
    given raises `UnknownFact` (instead of None, which checks of dtypes and sizes took for "does
    not fit", or could not compare at all) and the check that read it is passed over."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        extra = self.__dict__.get("extra") or {}
        if name not in extra and self.__dict__.get("inputs_unknown"):
            raise UnknownFact(name)
        return extra.get(name)


Check = Callable[[Facts], "Unusable | None"]


def _ask(check: Check, f: Facts) -> Unusable | None:
    """`check(f)`; None when it needs a fact of the inputs that `f` does not have (report mode)."""
    try:
        return check(f)
    except UnknownFact:
        return None


class Settings(dict):
    """A module's launch settings (its CONFIG): a dict of ints whose every change, by any dict method,
    bumps `version`, so that what is worked out from it (a kernel choice per call shape) can be kept
    and looked up instead of worked out again on every eager call (`Memo`)."""

    version = 0

    def _changed(self) -> None:
        self.version += 1

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._changed()

    def __ior__(self, other):
        self.update(other)
        return self

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)


class Memo:
    """What a pure function of a call's shapes, dtypes, strides and settings returned, by a key the
    caller builds from exactly those facts (the host work of choosing a kernel costs tens of µs
    a call in Python, more than many decode kernels run). Bounded: cleared when it holds `size`
    keys. `clear_memos()` empties every one (tests/conftest.py does, before every test)."""

    _all: list["Memo"] = []

    def __init__(self, size: int = 256) -> None:
        self.size, self.table = size, {}
        Memo._all.append(self)

    def get(self, key, make: Callable[[], Any]) -> Any:
        hit = self.table.get(key, _MISSING)
        if hit is _MISSING:
            if len(self.table) >= self.size:
                self.table.clear()
            hit = self.table[key] = make()
        return hit


_MISSING = object()


def clear_memos() -> None:
    for m in Memo._all:
        m.table.clear()


# ---- capabilities (the only place that reads them) -------------------------------------------------

def interpreting() -> bool:
    """The Triton interpreter is on (CPU tensors run Triton kernels; tests only): TRITON_INTERPRET
    as Triton reads it (1 / true / on / yes, any case)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def importable(module: str) -> bool:
    """`module` imports here (cached: a failed import is not retried)."""
    try:
        importlib.import_module(module)
        return True
    except Exception:  # ImportError, or a broken install raising anything else
        return False


def require(module: str, what: str, hint: str) -> Any:
    """Import an optional package for `what`, or ValueError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what} needs {module} ({hint}): {e}") from None


def triton_importable() -> bool:
    return importable("triton")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def grad_needed(*tensors: Any) -> bool:
    """Autograd will want a backward through an op on these tensors."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ---- checks ------------------------------------------------------------------------------------------

def needs_triton(f: Facts) -> Unusable | None:
    if triton_importable():
        return None
    gpu = f.device is not None and f.device.type == "cuda"
    return Unusable("the triton package is not importable", installable=gpu, hint="pip install 'megapar[triton]'")


def needs_gpu_tensor(f: Facts) -> Unusable | None:
    """CUDA tensors; other tensors under the Triton interpreter only when the implementation was
    asked for by name: tests turn the interpreter on for whole modules, and "auto" keeps CPU work
    on the torch path there."""
    if (f.device is not None and f.device.type == "cuda") or (f.asked and interpreting()):
        return None
    return Unusable(f"needs CUDA tensors (or TRITON_INTERPRET=1 and the implementation asked for by name), "
                    f"got {f.device}")


def needs_cuda_tensor(f: Facts) -> Unusable | None:
    if f.device is not None and f.device.type == "cuda":
        return None
    return Unusable(f"needs CUDA tensors, got {f.device}")


def cuda_unless_asked(f: Facts) -> Unusable | None:
    """CUDA tensors for "auto"; any tensors when the implementation is asked for by name."""
    if (f.device is not None and f.device.type == "cuda") or f.asked:
        return None
    return Unusable(f"chosen by 'auto' for CUDA tensors only, got {f.device}")


def forward_only(f: Facts) -> Unusable | None:
    if f.needs_grad:
        return Unusable("has no backward (inputs require grad); the torch path is differentiable")
    return None


def needs_package(module: str, hint: str) -> Check:
    """A check that `module` imports; `hint` says how to install it."""

    def check(f: Facts) -> Unusable | None:
        if importable(module):
            return None
        return Unusable(f"`{module}` is not importable", installable=True, hint=hint)

    check.__name__ = f"needs_{module.replace('.', '_')}"
    return check


def all_of(*checks: Check) -> Check:
    """The first failing check's reason, or None."""

    def check(f: Facts) -> Unusable | None:
        for c in checks:
            why = _ask(c, f)   # (one that needs an unknown input fact: the later checks still count)
            if why is not None:
                return why
        return None

    return check


def triton_kernel(*more: Check) -> Check:
    """The usual Triton kernel rule: triton importable, CUDA tensors (or the interpreter), and `more`."""
    return all_of(needs_triton, needs_gpu_tensor, *more)


# ---- ops -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Impl:
    """One implementation of an op: its name and the check that it can run (None: always)."""

    name: str
    check: Check | None = None
    auto: bool = True
    """False: never chosen by "auto" (e.g. a slow reference that exists for tests)."""

    def why_not(self, facts: Facts) -> Unusable | None:
        return None if self.check is None else _ask(self.check, facts)


_OPS: dict[str, "Op"] = {}
_warned: set[tuple[str, str, str]] = set()


class Op:
    """An op's implementations in order of preference (see the module docstring)."""

    def __init__(self, name: str, impls: Sequence[Impl]) -> None:
        if not impls:
            raise ValueError(f"op {name!r} needs at least one implementation")
        names = [i.name for i in impls]
        if len(set(names)) != len(names) or "auto" in names:
            raise ValueError(f"op {name!r}: implementation names must be unique and not 'auto', got {names}")
        self.name = name
        self.impls: list[Impl] = list(impls)
        _OPS[name] = self

    @property
    def names(self) -> tuple[str, ...]:
        """Valid choices: "auto" and every implementation (the op's BACKENDS tuple)."""
        return ("auto", *(i.name for i in self.impls))

    def register(self, impl: Impl, *, before: str | None = None) -> None:
        """Add (or replace) an implementation, optionally ahead of `before` in the auto order."""
        self.impls = [i for i in self.impls if i.name != impl.name]
        at = next((n for n, i in enumerate(self.impls) if i.name == before), len(self.impls))
        self.impls.insert(at, impl)

    def get(self, name: str) -> Impl:
        for i in self.impls:
            if i.name == name:
                return i
        raise ValueError(f"{self.name}: unknown implementation {name!r}; valid: {', '.join(self.names)}")

    def resolve(self, requested: str = "auto", *, device: torch.device | str | None = None,
                needs_grad: bool = False, **facts: Any) -> str:
        """The implementation that runs for `requested` ("auto" or a name) and these facts."""
        facts.pop("asked", None)
        facts.pop("named", None)
        f = Facts(torch.device(device) if isinstance(device, str) else device, needs_grad, facts,
                  asked=requested != "auto")
        if requested != "auto":
            why = self.get(requested).why_not(f)
            if why is not None:
                raise ValueError(f"{self.name}: {requested!r} cannot run here: {why.message()}")
            return requested
        passed: list[tuple[Impl, Unusable]] = []
        for i in self.impls:
            if not i.auto:
                continue
            why = i.why_not(f)
            if why is None:
                for skipped, reason in passed:
                    key = (self.name, skipped.name, reason.reason)
                    if reason.installable and key not in _warned:
                        _warned.add(key)
                        log.warning("%s: using %r, not %r: %s", self.name, i.name, skipped.name, reason.message())
                return i.name
            passed.append((i, why))
        reasons = "; ".join(f"{i.name}: {why.message()}" for i, why in passed)
        raise ValueError(f"{self.name}: no implementation can run here ({reasons})")

    def usable(self, **facts: Any) -> dict[str, str | None]:
        """{implementation: None if usable else the reason} for these facts. Facts not given are
        unknown, not None: a check that reads one is passed over (`report()` gives only the
        device, and answers for the machine's capabilities)."""
        device = facts.pop("device", None)
        f = Facts(torch.device(device) if isinstance(device, str) else device, facts.pop("needs_grad", False),
                  facts, inputs_unknown=True)
        return {i.name: (None if (w := i.why_not(f)) is None else w.message()) for i in self.impls}


def get_op(name: str) -> Op:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"no op {name!r} is registered; registered: {', '.join(sorted(_OPS))}") from None


def report(device: torch.device | str | None = None) -> dict[str, dict[str, str | None]]:
    """Every registered op -> {implementation: None (usable) or why not}, for `device`
    (default: CUDA when available, else CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if cuda_available() else "cpu")
    return {name: op.usable(device=dev) for name, op in sorted(_OPS.items())}


def _torch_scratch(size: int, alignment: int, stream: int | None):
    """Triton's global scratch (device-side TMA descriptors: 128 bytes per program and descriptor)
    from torch's caching allocator on the current device (inside CUDA-graph capture: its pool)."""
    import torch

    return torch.empty(size, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))


def ensure_triton_scratch() -> None:
    """Install a torch-backed Triton scratch allocator unless the program already set one (the
    setting is a context variable: per thread). Kernels that build TMA descriptors on the device
    need it; the interpreter needs none."""
    if interpreting():
        return
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)
