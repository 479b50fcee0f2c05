"""``verl-fastsync doctor``: what the plugin will do in this environment, and what cannot work.

It reports the installed verl release and how the plugin gets loaded there, which plugin implements
each hook, which transports are available per kind (and why the others are not), and the resolved
``fastsync`` config and ``engine_kwargs.fastsync`` for Hydra-style overrides given on the command
line - with the same validation code and messages the workers use
(:func:`~verl_fastsync.config.parse_fastsync_config`, :func:`~verl_fastsync.selection.validate_names`,
:func:`~verl_fastsync.selection.parse_engine_kwargs`, the start-up checks of
:mod:`verl_fastsync.verl.startup`). The exit status is non-zero when something requested cannot
work; ``status: ok`` means none of these checks would fail once verl starts.

What doctor checks beyond the config values:

* Hydra refuses to *override* a key that is not in verl's config (``Could not override '...'``). No
  fastsync key (``custom.fastsync.*``, ``checkpoint_engine.engine_kwargs.fastsync.*``) and no
  ``ray_kwargs.ray_init.runtime_env.env_vars.*`` entry is in verl's config, so each needs the leading
  ``+`` (or ``++``); without it doctor reports a problem.
* The environment of verl's Ray actors is modelled by the
  ``+ray_kwargs.ray_init.runtime_env.env_vars.NAME=value`` overrides only. A variable exported in the
  shell that runs doctor is *not* counted: it reaches the actors only when ``ray.init`` starts a
  fresh local cluster from that very shell, never the actors of a running cluster (``ray start``,
  ``RAY_ADDRESS``, multi-node), so doctor does not rely on it. Hence, on a verl release whose
  ``import verl`` does not load ``verl.plugins`` entry points (0.7.1, 0.8.0), ``enable=true`` (or any
  ``engine_kwargs.fastsync``) without
  ``+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=verl_fastsync`` is a problem
  even when ``VERL_USE_EXTERNAL_MODULES=verl_fastsync`` is set in the shell, and with that override
  doctor says the route is configured. The trainer worker's start-up checks (``disabled_plugins`` vs
  ``VERL_FASTSYNC_DISABLED_PLUGINS``, the colocated switch) run against the same override
  environment.
* Transport names are checked against the registered plugins (the worker's message) and, for an
  unknown name, doctor adds which transports are usable on this host.
* verl against the installed vLLM (:mod:`verl_fastsync.tools.doctor_skew`): a call verl's vLLM server
  makes that this vLLM refuses (e.g. verl 0.9.1's ``pause_generation(wait_for_inflight_requests=...)``
  on vLLM 0.32) is a ``WARNING`` naming both versions and what fails; it does not change the status
  (the colocated ``naive`` sync never makes that call).

Doctor does not import verl: the version comes from the release's ``verl/version/version`` file (what
``verl.__version__`` reads) or its ``dist-info`` next to the package, found with
``importlib.util.find_spec`` without executing verl (``import verl`` takes seconds). Only when neither
exists does it import verl, and the report says so in one line (``verl.imported_because``).

Where it lives: this module builds the report (:func:`diagnose`) and renders it (:func:`render`),
including the plugin listing (:func:`plugin_listing`: per hook, and per transport kind, every name,
the plugin and distribution that provide it, and the built-in it replaced). What the host and the
verl install give (dependency probes, the verl release, the load route) is
:mod:`verl_fastsync.tools.doctor_env`; reading the overrides and the checks against them is
:mod:`verl_fastsync.tools.doctor_checks`. The names of both are re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import verl_fastsync
from verl_fastsync.config import ENGINE_KEY_PREFIX, KEY_PREFIX
from verl_fastsync.tools.doctor_checks import (
    OverrideError,
    Overrides,
    _delta_memory,
    _dig,
    _route_problem,
    _startup_problems,
    _with_usable,
    compose_problem,
    parse_overrides,
)
from verl_fastsync.tools.doctor_env import (
    ENV_MODULES,
    ENV_PLUGINS,
    ENV_ROUTE,
    KNOWN_TRANSPORTS,
    RAY_ENV_PREFIX,
    ROUTE_MODULE,
    Probe,
    _needs,
    probe_dependencies,
    verl_info,
    verl_loads_entry_points,
    verl_version_without_import,
)
from verl_fastsync.tools.doctor_env import _probe_cupy as _probe_cupy
from verl_fastsync.tools.doctor_env import _short_error as _short_error
from verl_fastsync.tools.doctor_skew import skew_warnings

if TYPE_CHECKING:
    from verl_fastsync.plugins import Provided, Registry

__all__ = [
    "ENGINE_KEY_PREFIX",
    "ENV_MODULES",
    "ENV_PLUGINS",
    "ENV_ROUTE",
    "KNOWN_TRANSPORTS",
    "RAY_ENV_PREFIX",
    "ROUTE_MODULE",
    "OverrideError",
    "Overrides",
    "Probe",
    "diagnose",
    "parse_overrides",
    "plugin_listing",
    "probe_dependencies",
    "render",
    "verl_info",
    "verl_loads_entry_points",
    "verl_version_without_import",
]


def diagnose(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The doctor report as a JSON-able dict; ``problems`` is non-empty when something cannot work."""
    from verl_fastsync import __version__, plugins
    from verl_fastsync.config import FastsyncConfigError, parse_fastsync_config
    from verl_fastsync.selection import parse_engine_kwargs, validate_names

    report: dict[str, Any] = {
        "verl_fastsync": {"version": __version__, "path": os.path.dirname(verl_fastsync.__file__)},
        "python": sys.version.split()[0],
        "problems": [],
        "notes": [],
        "warnings": [],
    }
    problems: list[str] = report["problems"]

    config = None
    engine_kwargs: dict[str, Any] = {}
    worker_env: dict[str, str] = {}
    try:
        parsed = parse_overrides(overrides)
    except OverrideError as exc:
        problems.append(str(exc))
        parsed = None
    if parsed is not None:
        problems.extend(parsed.problems)
        worker_env = parsed.worker_env
        if parsed.ignored:
            report["notes"].append(f"ignored (not fastsync keys): {', '.join(parsed.ignored)}")
        try:
            config = parse_fastsync_config(_dig(parsed.tree, KEY_PREFIX))
        except FastsyncConfigError as exc:
            problems.append(str(exc))
        engine_kwargs = _dig(parsed.tree, ENGINE_KEY_PREFIX) or {}
    report["worker_env"] = worker_env
    report["verl"] = verl_info(worker_env)
    report["warnings"] = skew_warnings(report["verl"].get("path"), report["verl"].get("version"))
    if report["verl"].get("import_error"):
        problems.append(f"import verl failed: {report['verl']['import_error']}")
    if parsed is not None and parsed.ignored:
        # only verl's own keys can be refused by its config: fastsync's (checked above) compose on
        # every supported release, so without other keys doctor spares Hydra's ~1 s
        refused = compose_problem(overrides, report["verl"].get("path"))
        if refused:
            problems.append(refused)
    wanted_by = [f"{KEY_PREFIX}.enable=true"] if config is not None and config.enable else []
    if engine_kwargs:
        wanted_by.append(f"{ENGINE_KEY_PREFIX}.* is set")
    route_problem = _route_problem(report, wanted_by) if wanted_by else None
    if route_problem:
        problems.append(route_problem)

    blocked = tuple(config.disabled_plugins) if config is not None else ()
    reg, why_not = _registry(blocked)
    if reg is None:
        problems.append(why_not)
        report["plugins"] = {"blocked": list(blocked), "error": why_not}
        report["verl"]["imported"] = "verl" in sys.modules
        report["ok"] = False
        return report
    report["plugins"] = plugin_listing(reg, blocked)
    unknown_blocked = [
        b
        for b in blocked
        if b not in report["plugins"]["registered"]
        and b not in plugins.BUILTIN_PLUGINS
        and not _is_entry_point(b)
    ]
    if unknown_blocked:
        report["notes"].append(f"disabled_plugins names no installed plugin: {', '.join(unknown_blocked)}")
    report["cleanup_policies"] = {b: plugins.available_cleanup_policies(reg, b) for b in plugins.BOUNDARIES}

    deps = probe_dependencies()
    report["dependencies"] = {k: dataclasses.asdict(v) for k, v in deps.items()}
    transports: dict[str, Any] = {}
    for kind in plugins.TRANSPORT_KINDS:
        registered = plugins.available_transports(reg, kind)
        usable: list[str] = []
        unavailable: dict[str, str] = {}
        for name in sorted(set(registered) | set(KNOWN_TRANSPORTS.get(kind, ()))):
            if name not in registered:
                why = (
                    "its plugin is blocked (fastsync-transports in disabled_plugins)"
                    if plugins.BUILTIN_TRANSPORTS in blocked
                    else "not registered by any plugin"
                )
                unavailable[name] = why
                continue
            reason = _needs(kind, name, deps)
            if reason:
                unavailable[name] = reason
            else:
                usable.append(name)
        transports[kind] = {"registered": registered, "available": usable, "unavailable": unavailable}
    report["transports"] = transports

    if config is not None:
        report["config"] = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()
        }
        try:
            validate_names(config, reg)
        except FastsyncConfigError as exc:
            message = str(exc)
            if (
                config.colocated_transport is not None
                and config.colocated_transport not in transports["colocated"]["registered"]
                and message.startswith(f"{config.key('colocated_transport')}=")
            ):
                message = _with_usable(message, "colocated", transports)
            problems.append(message)
        else:
            if config.colocated_transport is not None:
                why_not = transports["colocated"]["unavailable"].get(config.colocated_transport)
                if why_not:
                    problems.append(
                        f"{config.key('colocated_transport')}={config.colocated_transport!r} "
                        f"cannot work here: {why_not}"
                    )
        verl_loaded = "verl" in sys.modules
        problems.extend(_startup_problems(config, worker_env))
        if not verl_loaded and "verl" in sys.modules and not report["verl"].get("imported_because"):
            report["verl"]["imported_because"] = (
                "the worker's colocated_transport=ipc check asks verl.utils.device.is_support_ipc()"
            )
        if not config.enable:
            report["notes"].append(
                f"{config.key('enable')} is false: verl runs exactly as without the plugin"
            )
    if engine_kwargs:
        report["engine_kwargs"] = engine_kwargs
        try:
            # exactly the engine's call (FastsyncCheckpointEngine.__init__): this process's registry
            settings = parse_engine_kwargs(engine_kwargs)
        except plugins.UnknownPluginNameError as exc:
            problems.append(_with_usable(str(exc), "engine", transports))
        except (FastsyncConfigError, plugins.PluginHookError) as exc:
            problems.append(str(exc))
        else:
            report["engine_settings"] = {
                k: (dict(v) if isinstance(v, Mapping) else v) for k, v in dataclasses.asdict(settings).items()
            }
            if settings.delta:
                delta_problem, delta_note = _delta_memory(overrides)
                report["notes"].append(delta_note)
                if delta_problem:
                    problems.append(delta_problem)
                if settings.transport == "shm":
                    report["notes"].append(
                        f"{ENGINE_KEY_PREFIX}.delta=true with transport=shm: on one host there is no link "
                        "to save and the delta bench measured a delta sync 2-3x slower than a full one; "
                        "delta pays across hosts (gloo, nixl), keep delta=false with shm"
                    )
            why = transports["engine"]["unavailable"].get(settings.transport)
            if why:
                problems.append(
                    f"{ENGINE_KEY_PREFIX}.transport={settings.transport!r} cannot work here: {why}"
                )
    report["verl"]["imported"] = "verl" in sys.modules
    report["ok"] = not problems
    return report


