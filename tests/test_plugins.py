"""The plugin manager and registry: specs, built-ins, entry points, merging, conflicts, blocking,
type checks at start, check_pending, the 0.1-shape migration error."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pluggy
import pytest
from _plugin_dist import write_plugin_dist

from verl_fastsync import NAME, hookimpl, hookspecs, plugins

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ("pre_resume_cleanup", "post_transfer_cleanup", "weight_transport")
BUILTIN_POLICIES = ["adaptive", "aggressive", "light", "none"]


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(plugins.ENV_DISABLED, raising=False)
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture
def pm() -> pluggy.PluginManager:
    return plugins.get_plugin_manager()


def _dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str) -> None:
    root = tmp_path / module
    root.mkdir()
    write_plugin_dist(root, module, source)
    monkeypatch.syspath_prepend(str(root))


def test_project_name_and_hooks(pm: pluggy.PluginManager) -> None:
    assert pm.project_name == NAME == "verl_fastsync"
    assert {name for name in dir(pm.hook) if not name.startswith("_")} == set(HOOKS) == set(plugins.HOOKS)
    for name in HOOKS:
        opts = getattr(pm.hook, name).spec.opts
        assert not opts["firstresult"] and not opts["historic"]  # every plugin's mapping is merged


def test_builtins_are_internal_plugins(pm: pluggy.PluginManager) -> None:
    reg = plugins.registry_of(pm)
    for boundary in plugins.BOUNDARIES:
        assert list(reg.cleanup[boundary]) == BUILTIN_POLICIES
        entry = reg.cleanup[boundary]["light"]
        assert entry.plugin == plugins.BUILTIN_CLEANUP and entry.replaced is None
        assert entry.distribution.startswith("verl-fastsync ")
    assert list(reg.transports["engine"]) == ["gloo", "nccl", "nixl", "shm"]
    assert list(reg.transports["colocated"]) == ["ipc", "shm"]


def test_one_registry_per_process() -> None:
    assert plugins.registry() is plugins.registry()
    assert plugins.plugin_manager() is plugins.registry().pm
    assert plugins.registry(["x"]) is not plugins.registry()


def test_hookspecs_import_no_heavy_modules() -> None:
    code = (
        "import sys, verl_fastsync.hookspecs, verl_fastsync.plugins, verl_fastsync.config; "
        "print(sorted(m for m in ('torch', 'cupy', 'nixl', 'verl') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_third_party_replaces_builtin_and_it_is_shown(pm: pluggy.PluginManager) -> None:
    def mine(ctx: object) -> None:
        return None

    class Mine:
        @hookimpl
        def pre_resume_cleanup(self) -> dict[str, object]:
            return {"light": mine, "mine": mine}

    pm.register(Mine(), name="mine")
    reg = plugins.registry_of(pm)
    assert reg.cleanup_policy("pre_resume_cleanup", "light") is mine
    entry = reg.cleanup["pre_resume_cleanup"]["light"]
    assert entry.plugin == "mine" and entry.replaced is not None
    assert entry.replaced.plugin == plugins.BUILTIN_CLEANUP
    assert "mine" in plugins.available_cleanup_policies(pm, "pre_resume_cleanup")
    # the other boundary keeps the built-in
    assert reg.cleanup["post_transfer_cleanup"]["light"].plugin == plugins.BUILTIN_CLEANUP


def test_two_distributions_claiming_one_name_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("fastsync_one", "fastsync_two"):
        _dist(
            tmp_path,
            monkeypatch,
            module,
            """
            from verl_fastsync import hookimpl

            @hookimpl
            def weight_transport(kind):
                return {"pigeon": object} if kind == "colocated" else None
            """,
        )
    with pytest.raises(plugins.PluginConflictError) as info:
        plugins.registry()
    message = str(info.value)
    assert "weight_transport(kind='colocated'): the name 'pigeon' is provided by two plugins" in message
    assert "(fastsync-one 1.0)" in message and "(fastsync-two 1.0)" in message
    # blocking one of them (environment: every process) resolves it
    monkeypatch.setenv(plugins.ENV_DISABLED, "fastsync_two")
    plugins.reset()
    assert plugins.registry().transports["colocated"]["pigeon"].distribution == "fastsync-one 1.0"


_REPLACE_LIGHT = """
    from verl_fastsync import hookimpl

    def mine(ctx):
        return None

    @hookimpl
    def pre_resume_cleanup():
        return {"light": mine}

    @hookimpl
    def weight_transport(kind):
        return {"shm": lambda **kwargs: None} if kind == "colocated" else None
    """


def test_two_distributions_claiming_one_plugin_name_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two distributions whose entry points share one name: pluggy holds one plugin per name, so
    # loading only the first on sys.path would drop the other silently
    for module in ("fastsync_claim_a", "fastsync_claim_b"):
        root = tmp_path / module
        root.mkdir()
        write_plugin_dist(root, module, "", entry_name="fastsync_claimed")
        monkeypatch.syspath_prepend(str(root))
    with pytest.raises(plugins.PluginConflictError) as info:
        plugins.registry()
    message = str(info.value)
    assert "the verl-fastsync plugin name 'fastsync_claimed' is claimed by two distributions" in message
    assert "fastsync-claim-a 1.0 (fastsync_claim_a)" in message
    assert "fastsync-claim-b 1.0 (fastsync_claim_b)" in message
    # blocking the name leaves both out (nothing is loaded under it, so nothing is ambiguous)
    assert "fastsync_claimed" not in plugins.hook_owners(plugins.get_plugin_manager(["fastsync_claimed"]))


def test_one_distribution_found_twice_is_loaded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = """
        from verl_fastsync import hookimpl

        @hookimpl
        def post_transfer_cleanup():
            return {"again": lambda ctx: None}
        """
    for where in ("site_a", "site_b"):  # the same distribution installed into two sys.path entries
        root = tmp_path / where
        root.mkdir()
        write_plugin_dist(root, "fastsync_twice", source)
        monkeypatch.syspath_prepend(str(root))
    entry_points = plugins._entry_points()
    mine = [ep for ep in entry_points if ep.name == "fastsync_twice"]
    monkeypatch.setattr(plugins, "_entry_points", lambda: [*entry_points, *mine])  # seen twice
    reg = plugins.registry()
    assert reg.cleanup["post_transfer_cleanup"]["again"].distribution == "fastsync-twice 1.0"
    assert plugins.hook_owners(reg)["post_transfer_cleanup"].count("fastsync_twice") == 1


@pytest.mark.parametrize("builtin", plugins.BUILTIN_PLUGINS)
def test_third_party_entry_point_named_like_a_builtin_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builtin: str
) -> None:
    module = "fastsync_impostor_" + builtin.replace("-", "_")
    root = tmp_path / module
    root.mkdir()
    write_plugin_dist(root, module, _REPLACE_LIGHT, entry_name=builtin)
    monkeypatch.syspath_prepend(str(root))
    with pytest.raises(plugins.PluginConflictError) as info:
        plugins.registry()
    message = str(info.value)
    assert f"plugin entry point {builtin!r} ({module.replace('_', '-')} 1.0) is named like the built-in" in (
        message
    )
    assert "rename the entry point" in message


def test_replacing_a_builtin_name_is_logged_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _dist(tmp_path, monkeypatch, "fastsync_replacer", _REPLACE_LIGHT)
    caplog.set_level("INFO", logger="verl_fastsync.plugins")
    reg = plugins.registry()
    assert reg.cleanup["pre_resume_cleanup"]["light"].distribution == "fastsync-replacer 1.0"
    plugins.registry(["other"])  # a second registry of this process: nothing logged again
    plugins.registry_of(plugins.get_plugin_manager())
    lines = [r.getMessage() for r in caplog.records if r.name == "verl_fastsync.plugins"]
    builtin = plugins.BUILTIN_DISTRIBUTION
    assert sorted(lines) == [
        "verl-fastsync: pre_resume_cleanup(): the built-in name 'light' (plugin 'fastsync-cleanup', "
        f"{builtin}) is replaced by plugin 'fastsync_replacer' (fastsync-replacer 1.0)",
        "verl-fastsync: weight_transport(kind='colocated'): the built-in name 'shm' (plugin "
        f"'fastsync-transports', {builtin}) is replaced by plugin 'fastsync_replacer' "
        "(fastsync-replacer 1.0)",
    ]
    assert all(r.levelname == "WARNING" for r in caplog.records if r.name == "verl_fastsync.plugins")


def test_unknown_names_list_available(pm: pluggy.PluginManager) -> None:
    with pytest.raises(plugins.UnknownPluginNameError) as info:
        plugins.select_cleanup(pm, "pre_resume_cleanup", "turbo", key="k")
    assert (
        str(info.value) == "k='turbo': unknown cleanup policy; available: adaptive, aggressive, light, none"
    )
    assert isinstance(info.value, ValueError)
    with pytest.raises(
        plugins.UnknownPluginNameError, match=r"transport='warp': unknown engine transport; available: gloo, "
    ):
        plugins.select_transport(pm, "warp", "engine")
    with pytest.raises(ValueError, match="unknown transport kind 'remote'; allowed: engine, colocated"):
        plugins.select_transport(pm, "shm", "remote")
    with pytest.raises(ValueError, match="unknown cleanup boundary"):
        plugins.select_cleanup(pm, "mid_sync", "light")


def test_blocking_builtin_removes_its_names_and_says_so() -> None:
    pm = plugins.get_plugin_manager(blocked=[plugins.BUILTIN_CLEANUP])
    assert plugins.available_cleanup_policies(pm, "pre_resume_cleanup") == []
    with pytest.raises(
        plugins.UnknownPluginNameError,
        match=r"available: \(none registered\) \(blocked by disabled_plugins: fastsync-cleanup\)",
    ):
        plugins.select_cleanup(pm, "pre_resume_cleanup", "light")


def test_blocked_name_is_reported_as_blocked_not_unknown() -> None:
    reg = plugins.Registry(plugins.get_plugin_manager(blocked=[plugins.BUILTIN_TRANSPORTS]))
    with pytest.raises(plugins.UnknownPluginNameError) as info:
        reg.transport("engine", "gloo", key="k")
    assert str(info.value).startswith(
        "k='gloo': engine transport blocked by disabled_plugins (provided by plugin 'fastsync-transports', "
        f"{plugins.BUILTIN_DISTRIBUTION}); available: (none registered)"
    )
    # a name no plugin provides, blocked or not, stays unknown
    with pytest.raises(plugins.UnknownPluginNameError, match="k='rdma': unknown engine transport"):
        reg.transport("engine", "rdma", key="k")


def test_block_list_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.ENV_DISABLED, " fastsync-transports ,, other")
    assert plugins.blocked_from_env() == ("fastsync-transports", "other")
    reg = plugins.registry()
    assert reg.transports == {"engine": {}, "colocated": {}}
    assert list(reg.cleanup["pre_resume_cleanup"]) == BUILTIN_POLICIES


def test_entry_point_plugin_loaded_and_blockable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _dist(
        tmp_path,
        monkeypatch,
        "fastsync_extra_policy",
        """
        from verl_fastsync import hookimpl

        @hookimpl
        def post_transfer_cleanup():
            return {"twice": lambda ctx: None}
        """,
    )
    pm = plugins.get_plugin_manager()
    assert "twice" in plugins.available_cleanup_policies(pm, "post_transfer_cleanup")
    assert "fastsync_extra_policy" in plugins.hook_owners(pm)["post_transfer_cleanup"]
    entry = plugins.registry_of(pm).cleanup["post_transfer_cleanup"]["twice"]
    assert entry.distribution == "fastsync-extra-policy 1.0" and entry.replaced is None
    blocked = plugins.get_plugin_manager(blocked=["fastsync_extra_policy"])
    assert "twice" not in plugins.available_cleanup_policies(blocked, "post_transfer_cleanup")


def test_check_pending_rejects_misspelled_hook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _dist(
        tmp_path,
        monkeypatch,
        "fastsync_typo",
        """
        from verl_fastsync import hookimpl

        @hookimpl
        def pre_resume_clenaup():
            return None
        """,
    )
    with pytest.raises(pluggy.PluginValidationError, match="pre_resume_clenaup"):
        plugins.get_plugin_manager()
    plugins.get_plugin_manager(blocked=["fastsync_typo"])  # blocking it is the way out


def test_old_hook_shape_gets_a_migration_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _dist(
        tmp_path,
        monkeypatch,
        "fastsync_old",
        """
        from verl_fastsync import hookimpl

        @hookimpl
        def pre_resume_cleanup(policy, available):
            available.append("twice")
            return None
        """,
    )
    with pytest.raises(plugins.PluginShapeError) as info:
        plugins.get_plugin_manager()
    message = str(info.value)
    assert (
        "plugin 'fastsync_old' (fastsync-old 1.0) implements pre_resume_cleanup(policy, available)" in message
    )
    assert "the 0.1 hook shape. Since verl-fastsync 0.2.0" in message
    assert "`def pre_resume_cleanup(): return {'mine': my_impl}`" in message
    assert "VERL_FASTSYNC_DISABLED_PLUGINS=fastsync_old" in message


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            "return ['twice']",
            "returned ['twice'] from pre_resume_cleanup(); a hook returns {name: implementation}",
        ),
        ("return {'twice': 3}", "returned 'twice': 3 from pre_resume_cleanup(), which is not a callable"),
        ("return {'': print}", "returned the name '' from pre_resume_cleanup()"),
    ],
)
def test_returned_objects_type_checked_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, body: str, error: str
) -> None:
    module = f"fastsync_bad{abs(hash(body))}"  # a fresh module per case (sys.modules caches imports)
    _dist(
        tmp_path,
        monkeypatch,
        module,
        f"""
        from verl_fastsync import hookimpl

        @hookimpl
        def pre_resume_cleanup():
            {body}
        """,
    )
    with pytest.raises(plugins.PluginHookError) as info:
        plugins.registry()
    assert f"verl-fastsync plugin {module!r} ({module.replace('_', '-')} 1.0)" in str(info.value)
    assert error in str(info.value)


def test_engine_transport_checked_at_start(pm: pluggy.PluginManager) -> None:
    class NoTopology:
        @hookimpl
        def weight_transport(self, kind: str) -> dict[str, object]:
            return {"half": print} if kind == "engine" else {}

    pm.register(NoTopology(), name="half")
    with pytest.raises(plugins.PluginHookError, match="which is not an engine transport factory"):
        plugins.registry_of(pm)


def test_raising_plugin_named(pm: pluggy.PluginManager) -> None:
    class Broken:
        @hookimpl
        def weight_transport(self, kind: str) -> None:
            raise KeyError(kind)

    pm.register(Broken(), name="broken-transport")
    with pytest.raises(
        plugins.PluginHookError, match=r"plugin 'broken-transport' .* raised in hook weight_transport"
    ):
        plugins.registry_of(pm)


def test_every_hook_signature_documented_in_readme() -> None:
    readme = (ROOT / "docs" / "hooks.md").read_text()  # the user's guide's hooks page
    for name in HOOKS:
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert re.search(rf"def {name}\({re.escape(params)}\)", readme), f"README lacks def {name}({params})"


def test_every_hookspec_says_who_calls_it_and_what_a_factory_receives() -> None:
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert "Called by:" in doc and ":return:" in doc
        assert "receives" in doc


def test_every_hook_has_a_test() -> None:
    here = Path(__file__).parent
    text = "\n".join(p.read_text() for p in here.glob("test_*.py"))
    for name in HOOKS:
        assert re.search(rf"\b{name}\b", text)
