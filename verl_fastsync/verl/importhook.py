"""A post-import hook: run callbacks on a module right after it is imported (or now, if it already is).

The adapter patches verl's modules this way, so ``import verl_fastsync`` never imports verl itself.
A callback that raises is recorded in :data:`FAILURES` (module name -> what went wrong) and logged;
the adapter decides, per process and config, whether that failure stops the worker
(``enable=true``) or leaves verl running unchanged (plugin not enabled). A callback may raise
:class:`PatchRequiredError` to fail the import itself (used where running on unpatched would pair a
switched sender with an unswitched receiver).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]

FAILURES: dict[str, str] = {}
"""verl module name -> why its patch could not be applied (what was missing), in this process."""

QUIET_WARNINGS: dict[str, tuple[tuple[str, type[Warning]], ...]] = {
    # verl's checkpoint_engine/__init__ imports its NCCL engine, whose ``import cupy.cuda.nccl`` warns on
    # every host without libnccl (a CPU host, a non-NVIDIA accelerator): the user did nothing to cause it
    "verl.checkpoint_engine": ((r"\s*nccl library could not be loaded", UserWarning),),
}
"""Watched module -> ``(message regex, category)`` of warnings ignored while that module executes
(only then, and only those: other warnings, and the same text raised later, still show)."""

MARK = "__verl_fastsync_wrapped__"
"""Attribute set on every wrapper fastsync installs into verl, so a second install leaves it alone."""


class PatchRequiredError(ImportError):
    """A patch this process cannot run without failed; raised from the import of the verl module."""


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks on the fresh module."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: Sequence[Callback]):
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        quiet = QUIET_WARNINGS.get(module.__name__, ())
        if quiet:
            with warnings.catch_warnings():
                for message, category in quiet:
                    warnings.filterwarnings("ignore", message=message, category=category)
                self._loader.exec_module(module)
        else:
            self._loader.exec_module(module)
        run_callbacks(module, self._callbacks)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder that wraps the loader of watched modules."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self._resolving = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        callbacks = self.callbacks.get(fullname)
        resolving: set[str] = self._resolving.__dict__.setdefault("names", set())
        if not callbacks or fullname in resolving:
            return None
        resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            resolving.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, callbacks)
        return spec


def require(owner: Any, attr: str, where: str) -> Any:
    """``owner.attr``, or a clear error naming what this verl release lacks."""
    value = getattr(owner, attr, None)
    if value is None:
        raise AttributeError(
            f"{where} has no {attr!r} (this verl release differs from what fastsync patches)"
        )
    return value


def run_callbacks(module: ModuleType, callbacks: Sequence[Callback]) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except PatchRequiredError as exc:
            FAILURES[module.__name__] = str(exc)
            raise
        except Exception as exc:
            FAILURES[module.__name__] = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "verl-fastsync: patching %s failed (%s); with custom.fastsync.enable=true the worker "
                "refuses to start, otherwise verl runs unchanged",
                module.__name__,
                FAILURES[module.__name__],
            )


FINDER = PostImportFinder()


def when_imported(module_name: str, callback: Callback) -> None:
    """Run ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    FINDER.callbacks.setdefault(module_name, []).append(callback)
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        run_callbacks(module, [callback])


def install_finder() -> bool:
    """Put the finder first on ``sys.meta_path``; False if it already was."""
    if FINDER in sys.meta_path:
        return False
    sys.meta_path.insert(0, FINDER)
    return True
