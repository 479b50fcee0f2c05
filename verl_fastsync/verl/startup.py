"""Start-up checks of a trainer worker with ``custom.fastsync``: config, environment and patches agree.

verl's checkpoint-engine workers and vLLM's worker processes never see the trainer's config; what
reaches them is the environment (``+ray_kwargs.ray_init.runtime_env.env_vars``). A trainer worker
whose config and environment disagree, or whose verl could not be patched, fails here, when it
starts, with a message saying what to add, instead of at its first sync.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from verl_fastsync import plugins
from verl_fastsync.config import (
    COLOCATED_OFF,
    DEFAULT_TIMEOUT_S,
    ENV_COLOCATED,
    ENV_COLOCATED_TIMEOUT,
    ENV_COLOCATED_VERIFY,
    FastsyncConfig,
    FastsyncConfigError,
    timeout_from_env,
)
from verl_fastsync.verl import importhook

ENV_ROUTE = "+ray_kwargs.ray_init.runtime_env.env_vars"
"""Hydra prefix of an environment variable every verl process (Ray actor, vLLM worker) sees."""

OFF = COLOCATED_OFF
"""Values of :data:`~verl_fastsync.config.ENV_COLOCATED` that leave verl's colocated transfer alone
(:data:`verl_fastsync.config.COLOCATED_OFF`)."""


def env_hint(name: str, value: str) -> str:
    """The Hydra override that sets ``name=value`` in every verl process."""
    return f"{ENV_ROUTE}.{name}={value}"


def check_patches_applied(patched_modules: Iterable[str]) -> None:
    """With ``enable=true``: every patch this process attempted must have been applied."""
    wanted = set(patched_modules)
    failed = {name: why for name, why in importhook.FAILURES.items() if name in wanted}
    if failed:
        details = "; ".join(f"{name}: {why}" for name, why in sorted(failed.items()))
        raise FastsyncConfigError(
            f"custom.fastsync.enable=true but verl-fastsync could not patch this verl release ({details}); "
            "refusing to run verl's stock sync under a fastsync config. Use a supported verl "
            "(0.7.1, 0.8.0, 0.9.0, 0.9.1) or set custom.fastsync.enable=false"
        )


def check_disabled_plugins(config: FastsyncConfig, environ: Any) -> None:
    """``disabled_plugins`` must also be in :data:`~verl_fastsync.plugins.ENV_DISABLED`: the
    checkpoint-engine workers and vLLM's workers build their registry from the environment only."""
    env_blocked = set(plugins.blocked_from_env(environ))
    missing = [name for name in config.disabled_plugins if name not in env_blocked]
    if missing:
        wanted = ",".join(dict.fromkeys([*plugins.blocked_from_env(environ), *config.disabled_plugins]))
        raise FastsyncConfigError(
            f"{config.key('disabled_plugins')}={list(config.disabled_plugins)} must reach every verl process "
            f"(checkpoint-engine and vLLM workers see no config), but {plugins.ENV_DISABLED} lacks "
            f"{', '.join(missing)}; add {env_hint(plugins.ENV_DISABLED, wanted)}"
        )


def ipc_unsupported_reason() -> str | None:
    """Why CUDA IPC cannot carry the colocated transfer in this process (None: it can)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        from verl.utils.device import is_support_ipc

        return None if is_support_ipc() else "verl.utils.device.is_support_ipc() is False"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def check_colocated_switch(config: FastsyncConfig, environ: Any) -> None:
    """The colocated transport must be switched on in the config *and* in every process's environment.

    verl's vLLM worker processes (the receivers) never see the config, so what they read is the
    environment (``VERL_FASTSYNC_COLOCATED``, ``VERL_FASTSYNC_COLOCATED_TIMEOUT_S``), which reaches every
    Ray actor through ``+ray_kwargs.ray_init.runtime_env.env_vars``. A trainer worker whose config and
    environment disagree fails here, saying what to add, instead of at its first sync. The named
    transport is what the sender uses (``ipc`` never silently becomes ``shm``); ``ipc`` on a device
    without CUDA IPC fails here.
    """
    wanted = config.colocated_transport if config.enable else None
    raw = str(environ.get(ENV_COLOCATED, ""))
    if wanted is None and raw.strip().lower() in OFF:
        return
    from verl_fastsync.colocated import colocated_transport_name

    try:
        named = colocated_transport_name(use_shm=wanted == "shm", environ=environ)
    except ValueError as exc:
        raise FastsyncConfigError(str(exc)) from exc
    if wanted is None:
        raise FastsyncConfigError(
            f"{ENV_COLOCATED}={raw!r} switches verl's colocated transfer to fastsync, but "
            f"{config.key('colocated_transport')} is not set (or {config.key('enable')} is false); "
            f"set both or neither"
        )
    if named != wanted:
        raise FastsyncConfigError(
            f"{config.key('colocated_transport')}={wanted!r} needs {ENV_COLOCATED}={wanted} in every verl "
            f"process (vLLM's workers see no config), but this process has {ENV_COLOCATED}={raw!r}; "
            f"add {env_hint(ENV_COLOCATED, wanted)}"
        )
    if wanted == "ipc":
        why = ipc_unsupported_reason()
        if why is not None:
            raise FastsyncConfigError(
                f"{config.key('colocated_transport')}='ipc' selects CUDA IPC, which this worker cannot use "
                f"({why}); use colocated_transport=shm (with {ENV_COLOCATED}=shm)"
            )
    env_timeout = str(environ.get(ENV_COLOCATED_TIMEOUT, "")).strip()
    try:  # the receivers' own reading of the variable (verl_fastsync.colocated.protocol)
        receiver_timeout = timeout_from_env(env_timeout)
    except ValueError:  # not a valid timeout: reported as disagreeing, with the value to set
        receiver_timeout = -1.0
    if receiver_timeout != config.timeout_s and not (
        receiver_timeout is None and config.timeout_s == DEFAULT_TIMEOUT_S
    ):
        raise FastsyncConfigError(
            f"{config.key('timeout_s')}={config.timeout_s:g} must also bound vLLM's receivers, which read "
            f"{ENV_COLOCATED_TIMEOUT} (this process has {env_timeout or 'unset'}); add "
            f"{env_hint(ENV_COLOCATED_TIMEOUT, f'{config.timeout_s:g}')}"
        )
    # this process is the sender: the named transport and the config's values, never verl's use_shm
    environ[ENV_COLOCATED] = wanted
    environ[ENV_COLOCATED_TIMEOUT] = str(config.timeout_s)
    if config.verify:
        environ[ENV_COLOCATED_VERIFY] = "1"
