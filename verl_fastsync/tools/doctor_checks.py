"""The command line of ``verl-fastsync doctor`` and the checks that run against it.

This module owns:

* reading the Hydra-style ``[+|++]key=value`` overrides (:func:`parse_overrides` ->
  :class:`Overrides`): the fastsync keys, the Ray actors' environment
  (``+ray_kwargs.ray_init.runtime_env.env_vars.NAME=value``), the keys doctor ignores, and the
  overrides Hydra refuses (a fastsync key without the leading ``+``);
* the checks of the load route against that environment (:func:`_route_problem`: no verl process
  would import the plugin) and the trainer worker's start-up checks (:func:`_startup_problems`, the
  code of :mod:`verl_fastsync.verl.startup`);
* the hint added to an unknown-transport message (:func:`_with_usable`).

The report itself is built in :mod:`verl_fastsync.tools.doctor`; what the host and the verl install
give is :mod:`verl_fastsync.tools.doctor_env`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from verl_fastsync.config import ENGINE_KEY_PREFIX, KEY_PREFIX
from verl_fastsync.delta.room import reserve_for
from verl_fastsync.limits import host_memory_available
from verl_fastsync.tools.doctor_env import ENV_MODULES, ENV_ROUTE, RAY_ENV_PREFIX

__all__ = ["OverrideError", "Overrides", "parse_overrides"]


class OverrideError(ValueError):
    """A command-line override that is not ``[+|++]key=value``."""


@dataclasses.dataclass
class Overrides:
    """What doctor reads from the command line."""

    tree: dict[str, Any]
    """The fastsync keys as a nested mapping (values parsed by OmegaConf's YAML value grammar, as Hydra
    does)."""
    ignored: list[str]
    """Keys doctor does not check (verl's own)."""
    worker_env: dict[str, str]
    """``+ray_kwargs.ray_init.runtime_env.env_vars.NAME=value``: the environment of verl's Ray actors."""
    problems: list[str]
    """Overrides Hydra refuses (a fastsync key without the leading ``+``)."""


def _is_fastsync_key(key: str) -> bool:
    return (
        key == KEY_PREFIX
        or key.startswith((KEY_PREFIX + ".", ENGINE_KEY_PREFIX + "."))
        or key == (ENGINE_KEY_PREFIX)
    )


def _is_ray_env_key(key: str) -> bool:
    return key == RAY_ENV_PREFIX or key.startswith(RAY_ENV_PREFIX + ".")


def _needs_plus(raw: str, key: str) -> str:
    return (
        f"{raw!r}: Hydra refuses it (\"Could not override '{key}'\"): the key is not in verl's config, so "
        f"it can only be added, not overridden; add the leading +: +{raw} "
        "(allowed: +key=value or ++key=value)"
    )


def parse_overrides(overrides: Sequence[str]) -> Overrides:
    """Hydra-style ``[+|++]key=value`` overrides -> :class:`Overrides`.

    Raises :class:`OverrideError` for an argument that is not an override at all.
    """
    from omegaconf import OmegaConf

    dotlist: list[str] = []
    env_dotlist: list[str] = []
    ignored: list[str] = []
    problems: list[str] = []
    for raw in overrides:
        if raw.startswith("~"):
            raise OverrideError(
                f"{raw!r}: deleting a key is not supported by doctor; allowed: [+|++]key=value"
            )
        plus = len(raw) - len(raw.lstrip("+"))
        item = raw[plus:]
        key, sep, _value = item.partition("=")
        if not sep or not key or plus > 2:
            raise OverrideError(f"{raw!r} is not an override; allowed: [+|++]key=value")
        if _is_fastsync_key(key):
            dotlist.append(item)
        elif _is_ray_env_key(key):
            env_dotlist.append(item)
        else:
            ignored.append(key)
            continue
        if plus == 0:
            problems.append(_needs_plus(raw, key))
    try:
        conf = OmegaConf.to_container(OmegaConf.from_dotlist(dotlist), resolve=True)
        env_conf = OmegaConf.to_container(OmegaConf.from_dotlist(env_dotlist), resolve=True)
    except Exception as exc:
        raise OverrideError(f"cannot parse overrides {dotlist + env_dotlist}: {exc}") from exc
    env = _dig(env_conf, RAY_ENV_PREFIX)
    if env is not None and not isinstance(env, dict):
        raise OverrideError(
            f"{RAY_ENV_PREFIX}={env!r} is not a mapping; allowed: +{RAY_ENV_PREFIX}.NAME=value"
        )
    worker_env = {str(k): "" if v is None else str(v) for k, v in (env or {}).items()}
    assert isinstance(conf, dict)
    return Overrides(tree=conf, ignored=ignored, worker_env=worker_env, problems=problems)  # type: ignore[arg-type]


def _dig(mapping: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return None
        mapping = mapping[part]
    return mapping


def _with_usable(message: str, kind: str, transports: dict[str, Any]) -> str:
    """An unknown-transport message (the worker's, verbatim) plus what can run on this host."""
    usable = transports[kind]["available"]
    return f"{message}; usable on this host: {', '.join(usable) or '(none)'}"


def _route_problem(report: dict[str, Any], wanted_by: list[str]) -> str | None:
    """Why no verl process would load the plugin that ``wanted_by`` needs (None: it gets loaded)."""
    v = report["verl"]
    if not v.get("installed") or not v.get("env_route_needed") or v.get("env_route_configured"):
        return None
    what = " and ".join(wanted_by)
    value = v.get("env_route_override")
    if value is not None:
        return (
            f"{what}, but {v['load_route_why']} and {RAY_ENV_PREFIX}.{ENV_MODULES}={value!r} does not name "
            f"verl_fastsync; allowed: a comma-separated list of modules that includes verl_fastsync, "
            f"e.g. {ENV_ROUTE}"
        )
    shell = (
        f" ({ENV_MODULES}=verl_fastsync in this shell does not count: it does not reach the Ray actors "
        "of a running cluster; the override does)"
        if v.get("env_route_active_here")
        else ""
    )
    return (
        f"{what}, but {v['load_route_why']}: no verl process imports verl-fastsync, so verl would run "
        f"its own weight sync (and checkpoint_engine.backend=fastsync is unknown to it); add {ENV_ROUTE}"
        + shell
    )


def _startup_problems(config: Any, worker_env: Mapping[str, str]) -> list[str]:
    """The trainer worker's start-up checks (:mod:`verl_fastsync.verl.startup`, as ``WorkerState`` runs
    them) against the environment the overrides give verl's Ray actors."""
    from verl_fastsync.config import FastsyncConfigError
    from verl_fastsync.verl import startup

    checks = [startup.check_colocated_switch]
    if config.enable:
        checks.insert(0, startup.check_disabled_plugins)
    out: list[str] = []
    for check in checks:
        try:
            check(config, dict(worker_env))
        except FastsyncConfigError as exc:
            out.append(str(exc))
    return out


def compose_problem(overrides: Sequence[str], verl_dir: str | None) -> str | None:
    """What Hydra says when it composes ``overrides`` against the installed verl's own
    ``ppo_trainer`` config (verl's ``main_ppo`` does the same at start), or None when it accepts
    them. Fastsync keys lacking their ``+`` are composed with it: that problem is reported once,
    by :func:`parse_overrides`. Needs only hydra and verl's config files, not ``import verl``."""
    if verl_dir is None:
        return None
    config_dir = os.path.join(verl_dir, "trainer", "config")
    if not os.path.isfile(os.path.join(config_dir, "ppo_trainer.yaml")):
        return None
    fixed = []
    for raw in overrides:
        key = raw.lstrip("+").partition("=")[0]
        needs_plus = _is_fastsync_key(key) or _is_ray_env_key(key)
        fixed.append(f"+{raw}" if needs_plus and not raw.startswith("+") else raw)
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
    except ImportError:  # pragma: no cover - hydra comes with verl
        return None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            compose(config_name="ppo_trainer", overrides=fixed)
    except Exception as exc:  # Hydra's own errors name the override and what it allows
        text = " ".join(str(exc).split())
        return f"verl's ppo_trainer config refuses these overrides (Hydra: {type(exc).__name__}: {text})"
    finally:
        GlobalHydra.instance().clear()
    return None


MODEL_PATH_KEY = "actor_rollout_ref.model.path"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _checkpoint_bytes(path: str) -> int | None:
    """Bytes of the weight files of a local checkpoint directory (None: not a local checkpoint)."""
    if not os.path.isdir(path):
        return None
    files = [f for f in os.listdir(path) if f.endswith(_WEIGHT_SUFFIXES)]
    if not files:
        return None
    preferred = [f for f in files if f.endswith(".safetensors")] or files  # not both formats twice
    return sum(os.path.getsize(os.path.join(path, f)) for f in preferred)


ROLLOUT_GPUS_KEY = "actor_rollout_ref.rollout.n_gpus_per_node"
TRAINER_GPUS_KEY = "trainer.n_gpus_per_node"
VERL_GPUS_PER_NODE = 8
"""verl's default for both keys (0.7.1-0.9.1): ``rollout.n_gpus_per_node`` is
``${oc.select:trainer.n_gpus_per_node,8}``."""


def _override(overrides: Sequence[str], key: str) -> str | None:
    """The value ``overrides`` give ``key`` (the last one, as Hydra takes it), or None."""
    found = None
    for raw in overrides:
        name, sep, value = raw.lstrip("+").partition("=")
        if sep and name == key:
            found = value
    return found


def rollout_ranks_per_host(overrides: Sequence[str]) -> tuple[int, str]:
    """How many rollout ranks one rollout host runs, and where that number comes from: verl puts a
    checkpoint-engine receiver (``CheckpointEngineWorker``) on every rollout GPU, and each receives
    the whole model. ``rollout.n_gpus_per_node``, else ``trainer.n_gpus_per_node`` (verl's own
    fallback), else verl's default of 8."""
    for key in (ROLLOUT_GPUS_KEY, TRAINER_GPUS_KEY):
        value = _override(overrides, key)
        if value is not None:
            try:
                count = int(value)
            except ValueError:
                continue  # (an interpolation: verl resolves it; doctor falls back as verl would)
            if count > 0:
                return count, key
    return VERL_GPUS_PER_NODE, f"verl's default {ROLLOUT_GPUS_KEY}"


def _bases_per_host(overrides: Sequence[str]) -> tuple[int, str]:
    """How many delta bases one rollout host keeps: one (on each host's leader) where the hosts layer
    runs (``hosts=auto``, the default, with a transport that supports it: ``gloo``, ``nixl``), else
    one per rollout rank (:func:`rollout_ranks_per_host`)."""
    transport = _override(overrides, f"{ENGINE_KEY_PREFIX}.transport") or "shm"
    hosts = (_override(overrides, f"{ENGINE_KEY_PREFIX}.hosts") or "auto").strip().lower()
    if hosts == "auto":
        try:
            from verl_fastsync.plugins import plugin_manager, select_transport
            from verl_fastsync.transports.hosts import supports_hosts

            if supports_hosts(select_transport(plugin_manager(), transport, "engine")):
                return 1, f"one copy per host: {transport} with {ENGINE_KEY_PREFIX}.hosts=auto"
        except Exception:  # an unknown transport: the engine's own check reports it
            pass
    ranks, source = rollout_ranks_per_host(overrides)
    return ranks, f"one per rollout GPU: {ranks} ({source})"


def _delta_memory(overrides: Sequence[str], available: int | None = None) -> tuple[str | None, str]:
    """(problem or None, note) for ``engine_kwargs.fastsync.delta=true``: the base costs the model's
    bytes in host memory on the sending trainer rank and on every rollout rank, so a rollout host
    keeps one per rollout GPU (:func:`rollout_ranks_per_host`). The model's size is read from the
    checkpoint files at ``actor_rollout_ref.model.path`` when that is a local directory; this host's
    ``MemAvailable`` (or its memory cgroup's room: a container's limit) must hold a rollout host's
    bases and their undo journals during a delta sync (an eighth more each) and still keep free what
    a side keeps free at run time (:func:`~verl_fastsync.delta.room.reserve_for`; a problem if it
    cannot: the hosts of one cluster are usually alike, and at run time delta would turn off)."""
    available = host_memory_available() if available is None else available
    path = _override(overrides, MODEL_PATH_KEY)
    size = _checkpoint_bytes(path) if path else None
    ranks, source = _bases_per_host(overrides)
    gib = 1 << 30
    have = f"{available / gib:.1f} GiB available here"
    per_host = f"a rollout host keeps {source}"
    if size is None:
        return None, (
            f"{ENGINE_KEY_PREFIX}.delta=true keeps the model's bytes (as synced) in host memory on the "
            f"sending trainer rank and on every rollout rank; {per_host}; {have}; give "
            f"{MODEL_PATH_KEY} as a local directory to check it against the checkpoint's size"
        )
    one = size + size // 8  # a base, and its undo journal during a delta sync
    need = ranks * one
    note = (
        f"{ENGINE_KEY_PREFIX}.delta=true keeps the model's bytes in host memory on the sending trainer "
        f"rank and on every rollout rank: about {size / gib:.2f} GiB each (the checkpoint at {path}; a "
        "GPU trainer's page-locked, in just its pages, returned to the host when delta turns off), "
        f"up to an eighth more during a delta sync (its undo journal); {per_host}, about "
        f"{need / gib:.2f} GiB; {have}"
    )
    reserve = reserve_for(available)
    if need > available - reserve:
        return (
            f"{ENGINE_KEY_PREFIX}.delta=true: a rollout host needs about {need / gib:.2f} GiB of host "
            f"memory for its bases ({source}, {ranks} x {one / gib:.2f} GiB: the "
            f"checkpoint at {path} plus an eighth for the undo journal during a delta sync) and this "
            f"host has {available / gib:.2f} GiB available, of which {reserve / gib:.2f} GiB stay free; "
            "set delta=false, run fewer rollout GPUs per host, or free host memory (at run time a rank "
            "without room turns delta off for the run)",
            note,
        )
    return None, note
