"""A real installed distribution on a temporary path: a module plus a dist-info whose entry point
of group ``verl_fastsync`` points at it (what ``pip install`` of a third-party plugin leaves)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_plugin_dist(root: Path, module: str, source: str, entry_name: str | None = None) -> None:
    """Write ``module.py`` (dedented ``source``) and ``module-1.0.dist-info`` under ``root``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[verl_fastsync]\n{entry_name or module} = {module}\n")
