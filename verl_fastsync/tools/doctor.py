"""``verl-fastsync doctor``: what the plugin will do in this environment, and what cannot work.

It reports the installed verl release and how the plugin gets loaded there, which plugin implements
each hook, which transports are available per kind (and why the others are not), and the resolved
``fastsync`` config and ``engine_kwargs.fastsync`` for Hydra-style overrides given on the command
line - with the same validation code and messages the workers use
(:func:`~verl_fastsync.config.parse_fastsync_config`, :func:`~verl_fastsync.config.validate_names`,
:func:`~verl_fastsync.config.parse_engine_kwargs`, the start-up checks of
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

Doctor does not import verl: the version comes from the release's ``verl/version/version`` file (what
``verl.__version__`` reads) or its ``dist-info`` next to the package, found with
``importlib.util.find_spec`` without executing verl (``import verl`` takes seconds). Only when neither
exists does it import verl, and the report says so in one line (``verl.imported_because``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from verl_fastsync.config import ENGINE_KEY_PREFIX, KEY_PREFIX

RAY_ENV_PREFIX = "ray_kwargs.ray_init.runtime_env.env_vars"
"""Hydra key of the environment every Ray actor of verl gets (``+{RAY_ENV_PREFIX}.NAME=value``)."""
ENV_MODULES = "VERL_USE_EXTERNAL_MODULES"
ENV_PLUGINS = "VERL_USE_EXTERNAL_PLUGINS"
ROUTE_MODULE = "verl_fastsync"
ENV_ROUTE = f"+{RAY_ENV_PREFIX}.{ENV_MODULES}={ROUTE_MODULE}"

__all__ = [
    "ENGINE_KEY_PREFIX",
    "ENV_ROUTE",
    "KNOWN_TRANSPORTS",
    "RAY_ENV_PREFIX",
    "OverrideError",
    "Overrides",
    "diagnose",
    "parse_overrides",
    "probe_dependencies",
    "render",
    "verl_info",
    "verl_loads_entry_points",
    "verl_version_without_import",
]

# transport -> what it needs, per kind (the built-in ones; third-party transports are reported as
# registered or not, without a dependency check)
KNOWN_TRANSPORTS: dict[str, tuple[str, ...]] = {
    "engine": ("shm", "gloo", "nixl", "nccl"),
    "colocated": ("shm", "ipc"),
}


class OverrideError(ValueError):
    """A command-line override that is not ``[+|++]key=value``."""


@dataclasses.dataclass
class Probe:
    ok: bool
    detail: str


def _probe_import(module: str) -> Probe:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return Probe(False, f"import {module} failed: {type(exc).__name__}: {exc}".strip())
    return Probe(True, f"{module} {getattr(mod, '__version__', '')}".strip())


def _short_error(exc: BaseException) -> str:
    """The first phrase of an error (``cudaErrorInsufficientDriver`` of cupy's long CUDA text)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(":", 1)[0].strip() or type(exc).__name__


def _probe_cupy(cuda_ok: bool) -> Probe:
    probe = _probe_import("cupy")
    if not probe.ok:
        return probe
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        if not cuda_ok:  # a CPU host: the CUDA runtime's text ("driver version is insufficient...") misleads
            return Probe(False, f"no CUDA device/driver (cupy: {_short_error(exc)})")
        return Probe(False, f"cupy cannot use the CUDA device: {type(exc).__name__}: {exc}")
    if n <= 0:
        return Probe(False, f"no CUDA device (cupy {cupy.__version__} sees 0 devices)")
    return Probe(True, f"cupy {cupy.__version__}, {n} device(s)")


def probe_dependencies() -> dict[str, Probe]:
    """Try the imports and device queries the transports depend on."""
    out: dict[str, Probe] = {}
    try:
        import torch

        cuda = torch.cuda.is_available()
        out["cuda"] = Probe(
            cuda,
            f"{torch.cuda.device_count()} CUDA device(s), torch {torch.__version__}"
            if cuda
            else f"torch.cuda.is_available() is False (torch {torch.__version__})",
        )
        import torch.distributed as dist

        gloo = dist.is_available() and dist.is_gloo_available()
        out["gloo"] = Probe(gloo, "torch.distributed gloo backend" if gloo else "torch built without gloo")
    except Exception as exc:  # pragma: no cover - torch is a hard dependency
        out["cuda"] = Probe(False, f"torch not importable: {exc}")
        out["gloo"] = Probe(False, f"torch not importable: {exc}")
    out["cupy"] = _probe_cupy(out["cuda"].ok)
    out["nixl"] = _probe_import("nixl._api")
    shm_ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    out["shm"] = Probe(shm_ok, "/dev/shm writable" if shm_ok else "/dev/shm missing or not writable")
    return out


def _needs(kind: str, name: str, deps: dict[str, Probe]) -> str | None:
    """Why the built-in transport ``name`` of ``kind`` cannot run here (None: it can)."""
    required = {
        ("engine", "shm"): ("shm",),
        ("engine", "gloo"): ("gloo",),
        ("engine", "nixl"): ("nixl",),
        ("engine", "nccl"): ("cuda", "cupy"),
        ("colocated", "shm"): ("shm",),
        ("colocated", "ipc"): ("cuda",),
    }.get((kind, name), ())
    missing = [f"{d}: {deps[d].detail}" for d in required if not deps[d].ok]
    return "; ".join(missing) or None


def _verl_spec() -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None


def _verl_init_source() -> str | None:
    """The source of the importable ``verl/__init__.py`` (found without importing verl), or None."""
    spec = _verl_spec()
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def verl_loads_entry_points(source: str | None = None) -> bool:
    """Whether the importable verl's ``import verl`` loads the ``verl.plugins`` entry-point group.

    Decided by what the release's code does, not by its version number: ``verl/__init__.py`` is read
    (not imported) and its code - comments and docstrings do not count - must name the group
    ``"verl.plugins"`` and call ``entry_points``. False when verl is not installed.
    """
    text = _verl_init_source() if source is None else source
    if text is None:
        return False
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    names_group = calls_entry_points = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == "verl.plugins":
            names_group = True
        elif isinstance(node, ast.alias) and node.name == "entry_points":
            calls_entry_points = True
        elif isinstance(node, ast.Attribute) and node.attr == "entry_points":
            calls_entry_points = True
    return names_group and calls_entry_points


def verl_version_without_import(package_dir: str) -> tuple[str, str] | None:
    """``(version, where it was read)`` of the verl package in ``package_dir``, without executing verl:
    its ``version/version`` file (what ``verl.__version__`` is read from), else the ``verl-*.dist-info``
    installed next to the package (not another verl further down ``sys.path``). None: neither."""
    version_file = os.path.join(package_dir, "version", "version")
    try:
        with open(version_file, encoding="utf-8") as f:
            text = f.read().strip()
        if text:
            return text, version_file
    except OSError:
        pass
    from importlib.metadata import distributions

    site = os.path.dirname(package_dir)
    for dist in distributions(path=[site]):
        name = (dist.metadata["Name"] or "").lower()
        if name == "verl" and dist.version:
            return str(dist.version), f"{getattr(dist, '_path', site)}"
    return None


def _route_modules(value: str | None) -> list[str]:
    """The module names verl imports from ``VERL_USE_EXTERNAL_MODULES``: verl splits it on ``,`` and
    imports each part as it is (no blanks stripped)."""
    return value.split(",") if value else []


def verl_info(worker_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The importable verl release and how the plugin gets loaded into it.

    :param worker_env: the environment verl's Ray actors get from the overrides
        (``+ray_kwargs.ray_init.runtime_env.env_vars.*``); this shell's environment does not count
        (see the module docstring).
    """
    worker_env = dict(worker_env or {})
    info: dict[str, Any] = {"installed": False}
    spec = _verl_spec()
    if spec is None or spec.origin is None:
        info["load_route"] = "verl is not installed: nothing loads the plugin"
        info["env_route_needed"] = False
        info["env_route_configured"] = False
        return info
    info["installed"] = True
    info["path"] = os.path.dirname(spec.origin)
    found = verl_version_without_import(info["path"])
    if found is not None:
        info["version"], info["version_source"] = found
    else:
        info["imported_because"] = (
            f"no version/version file and no verl dist-info next to {info['path']}: imported verl for "
            "verl.__version__"
        )
        try:
            import verl

            info["version"] = str(getattr(verl, "__version__", "unknown"))
            info["version_source"] = "verl.__version__"
        except Exception as exc:
            info["version"] = None
            info["import_error"] = f"{type(exc).__name__}: {exc}"
    loads_entry_points = verl_loads_entry_points()
    info["loads_verl_plugins_entry_points"] = loads_entry_points
    try:
        from importlib.metadata import entry_points

        eps = [ep for ep in entry_points(group="verl.plugins") if ep.value.split(":")[0] == ROUTE_MODULE]
    except Exception:
        eps = []
    info["entry_point"] = f"{eps[0].name} = {eps[0].value}" if eps else None
    env_modules = _route_modules(os.environ.get(ENV_MODULES))
    plugins_policy = (
        (worker_env.get(ENV_PLUGINS, os.environ.get(ENV_PLUGINS, "auto")) or "auto").strip().lower()
    )
    info["env"] = {ENV_MODULES: os.environ.get(ENV_MODULES), ENV_PLUGINS: os.environ.get(ENV_PLUGINS)}
    allowed_by_policy = plugins_policy == "auto" or bool(
        plugins_policy != "none" and eps and eps[0].name in {p.strip() for p in plugins_policy.split(",")}
    )
    route_value = worker_env.get(ENV_MODULES)
    info["env_route"] = ENV_ROUTE
    info["env_route_override"] = route_value
    info["env_route_configured"] = ROUTE_MODULE in _route_modules(route_value)
    info["env_route_active_here"] = ROUTE_MODULE in env_modules
    if loads_entry_points and eps and allowed_by_policy:
        info["load_route"] = (
            f"entry point verl.plugins:{eps[0].name} - `import verl` loads the plugin in every process"
        )
        info["env_route_needed"] = False
    else:
        info["load_route_why"] = why = (
            "this verl release does not load verl.plugins entry points"
            if not loads_entry_points
            else "no verl.plugins entry point for verl_fastsync is installed"
            if not eps
            else f"{ENV_PLUGINS}={plugins_policy!r} excludes it"
        )
        info["env_route_needed"] = True
        if info["env_route_configured"]:
            info["load_route"] = (
                f"{why}; route configured: {RAY_ENV_PREFIX}.{ENV_MODULES}={route_value} makes every Ray "
                "actor import verl_fastsync"
            )
        else:
            info["load_route"] = f"{why}: add {ENV_ROUTE}"
    return info


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


def diagnose(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The doctor report as a JSON-able dict; ``problems`` is non-empty when something cannot work."""
    from verl_fastsync import __version__, plugins
    from verl_fastsync.config import (
        FastsyncConfigError,
        parse_engine_kwargs,
        parse_fastsync_config,
        validate_names,
    )

    report: dict[str, Any] = {
        "verl_fastsync": {"version": __version__, "path": os.path.dirname(__file__)},
        "python": sys.version.split()[0],
        "problems": [],
        "notes": [],
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
    if report["verl"].get("import_error"):
        problems.append(f"import verl failed: {report['verl']['import_error']}")
    wanted_by = [f"{KEY_PREFIX}.enable=true"] if config is not None and config.enable else []
    if engine_kwargs:
        wanted_by.append(f"{ENGINE_KEY_PREFIX}.* is set")
    route_problem = _route_problem(report, wanted_by) if wanted_by else None
    if route_problem:
        problems.append(route_problem)

    blocked = tuple(config.disabled_plugins) if config is not None else ()
    try:
        pm = plugins.get_plugin_manager(blocked)
    except Exception as exc:
        problems.append(f"the plugin manager cannot be built: {type(exc).__name__}: {exc}")
        report["ok"] = False
        return report
    report["plugins"] = {
        "blocked": list(blocked),
        "registered": sorted(name for name, plugin in pm.list_name_plugin() if plugin is not None),
        "hooks": plugins.hook_owners(pm),
    }
    unknown_blocked = [
        b
        for b in blocked
        if b not in report["plugins"]["registered"]
        and b not in plugins.BUILTIN_PLUGINS
        and not _is_entry_point(b)
    ]
    if unknown_blocked:
        report["notes"].append(f"disabled_plugins names no installed plugin: {', '.join(unknown_blocked)}")
    report["cleanup_policies"] = {b: plugins.available_cleanup_policies(pm, b) for b in plugins.BOUNDARIES}

    deps = probe_dependencies()
    report["dependencies"] = {k: dataclasses.asdict(v) for k, v in deps.items()}
    transports: dict[str, Any] = {}
    for kind in plugins.TRANSPORT_KINDS:
        registered = plugins.available_transports(pm, kind)
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
            validate_names(config, pm)
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
            why = transports["engine"]["unavailable"].get(settings.transport)
            if why:
                problems.append(
                    f"{ENGINE_KEY_PREFIX}.transport={settings.transport!r} cannot work here: {why}"
                )
    report["verl"]["imported"] = "verl" in sys.modules
    report["ok"] = not problems
    return report


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


def _is_entry_point(name: str) -> bool:
    try:
        from importlib.metadata import entry_points

        from verl_fastsync import NAME

        return any(ep.name == name for ep in entry_points(group=NAME))
    except Exception:
        return False


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
        p = report["plugins"]
        lines.append(
            f"plugins: {', '.join(p['registered'])}"
            + (f"  (blocked: {', '.join(p['blocked'])})" if p["blocked"] else "")
        )
        for hook, owners in p["hooks"].items():
            lines.append(f"  hook {hook}: {', '.join(owners) or '(no implementation)'}")
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
    for problem in report["problems"]:
        lines.append(f"ERROR: {problem}")
    lines.append("status: " + ("ok" if report.get("ok") else f"{len(report['problems'])} problem(s)"))
    return "\n".join(lines)
