"""What ``verl-fastsync doctor`` finds on this host, before any override is read.

This module owns:

* the dependency probes of the built-in transports (:func:`probe_dependencies`: torch/CUDA, gloo,
  cupy, nixl, ``/dev/shm``) and which of them a built-in transport needs (:data:`KNOWN_TRANSPORTS`,
  :func:`_needs`);
* the importable verl release, found without importing verl (:func:`verl_version_without_import`,
  :func:`verl_loads_entry_points`), and how the plugin gets loaded into it (:func:`verl_info`: the
  ``verl.plugins`` entry point or the ``VERL_USE_EXTERNAL_MODULES`` route of the Ray actors);
* the names of that route (:data:`RAY_ENV_PREFIX`, :data:`ENV_ROUTE`, ...).

It imports nothing of doctor's other modules; :mod:`verl_fastsync.tools.doctor_checks` and
:mod:`verl_fastsync.tools.doctor` build on it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

RAY_ENV_PREFIX = "ray_kwargs.ray_init.runtime_env.env_vars"
"""Hydra key of the environment every Ray actor of verl gets (``+{RAY_ENV_PREFIX}.NAME=value``)."""
ENV_MODULES = "VERL_USE_EXTERNAL_MODULES"
ENV_PLUGINS = "VERL_USE_EXTERNAL_PLUGINS"
ROUTE_MODULE = "verl_fastsync"
ENV_ROUTE = f"+{RAY_ENV_PREFIX}.{ENV_MODULES}={ROUTE_MODULE}"

__all__ = [
    "ENV_MODULES",
    "ENV_PLUGINS",
    "ENV_ROUTE",
    "KNOWN_TRANSPORTS",
    "RAY_ENV_PREFIX",
    "ROUTE_MODULE",
    "Probe",
    "probe_dependencies",
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


@dataclasses.dataclass
class Probe:
    """One dependency probe: whether it is usable here, and what was found (or why not)."""

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