def _registry(blocked: Sequence[str]) -> tuple[Registry | None, str]:
    """``(registry, "")`` of this process for ``blocked`` (what the trainer worker builds), or
    ``(None, problem)``: a :class:`~verl_fastsync.plugins.PluginConflictError` (two distributions
    claiming one name or one entry-point name; its message names both) or another plugin that cannot be
    loaded becomes one problem line instead of a traceback."""
    from verl_fastsync import plugins

    try:
        return plugins.registry(blocked), ""
    except plugins.PluginConflictError as exc:
        return None, f"plugin conflict: {exc}"
    except plugins.PluginHookError as exc:
        return None, f"the verl-fastsync plugins cannot be loaded: {exc}"
    except Exception as exc:
        return None, f"the plugin manager cannot be built: {type(exc).__name__}: {exc}"


def _provided(entry: Provided) -> dict[str, Any]:
    """One :class:`~verl_fastsync.plugins.Provided` as JSON: who provides the name, and what it replaced."""
    old = entry.replaced
    return {
        "name": entry.name,
        "plugin": entry.plugin,
        "distribution": entry.distribution,
        "builtin": entry.builtin,
        "replaced": None
        if old is None
        else {"name": old.name, "plugin": old.plugin, "distribution": old.distribution},
    }


def plugin_listing(reg: Registry, blocked: Sequence[str] = ()) -> dict[str, Any]:
    """``report["plugins"]`` for a :class:`~verl_fastsync.plugins.Registry`.

    ``names`` lists, per hook, every provided name (sorted) with its plugin, its distribution and the
    built-in it replaced (or None): ``names["pre_resume_cleanup"]`` and ``names["post_transfer_cleanup"]``
    are lists, ``names["weight_transport"]`` maps each transport kind (``engine``, ``colocated``) to one.
    """
    from verl_fastsync import plugins

    names: dict[str, Any] = {b: [_provided(p) for p in reg.cleanup[b].values()] for b in plugins.BOUNDARIES}
    names["weight_transport"] = {
        kind: [_provided(p) for p in reg.transports[kind].values()] for kind in plugins.TRANSPORT_KINDS
    }
    return {
        "blocked": list(blocked),
        "registered": sorted(name for name, plugin in reg.pm.list_name_plugin() if plugin is not None),
        "hooks": plugins.hook_owners(reg),
        "names": names,
    }


