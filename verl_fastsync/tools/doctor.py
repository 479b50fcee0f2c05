"""``verl-fastsync doctor``: what the plugin will do in this environment, and what cannot work.

It reports the installed verl release and how the plugin gets loaded there, which plugin implements
each hook, which transports are available per kind (and why the others are not), and the resolved
``fastsync`` config for Hydra-style overrides given on the command line - with the same validation
errors the workers would raise. The exit status is non-zero when something requested cannot work.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

from verl_fastsync.config import KEY_PREFIX

ENGINE_KEY_PREFIX = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync"
ENV_ROUTE = "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=verl_fastsync"

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
    out["cupy"] = _probe_import("cupy")
    if out["cupy"].ok:
        try:
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            out["cupy"] = Probe(n > 0, f"cupy {cupy.__version__}, {n} device(s)")
        except Exception as exc:
            out["cupy"] = Probe(False, f"cupy imports but has no CUDA device: {type(exc).__name__}: {exc}")
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


def _verl_init_source() -> str | None:
    """The source of the importable ``verl/__init__.py`` (found without importing verl), or None."""
    spec = importlib.util.find_spec("verl")
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


def verl_info() -> dict[str, Any]:
    """The importable verl release and how the plugin gets loaded into it."""
    info: dict[str, Any] = {"installed": False}
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        info["load_route"] = "verl is not installed: nothing loads the plugin"
        return info
    info["installed"] = True
    info["path"] = os.path.dirname(spec.origin)
    try:
        import verl

        info["version"] = str(getattr(verl, "__version__", "unknown"))
    except Exception as exc:
        info["version"] = None
        info["import_error"] = f"{type(exc).__name__}: {exc}"
    loads_entry_points = verl_loads_entry_points()
    info["loads_verl_plugins_entry_points"] = loads_entry_points
    try:
        from importlib.metadata import entry_points

        eps = [ep for ep in entry_points(group="verl.plugins") if ep.value.split(":")[0] == "verl_fastsync"]
    except Exception:
        eps = []
    info["entry_point"] = f"{eps[0].name} = {eps[0].value}" if eps else None
    env_modules = [m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    plugins_policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    info["env"] = {
        "VERL_USE_EXTERNAL_MODULES": os.environ.get("VERL_USE_EXTERNAL_MODULES"),
        "VERL_USE_EXTERNAL_PLUGINS": os.environ.get("VERL_USE_EXTERNAL_PLUGINS"),
    }
    allowed_by_policy = plugins_policy == "auto" or (
        plugins_policy != "none" and eps and eps[0].name in {p.strip() for p in plugins_policy.split(",")}
    )
    if loads_entry_points and eps and allowed_by_policy:
        info["load_route"] = (
            f"entry point verl.plugins:{eps[0].name} - `import verl` loads the plugin in every process"
        )
        info["env_route_needed"] = False
    else:
        why = (
            "this verl release does not load verl.plugins entry points"
            if not loads_entry_points
            else "no verl.plugins entry point for verl_fastsync is installed"
            if not eps
            else f"VERL_USE_EXTERNAL_PLUGINS={plugins_policy!r} excludes it"
        )
        info["load_route"] = f"{why}: add {ENV_ROUTE}"
        info["env_route_needed"] = True
    info["env_route"] = ENV_ROUTE
    info["env_route_active_here"] = "verl_fastsync" in env_modules
    return info


def parse_overrides(overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Hydra-style ``[+|++]key=value`` overrides -> the nested mapping (values parsed by OmegaConf's
    YAML value grammar, as Hydra does) and the list of keys that are not fastsync keys."""
    from omegaconf import OmegaConf

    dotlist: list[str] = []
    ignored: list[str] = []
    for raw in overrides:
        item = raw.lstrip("+")
        if raw.startswith("~"):
            raise OverrideError(
                f"{raw!r}: deleting a key is not supported by doctor; allowed: [+|++]key=value"
            )
        key, sep, _value = item.partition("=")
        if not sep or not key:
            raise OverrideError(f"{raw!r} is not an override; allowed: [+|++]key=value")
        if key.startswith(KEY_PREFIX + ".") or key == KEY_PREFIX or key.startswith(ENGINE_KEY_PREFIX + "."):
            dotlist.append(item)
        else:
            ignored.append(key)
    try:
        conf = OmegaConf.from_dotlist(dotlist)
    except Exception as exc:
        raise OverrideError(f"cannot parse overrides {dotlist}: {exc}") from exc
    return OmegaConf.to_container(conf, resolve=True), ignored  # type: ignore[return-value]


def _dig(mapping: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return None
        mapping = mapping[part]
    return mapping


def diagnose(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The doctor report as a JSON-able dict; ``problems`` is non-empty when something cannot work."""
    from verl_fastsync import __version__, plugins
    from verl_fastsync.config import FastsyncConfigError, parse_fastsync_config, validate_names

    report: dict[str, Any] = {
        "verl_fastsync": {"version": __version__, "path": os.path.dirname(__file__)},
        "python": sys.version.split()[0],
        "problems": [],
        "notes": [],
    }
    problems: list[str] = report["problems"]
    report["verl"] = verl_info()
    if report["verl"].get("import_error"):
        problems.append(f"import verl failed: {report['verl']['import_error']}")

    config = None
    engine_kwargs: dict[str, Any] = {}
    try:
        tree, ignored = parse_overrides(overrides)
        if ignored:
            report["notes"].append(f"ignored (not fastsync keys): {', '.join(ignored)}")
        config = parse_fastsync_config(_dig(tree, KEY_PREFIX))
        engine_kwargs = _dig(tree, ENGINE_KEY_PREFIX) or {}
    except (OverrideError, FastsyncConfigError) as exc:
        problems.append(str(exc))

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
            problems.append(str(exc))
        else:
            if config.colocated_transport is not None:
                why_not = transports["colocated"]["unavailable"].get(config.colocated_transport)
                if why_not:
                    problems.append(
                        f"{config.key('colocated_transport')}={config.colocated_transport!r} "
                        f"cannot work here: {why_not}"
                    )
        if not config.enable:
            report["notes"].append(
                f"{config.key('enable')} is false: verl runs exactly as without the plugin"
            )
    if engine_kwargs:
        report["engine_kwargs"] = engine_kwargs
        engine_name = engine_kwargs.get("transport") if isinstance(engine_kwargs, dict) else None
        if engine_name is not None:
            try:
                plugins.select_transport(pm, str(engine_name), "engine", key=f"{ENGINE_KEY_PREFIX}.transport")
            except (plugins.UnknownPluginNameError, plugins.PluginHookError) as exc:
                problems.append(str(exc))
            else:
                why = transports["engine"]["unavailable"].get(str(engine_name))
                if why:
                    problems.append(f"{ENGINE_KEY_PREFIX}.transport={engine_name!r} cannot work here: {why}")
    report["ok"] = not problems
    return report


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
        lines.append(
            "  loads verl.plugins entry points on import: "
            + ("yes" if v.get("loads_verl_plugins_entry_points") else "no")
        )
        lines.append(f"  entry point installed: {v.get('entry_point') or 'no'}")
    lines.append(f"  plugin loading: {v.get('load_route')}")
    if v.get("env_route_active_here"):
        lines.append("  VERL_USE_EXTERNAL_MODULES=verl_fastsync is set in this environment")
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
