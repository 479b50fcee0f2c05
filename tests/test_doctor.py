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
