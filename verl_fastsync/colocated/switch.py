"""verl's ``bucketed_weight_transfer`` substitution."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from verl_fastsync.colocated.protocol import colocated_enabled, colocated_transport_name
from verl_fastsync.colocated.receiver import ColocatedReceiver
from verl_fastsync.colocated.sender import ColocatedSender

_INSTALLED_ATTR = "_verl_fastsync_colocated_originals"


def install_colocated(module: ModuleType) -> None:
    """Replace ``BucketedWeightSender``/``BucketedWeightReceiver`` in verl's imported
    ``bucketed_weight_transfer`` module by switches: each construction builds a fastsync object when
    :func:`colocated_enabled` is true in this process, verl's own class (untouched) otherwise.

    Idempotent. The switches subclass verl's classes so ``isinstance`` checks and attribute lookups
    by verl keep working; ``__wrapped__`` holds the original.
    """
    if getattr(module, _INSTALLED_ATTR, None) is not None:
        return
    orig_sender: Any = getattr(module, "BucketedWeightSender")  # noqa: B009
    orig_receiver: Any = getattr(module, "BucketedWeightReceiver")  # noqa: B009

    class BucketedWeightSender(orig_sender):
        __wrapped__ = orig_sender
        __doc__ = orig_sender.__doc__

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            use_shm = _arg(args, kwargs, 2, "use_shm", False)
            if colocated_transport_name(bool(use_shm)) is not None:
                return ColocatedSender(*args, **kwargs)
            return orig_sender(*args, **kwargs)

    class BucketedWeightReceiver(orig_receiver):
        __wrapped__ = orig_receiver
        __doc__ = orig_receiver.__doc__

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if colocated_enabled():
                # verl's receiver contract: views valid during the callback (its callbacks copy or
                # clone what they keep); a kept view fails loudly instead of reading stale bytes
                return ColocatedReceiver(*args, zero_copy=True, **kwargs)
            return orig_receiver(*args, **kwargs)

    for switch, orig in ((BucketedWeightSender, orig_sender), (BucketedWeightReceiver, orig_receiver)):
        switch.__module__ = orig.__module__
        switch.__qualname__ = orig.__qualname__
    setattr(module, _INSTALLED_ATTR, (orig_sender, orig_receiver))
    setattr(module, "BucketedWeightSender", BucketedWeightSender)  # noqa: B010
    setattr(module, "BucketedWeightReceiver", BucketedWeightReceiver)  # noqa: B010


def uninstall_colocated(module: ModuleType) -> None:
    """Undo :func:`install_colocated` (restores verl's classes)."""
    originals = getattr(module, _INSTALLED_ATTR, None)
    if originals is None:
        return
    setattr(module, "BucketedWeightSender", originals[0])  # noqa: B010
    setattr(module, "BucketedWeightReceiver", originals[1])  # noqa: B010
    delattr(module, _INSTALLED_ATTR)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default
