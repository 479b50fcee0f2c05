"""Imported inside a Ray actor process the way a verl worker module is: it imports verl first."""

from __future__ import annotations

import sys
from typing import Any

import verl


class Probe:
    def __init__(self) -> None:
        # Construction time: has the plugin been installed by now?
        self.installed_at_construction = "verl_fastsync" in sys.modules

    def report(self) -> dict[str, Any]:
        import verl.workers.engine_workers as ew

        return {
            "installed_at_construction": self.installed_at_construction,
            "update_weights_wrapped": bool(
                getattr(ew.ActorRolloutRefWorker.update_weights, "__verl_fastsync_wrapped__", False)
            ),
            "verl_version": verl.__version__,
            "verl_file": verl.__file__,
        }