def _is_entry_point(name: str) -> bool:
    try:
        from importlib.metadata import entry_points

        from verl_fastsync import NAME

        return any(ep.name == name for ep in entry_points(group=NAME))
    except Exception:
        return False


def _render_names(entries: Sequence[Mapping[str, Any]], prefix: str = "") -> list[str]:
    """One line per plugin of the names it provides (in name order), and one per replaced name:
    ``light from better (better-light 1.0), replacing the built-in light of fastsync-cleanup (...)``."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for entry in entries:
        old = entry.get("replaced")
        key = (entry["plugin"], entry["distribution"]) + (
            (entry["name"], old["plugin"], old["distribution"]) if old else ()
        )
        groups.setdefault(key, []).append(entry["name"])
    lines = []
    for key, names in groups.items():
        line = f"    {prefix}{', '.join(names)} from {key[0]} ({key[1]})"
        if len(key) > 2:
            line += f", replacing the built-in {key[2]} of {key[3]} ({key[4]})"
        lines.append(line)
    return lines


def _render_plugins(p: Mapping[str, Any]) -> list[str]:
    """The plugin lines: who implements each hook, then which plugin provides which of its names."""
    blocked = f"  (blocked: {', '.join(p['blocked'])})" if p["blocked"] else ""
    if "error" in p:
        return [f"plugins: cannot be loaded, see the ERROR below{blocked}"]
    lines = [f"plugins: {', '.join(p['registered'])}{blocked}"]
    names = p.get("names", {})
    for hook, owners in p["hooks"].items():
        lines.append(f"  hook {hook}: {', '.join(owners) or '(no implementation)'}")
        provided = names.get(hook)
        if isinstance(provided, Mapping):  # weight_transport: per kind
            for kind, entries in provided.items():
                lines.extend(_render_names(entries, f"{kind}: ") or [f"    {kind}: (no transport)"])
        elif provided:
            lines.extend(_render_names(provided))
    return lines


def render(report: dict[str, Any]) -> str:
    """The report as text."""
    lines: list[str] = []
    v = report["verl"]
    fs = report["verl_fastsync"]
    lines.append(f"verl-fastsync {fs['version']} ({fs['path']})")
    if v.get("installed"):
        lines.append(f"verl {v.get('version')} ({v.get('path')})")
        if v.get("imported_because"):
            lines.append(f"  verl imported by doctor: {v['imported_because']}")
        lines.append(
            "  loads verl.plugins entry points on import: "
            + ("yes" if v.get("loads_verl_plugins_entry_points") else "no")
        )
        lines.append(f"  entry point installed: {v.get('entry_point') or 'no'}")
    lines.append(f"  plugin loading: {v.get('load_route')}")
    if v.get("env_route_active_here"):
        lines.append(
            f"  {ENV_MODULES}=verl_fastsync is set in this shell (not counted: Ray actors get "
            f"+{RAY_ENV_PREFIX}.* only)"
        )
    for name, value in report.get("worker_env", {}).items():
        lines.append(f"  Ray actors' environment (override): {name}={value}")
    if "plugins" in report:
        lines.extend(_render_plugins(report["plugins"]))
    if "cleanup_policies" in report:
        for b, names in report["cleanup_policies"].items():
            lines.append(f"cleanup policies @ {b}: {', '.join(names) or '(none)'}")
    if "transports" in report:
        for kind, t in report["transports"].items():
            lines.append(f"{kind} transports available: {', '.join(t['available']) or '(none)'}")
            for name, why in t["unavailable"].items():
                lines.append(f"  {name}: unavailable - {why}")
    if "config" in report:
        lines.append("resolved fastsync config:")
        for k, val in report["config"].items():
            lines.append(f"  {KEY_PREFIX}.{k} = {val!r}")
    if "engine_kwargs" in report:
        lines.append(f"engine kwargs ({ENGINE_KEY_PREFIX}): {report['engine_kwargs']!r}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    for warning in report.get("warnings", ()):
        lines.append(f"WARNING: {warning}")
    for problem in report["problems"]:
        lines.append(f"ERROR: {problem}")
    lines.append("status: " + ("ok" if report.get("ok") else f"{len(report['problems'])} problem(s)"))
    return "\n".join(lines)
