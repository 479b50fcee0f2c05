"""Sphinx extension: the configuration reference, rendered from the code at every build.

``docs/configuration.md`` holds the marker ``<!-- fastsync:reference -->``; this extension replaces it
(Sphinx's ``source-read`` event) with tables built from the package itself:

* ``custom.fastsync`` keys: the fields of :class:`verl_fastsync.config.FastsyncConfig` (name, default,
  the field's own docstring) and, per key, the message :func:`~verl_fastsync.config.parse_fastsync_config`
  gives an invalid value (what is allowed, in the worker's words);
* ``engine_kwargs.fastsync`` keys: :data:`verl_fastsync.config.ENGINE_KEYS`, the defaults of
  :class:`~verl_fastsync.config.EngineSettings`, the meaning from the bullet list of the engine's
  module docstring (``verl_fastsync/verl/engine.py``, read without importing verl) and the message
  :func:`~verl_fastsync.selection.parse_engine_kwargs` gives an invalid value; the keys verl reserves;
* each registered engine transport's own options (``engine_options``) with its validator's docstring
  and message;
* the environment variables that carry the config to processes that never see it;
* the names every hook provides in this build (cleanup policies, engine and colocated transports).

A key without a meaning (an engine key missing from the engine docstring's list, a config field
without a docstring) fails the build: the reference cannot silently fall behind the code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MARKER = "<!-- fastsync:reference -->"
ROOT = Path(__file__).resolve().parents[2]
_INVALID: tuple[object, ...] = ("?", [], "")  # tried in turn until the validator refuses one


class ReferenceError(RuntimeError):
    """The code lacks what the reference needs (a key without its meaning)."""


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _rst_to_md(text: str) -> str:
    """The docstrings' reST literals and roles, as Markdown."""
    text = re.sub(r":(?:func|class|mod|data|meth|attr):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def field_docstrings(path: Path, class_name: str) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string after each annotated field), by field."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            docs: dict[str, str] = {}
            body = node.body
            for stmt, after in itertools.pairwise(body):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    docs[stmt.target.id] = " ".join(after.value.value.split())
            return docs
    raise ReferenceError(f"no class {class_name} in {path}")


def module_docstring(path: Path) -> str:
    """A module's docstring, read without importing it."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if doc is None:
        raise ReferenceError(f"{path} has no module docstring")
    return doc


def engine_key_meanings(doc: str) -> dict[str, str]:
    """The ``* ``key`` ...`` bullets of the engine docstring, by key (continuation lines joined)."""
    meanings: dict[str, str] = {}
    key: str | None = None
    for line in doc.splitlines():
        match = re.match(r"\* ``(\w+)``(.*)", line)
        if match:
            key = match.group(1)
            meanings[key] = match.group(2).strip()
        elif key is not None and line.startswith("  "):
            meanings[key] += " " + line.strip()
        else:
            key = None
    # each bullet opens with its default, "(default ...)", and a colon: the table has its own column
    return {k: re.sub(r"^(\(default [^)]*\))?\s*:\s*", "", v) for k, v in meanings.items()}


def refusal(validate: Callable[[Any], object]) -> str:
    """What ``validate`` says to the first of a few invalid values it refuses ('' if it takes all)."""
    for value in _INVALID:
        try:
            validate(value)
        except Exception as exc:  # the validators' own errors are the point
            return str(exc)
    return ""


def _default(value: object) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, tuple):
        return f"`[{', '.join(value)}]`"
    return f"`{value}`"


def _parse_custom(key: str, value: object) -> object:
    from verl_fastsync.config import parse_fastsync_config

    return parse_fastsync_config({key: value})


def _parse_engine(key: str, value: object) -> object:
    from verl_fastsync.selection import parse_engine_kwargs

    return parse_engine_kwargs({key: value})


def custom_table() -> list[str]:
    from verl_fastsync.config import KEY_PREFIX, FastsyncConfig

    docs = field_docstrings(ROOT / "verl_fastsync" / "config.py", "FastsyncConfig")
    rows = [
        f"Prefix: `{KEY_PREFIX}.` (each override with a leading `+`).",
        "",
        "| key | default | meaning | an invalid value gets |",
        "|---|---|---|---|",
    ]
    for field in dataclasses.fields(FastsyncConfig):
        if field.name not in docs:
            raise ReferenceError(f"FastsyncConfig.{field.name} has no docstring: the reference needs one")
        default = getattr(FastsyncConfig(), field.name)
        said = refusal(functools.partial(_parse_custom, field.name))
        meaning = _cell(_rst_to_md(docs[field.name]))
        rows.append(f"| `{field.name}` | {_default(default)} | {meaning} | {_cell(said)} |")
    return rows


def engine_table() -> list[str]:
    from verl_fastsync.config import _RESERVED_ENGINE_KEYS, ENGINE_KEY_PREFIX, ENGINE_KEYS, EngineSettings

    meanings = engine_key_meanings(module_docstring(ROOT / "verl_fastsync" / "verl" / "engine.py"))
    defaults = {f.name: f.default for f in dataclasses.fields(EngineSettings)}
    rows = [
        f"Prefix: `{ENGINE_KEY_PREFIX}.` (each override with a leading `+`), with "
        "`actor_rollout_ref.rollout.checkpoint_engine.backend=fastsync`.",
        "",
        "| key | default | meaning | an invalid value gets |",
        "|---|---|---|---|",
    ]
    for key in ENGINE_KEYS:
        if key not in meanings:
            raise ReferenceError(
                f"engine key {key!r} is missing from the bullet list of "
                "verl_fastsync/verl/engine.py's docstring"
            )
        default = (
            "verl's `update_weights_bucket_megabytes`" if key == "bucket_bytes" else _default(defaults[key])
        )
        said = refusal(functools.partial(_parse_engine, key))
        rows.append(f"| `{key}` | {default} | {_cell(_rst_to_md(meanings[key]))} | {_cell(said)} |")
    rows += ["", "Keys verl itself passes to the engine, refused in `engine_kwargs.fastsync`:", ""]
    rows += ["| key | why |", "|---|---|"]
    rows += [f"| `{key}` | {_cell(why)} |" for key, why in _RESERVED_ENGINE_KEYS.items()]
    return rows


def transport_options() -> list[str]:
    from verl_fastsync import plugins
    from verl_fastsync.config import ENGINE_KEY_PREFIX

    reg = plugins.registry()
    rows = ["| transport | key | meaning | an invalid value gets |", "|---|---|---|---|"]
    for name, entry in sorted(reg.transports["engine"].items()):
        options: Mapping[str, Callable[[str, Any], Any]] = (
            getattr(entry.implementation, "engine_options", None) or {}
        )
        for key, validate in sorted(options.items()):
            doc = (validate.__doc__ or "").strip()
            if not doc:
                raise ReferenceError(f"the {name} transport's option {key!r}: its validator has no docstring")
            said = refusal(functools.partial(validate, f"{ENGINE_KEY_PREFIX}.{key}"))
            rows.append(f"| `{name}` | `{key}` | {_cell(_rst_to_md(doc))} | {_cell(said)} |")
    return rows


def environment_table() -> list[str]:
    from verl_fastsync import config, plugins

    rows = ["| variable | carries |", "|---|---|"]
    module_docs = {
        config.ENV_COLOCATED: "ENV_COLOCATED",
        config.ENV_COLOCATED_TIMEOUT: "ENV_COLOCATED_TIMEOUT",
        config.ENV_COLOCATED_VERIFY: "ENV_COLOCATED_VERIFY",
    }
    docs = _constant_docstrings(ROOT / "verl_fastsync" / "config.py")
    for variable, constant in module_docs.items():
        rows.append(f"| `{variable}` | {_cell(_rst_to_md(docs[constant]))} |")
    plugin_docs = _constant_docstrings(ROOT / "verl_fastsync" / "plugins.py")
    rows.append(f"| `{plugins.ENV_DISABLED}` | {_cell(_rst_to_md(plugin_docs['ENV_DISABLED']))} |")
    return rows


def _constant_docstrings(path: Path) -> dict[str, str]:
    """Module-level ``NAME = ...`` followed by a string: the constant's docstring, by name."""
    body = ast.parse(path.read_text()).body
    docs: dict[str, str] = {}
    for stmt, after in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.targets[0].id] = " ".join(after.value.value.split())
    return docs


