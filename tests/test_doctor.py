"""``verl-fastsync doctor``: what it concludes from the installed verl, and its answers to bad set-ups.

The command-line runs are subprocesses with timeouts; nothing here asserts on timings.
"""

from __future__ import annotations

from verl_fastsync.tools import doctor


def test_entry_point_loading_decided_by_code_not_comments() -> None:
    loads = (
        "import os\n"
        "from importlib.metadata import entry_points as _eps\n"
        "for ep in _eps(group='verl.plugins'):\n"
        "    ep.load()\n"
    )
    assert doctor.verl_loads_entry_points(loads) is True
    # the group named only in a comment or docstring, or entry points never read: not loaded
    assert doctor.verl_loads_entry_points("# load verl.plugins entry_points some day\n") is False
    assert doctor.verl_loads_entry_points('"""verl.plugins"""\nVERSION = "0.10.0.dev"\n') is False
    assert doctor.verl_loads_entry_points("x = 'verl.plugins'\n") is False
    assert doctor.verl_loads_entry_points("def broken(:\n") is False


def test_plugin_listing_names_every_builtin_with_its_distribution() -> None:
    from verl_fastsync import __version__, plugins

    listing = doctor.plugin_listing(plugins.Registry(plugins.get_plugin_manager()))
    names = listing["names"]
    tables = [names[b] for b in plugins.BOUNDARIES] + [
        names["weight_transport"][k] for k in plugins.TRANSPORT_KINDS
    ]
    for entries in tables:
        assert [e["name"] for e in entries] == sorted(e["name"] for e in entries)
    builtin = {e["name"]: e for e in names["pre_resume_cleanup"] if e["builtin"]}
    assert set(builtin) == {"adaptive", "aggressive", "light", "none"}
    assert builtin["light"] == {
        "name": "light",
        "plugin": "fastsync-cleanup",
        "distribution": f"verl-fastsync {__version__}",
        "builtin": True,
        "replaced": None,
    }
    assert {e["name"] for e in names["weight_transport"]["colocated"]} >= {"ipc", "shm"}
    lines = doctor._render_plugins(listing)
    assert "  hook weight_transport: fastsync-transports" in lines
    assert any(line.startswith("    colocated: ") and "ipc, shm" in line for line in lines), lines


def test_render_of_a_plugin_conflict_is_one_error_line() -> None:
    problem = "plugin conflict: pre_resume_cleanup(): the name 'light' is provided by two plugins: ..."
    report = {
        "verl_fastsync": {"version": "0", "path": "/x"},
        "verl": {"installed": False, "load_route": "verl is not installed: nothing loads the plugin"},
        "plugins": {"blocked": [], "error": problem},
        "problems": [problem],
        "notes": [],
        "ok": False,
    }
    text = doctor.render(report).splitlines()
    assert "plugins: cannot be loaded, see the ERROR below" in text
    assert text[-2:] == [f"ERROR: {problem}", "status: 1 problem(s)"]
