"""megapar: the installed namespace of the project's packages.

The code lives in four top-level folders, `parallel`, `moe`, `model` and `launch`. Those names
are generic: a `model.py` or `parallel.py` in the working directory would shadow them. So the
library imports itself only as `megapar.parallel`, `megapar.moe`, `megapar.model` and
`megapar.launch` (this package's search path is the folder that holds the four), and a stray
file of a generic name cannot break it.

The short names stay as compatibility aliases: `import parallel` (when nothing shadows it)
gives the very module object `megapar.parallel`, and `parallel.comm` is `megapar.parallel.comm`,
so classes and registries exist once whichever name a caller uses. A user's own package named
`model` (or `parallel`, ...) is left alone: the aliases apply only while the short name is ours.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

__version__ = "0.1.0"
PACKAGES: tuple[str, ...] = ("parallel", "moe", "model", "launch")

# megapar.<pkg> is found in the folder that holds the four package folders (the repository root,
# or site-packages when installed).
__path__ = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


class _Package(types.ModuleType):
    """The class of a package that an alias import reached. Python's import sets the child module
    as an attribute of its parent after every first import of a name; for an alias that would
    overwrite a public name the package binds to something else on purpose (`moe.kernels.
    grouped_gemm` is a function that shares its name with its module). Keep such names."""

    def __setattr__(self, name: str, value) -> None:
        current = self.__dict__.get(name)
        if (isinstance(value, types.ModuleType) and current is not None and current is not value
                and not isinstance(current, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}"):
            return
        super().__setattr__(name, value)


class _AliasLoader(importlib.abc.Loader):
    """Loads `pkg.sub` as the already-imported `megapar.pkg.sub` (the same module object)."""

    def __init__(self, canonical: str) -> None:
        self.canonical = canonical
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        module = importlib.import_module(self.canonical)
        self.spec = getattr(module, "__spec__", None)
        parent = sys.modules.get(self.canonical.rpartition(".")[0])
        if parent is not None and type(parent) is types.ModuleType:
            parent.__class__ = _Package
        return module

    def exec_module(self, module) -> None:
        # The canonical module already ran. The import machinery has just set its __spec__ to the alias
        # spec; put the canonical one back, so that __spec__.parent agrees with __package__ again (a
        # relative import inside a function warns where they differ, and Python 3.15 resolves it by the spec)
        if self.spec is not None and module is sys.modules.get(self.canonical):
            module.__spec__ = self.spec

    # `python -m launch.cli` (runpy) runs the code of the canonical module's file as __main__
    def _real(self):
        import importlib.util

        return importlib.util.find_spec(self.canonical).loader

    def get_code(self, fullname: str):
        return self._real().get_code(self.canonical)

    def get_source(self, fullname: str):
        return self._real().get_source(self.canonical)

    def get_filename(self, fullname: str) -> str:
        return self._real().get_filename(self.canonical)

    def is_package(self, fullname: str) -> bool:
        return self._real().is_package(self.canonical)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Maps `pkg.sub...` to `megapar.pkg.sub...` while `sys.modules[pkg]` is `megapar.pkg`."""

    def find_spec(self, name: str, path=None, target=None):
        top, dot, _ = name.partition(".")
        if not dot or top not in PACKAGES:
            return None
        ours = sys.modules.get(f"megapar.{top}")
        if ours is None or sys.modules.get(top) is not ours:
            return None  # the short name is someone else's package: leave it alone
        canonical = f"megapar.{name}"
        module = importlib.import_module(canonical)
        # origin: the canonical file. `python -m launch.demo` (runpy) sets __main__.__file__ from it;
        # without it the script looked like `python -c` to launch_local, which refused to start ranks
        return importlib.machinery.ModuleSpec(name, _AliasLoader(canonical), origin=getattr(module, "__file__", None),
                                              is_package=hasattr(module, "__path__"))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())


def alias_short_name(name: str) -> None:
    """Called first thing by each package's `__init__`: imported under its short name (`parallel`),
    it makes that name the alias of `megapar.parallel`; imported as `megapar.parallel`, nothing."""
    if name in PACKAGES:
        sys.modules[name] = importlib.import_module(f"megapar.{name}")
