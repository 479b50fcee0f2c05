"""verl-fastsync: a faster, leaner trainer -> rollout weight sync for verl, as a plugin.

Plugin author's guide
---------------------
verl-fastsync is a pluggy host. Its project name and entry-point group are both ``verl_fastsync``
(:data:`NAME`). A third-party package adds a cleanup policy or a weight transport like this::

    # my_policy.py
    from verl_fastsync import hookimpl
    from verl_fastsync.cleanup import CleanupContext, CleanupOutcome

    def _empty_twice(ctx: CleanupContext) -> CleanupOutcome:
        ctx.device.empty_cache()
        ctx.device.empty_cache()
        return CleanupOutcome()

    @hookimpl
    def pre_resume_cleanup():
        return {"twice": _empty_twice}          # {name: implementation}; the host merges them

    # pyproject.toml
    [project.entry-points.verl_fastsync]
    my_policy = "my_policy"

and the user selects it with ``+actor_rollout_ref.rollout.custom.fastsync.pre_resume_cleanup=twice``.
The hook contracts (which process calls each hook, what a factory receives) are in
:mod:`verl_fastsync.hookspecs`; the merge rules (a built-in name may be replaced, two third parties
claiming one name is an error) in :mod:`verl_fastsync.plugins`. ``verl-fastsync doctor`` lists every
name with the distribution providing it.

Importing this package installs the plugin into verl (idempotent, nothing runs before verl's own
modules are imported; see :mod:`verl_fastsync.verl.adapter`). verl imports it through the ``verl.plugins``
entry point (0.9.0+) or ``VERL_USE_EXTERNAL_MODULES=verl_fastsync`` (every release).
"""

from __future__ import annotations

import logging

import pluggy

NAME = "verl_fastsync"
"""pluggy project name and the entry-point group third-party plugins register under."""

__version__ = "0.2.0"

hookspec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)

__all__ = ["NAME", "__version__", "hookimpl", "hookspec", "install"]


def install() -> None:
    """Install the plugin into verl: patches are applied when verl's modules get imported."""
    from verl_fastsync.verl.adapter import install_into_verl

    install_into_verl()


try:
    install()
except Exception:  # pragma: no cover - importing the plugin must never break verl
    logging.getLogger(NAME).exception("verl-fastsync could not install itself; verl runs unchanged")