def names_table() -> list[str]:
    from verl_fastsync import plugins

    reg = plugins.registry()
    rows = ["| hook | names in this build |", "|---|---|"]
    for boundary in plugins.BOUNDARIES:
        names = ", ".join(f"`{n}`" for n in plugins.available_cleanup_policies(reg, boundary))
        rows.append(f"| `{boundary}` | {names} |")
    for kind in plugins.TRANSPORT_KINDS:
        names = ", ".join(f"`{n}`" for n in plugins.available_transports(reg, kind))
        rows.append(f"| `weight_transport(kind={kind!r})` | {names} |")
    return rows


def render() -> str:
    """The whole generated reference (Markdown)."""
    parts = [
        "### `custom.fastsync`: the plugin and the colocated sync",
        "",
        *custom_table(),
        "",
        "### `engine_kwargs.fastsync`: the `fastsync` checkpoint engine",
        "",
        *engine_table(),
        "",
        "### Options a transport declares (`engine_options`)",
        "",
        *transport_options(),
        "",
        "### Environment variables",
        "",
        "Set for every Ray actor with `+ray_kwargs.ray_init.runtime_env.env_vars.NAME=value`; the trainer "
        "worker checks at start that each agrees with its config key and names the override to add.",
        "",
        *environment_table(),
        "",
        "### Names provided by the built-in plugins",
        "",
        *names_table(),
        "",
    ]
    return "\n".join(parts)


def _source_read(app: Any, docname: str, source: list[str]) -> None:
    if MARKER in source[0]:
        source[0] = source[0].replace(MARKER, render())


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
