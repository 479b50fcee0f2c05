"""The plugin manager: specs, built-ins, entry points, blocking, check_pending, selection errors."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest
from _plugin_dist import write_plugin_dist

from verl_fastsync import NAME, hookimpl, hookspecs, plugins

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ("pre_resume_cleanup", "post_transfer_cleanup", "weight_transport")


@pytest.fixture
def pm() -> pluggy.PluginManager:
    return plugins.get_plugin_manager()


def test_project_name_and_hooks(pm: pluggy.PluginManager) -> None:
    assert pm.project_name == NAME == "verl_fastsync"
    assert {name for name in dir(pm.hook) if not name.startswith("_")} == set(HOOKS)
    for name in HOOKS:
        opts = getattr(pm.hook, name).spec.opts
        assert opts["firstresult"] and not opts["historic"]


def test_builtins_are_trylast(pm: pluggy.PluginManager) -> None:
    for hook in HOOKS:
        impls = getattr(pm.hook, hook).get_hookimpls()
        builtin = [i for i in impls if i.plugin_name in plugins.BUILTIN_PLUGINS]
        assert builtin and all(i.trylast for i in builtin)


def test_hookspecs_import_no_heavy_modules() -> None:
    code = (
        "import sys, verl_fastsync.hookspecs, verl_fastsync.plugins; "
        "print(sorted(m for m in ('torch', 'cupy', 'nixl', 'verl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_third_party_wins_over_builtin(pm: pluggy.PluginManager) -> None:
    class Mine:
        @hookimpl
        def pre_resume_cleanup(self, policy: str, available: list[str]) -> object:
            available.append("mine")
            return "policy-object" if policy in ("mine", "light") else None

    pm.register(Mine(), name="mine")
    assert plugins.select_cleanup(pm, "pre_resume_cleanup", "light") == "policy-object"
    assert "mine" in plugins.available_cleanup_policies(pm, "pre_resume_cleanup")
    assert plugins.select_cleanup(pm, "post_transfer_cleanup", "light") is not None


def test_unknown_names_list_available(pm: pluggy.PluginManager) -> None:
    with pytest.raises(plugins.UnknownPluginNameError) as info:
        plugins.select_cleanup(pm, "pre_resume_cleanup", "turbo", key="k")
    assert (
        str(info.value) == "k='turbo': unknown cleanup policy; available: adaptive, aggressive, light, none"
    )
    assert isinstance(info.value, ValueError)
    with pytest.raises(
        plugins.UnknownPluginNameError, match=r"transport='warp': unknown engine transport; available: "
    ):
        plugins.select_transport(pm, "warp", "engine")
    with pytest.raises(ValueError, match="unknown transport kind 'remote'; allowed: engine, colocated"):
        plugins.select_transport(pm, "shm", "remote")
    with pytest.raises(ValueError, match="unknown cleanup boundary"):
        plugins.select_cleanup(pm, "mid_sync", "light")


def test_blocking_builtin_removes_its_names() -> None:
    pm = plugins.get_plugin_manager(blocked=[plugins.BUILTIN_CLEANUP])
    assert plugins.available_cleanup_policies(pm, "pre_resume_cleanup") == []
    with pytest.raises(plugins.UnknownPluginNameError, match=r"available: \(none registered\)"):
        plugins.select_cleanup(pm, "pre_resume_cleanup", "light")


def test_entry_point_plugin_loaded_and_blockable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_plugin_dist(
        tmp_path,
        "fastsync_extra_policy",
        """
        from verl_fastsync import hookimpl

        @hookimpl
        def post_transfer_cleanup(policy, available):
            available.append("twice")
            return (lambda ctx: None) if policy == "twice" else None
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = plugins.get_plugin_manager()
    assert "twice" in plugins.available_cleanup_policies(pm, "post_transfer_cleanup")
    assert "fastsync_extra_policy" in plugins.hook_owners(pm)["post_transfer_cleanup"]
    blocked = plugins.get_plugin_manager(blocked=["fastsync_extra_policy"])
    assert "twice" not in plugins.available_cleanup_policies(blocked, "post_transfer_cleanup")


def test_check_pending_rejects_misspelled_hook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_plugin_dist(
        tmp_path,
        "fastsync_typo",
        """
        from verl_fastsync import hookimpl

        @hookimpl
        def pre_resume_clenaup(policy, available):
            return None
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pluggy.PluginValidationError, match="pre_resume_clenaup"):
        plugins.get_plugin_manager()
    plugins.get_plugin_manager(blocked=["fastsync_typo"])  # blocking it is the way out


def test_raising_plugin_named(pm: pluggy.PluginManager) -> None:
    class Broken:
        @hookimpl
        def weight_transport(self, name: str, kind: str, available: list[str]) -> None:
            raise KeyError(name)

    pm.register(Broken(), name="broken-transport")
    with pytest.raises(
        plugins.PluginHookError, match="plugin 'broken-transport' raised in hook weight_transport"
    ):
        plugins.select_transport(pm, "shm", "engine")


def test_every_hook_signature_documented_in_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in HOOKS:
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert re.search(rf"def {name}\({re.escape(params)}\)", readme), f"README lacks def {name}({params})"


def test_every_hook_has_a_test() -> None:
    here = Path(__file__).parent
    text = "\n".join(p.read_text() for p in here.glob("test_*.py"))
    for name in HOOKS:
        assert re.search(rf"\b{name}\b", text)
