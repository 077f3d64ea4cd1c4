"""Import a peer's modules from a source tree the user extracted, with stand-ins for the rest.

A peer package (``vllm``) is heavy: its ``__init__`` pulls in CUDA kernels, pydantic configs,
ZeroMQ. The few modules a benchmark drives (the KV cache manager and block pool) are plain
Python, so :class:`PeerImporter` loads exactly those from ``PATH`` and answers every other
``vllm.*`` import with a stand-in module from ``benchmarks/peers/<peer>_shims.py``. Stand-ins
only stub names the loaded modules import; they contain no peer code. A name that neither the
tree nor the stand-ins provide fails with an ImportError naming it, so a newer peer release
tells you what to add.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path


class PeerImporter(importlib.abc.MetaPathFinder):
    """Resolve ``<root>.*`` imports: real files for ``real``, stand-ins for ``shims``, else an
    empty package (so ``a.b.c`` can be reached without running ``a/__init__.py``)."""

    def __init__(
        self,
        root: str,
        tree: Path,
        real: Iterable[str],
        shims: dict[str, Callable[[types.ModuleType], None]],
    ) -> None:
        self.root = root
        self.tree = tree
        self.real = set(real)
        self.shims = shims

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.root and not fullname.startswith(self.root + "."):
            return None
        if fullname in self.real:
            file = self.tree.joinpath(*fullname.split(".")).with_suffix(".py")
            if not file.is_file():
                raise ImportError(f"{file} is missing from the peer tree {self.tree}")
            return importlib.util.spec_from_file_location(fullname, file)
        if fullname in self.shims:
            return importlib.machinery.ModuleSpec(fullname, _ShimLoader(self.shims[fullname]))
        if any(r.startswith(fullname + ".") for r in self.real | set(self.shims)):
            return importlib.machinery.ModuleSpec(fullname, _ShimLoader(None), is_package=True)
        raise ImportError(
            f"{fullname} is neither loaded from the peer tree nor stubbed; add a stand-in "
            "for it in benchmarks/peers/"
        )


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, fill: Callable[[types.ModuleType], None] | None) -> None:
        self.fill = fill

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if self.fill is None:
            module.__path__ = []
        else:
            self.fill(module)


def install(importer: PeerImporter) -> None:
    """Put ``importer`` first on ``sys.meta_path``; refuse if the package is already imported
    (an installed copy, say), since mixing the two would measure the wrong code."""
    if importer.root in sys.modules:
        raise ImportError(f"{importer.root} is already imported in this process")
    sys.meta_path.insert(0, importer)


def placeholder(name: str) -> type:
    """A class that accepts any arguments: for names imported only as types or for disabled
    features (events, stats) the benchmark never turns on."""

    def init(self: object, *args: object, **kwargs: object) -> None:
        self.__dict__.update(kwargs)

    return type(name, (), {"__init__": init})
