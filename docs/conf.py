"""Sphinx configuration of the verl-fastsync user's guide (MyST Markdown pages, Furo theme).

Built strictly by ``scripts/test.sh``: ``sphinx-build -W --keep-going -n`` turns every warning (a link
to a missing page or heading, a page in no table of contents, a reference the generator cannot render)
into a failure. ``_ext/fastsync_reference.py`` renders the configuration reference from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # this checkout's verl_fastsync, whatever is installed

project = "verl-fastsync"
author = "verl-fastsync contributors"
extensions = ["myst_parser", "fastsync_reference"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
html_theme = "furo"
html_title = "verl-fastsync"
nitpicky = True
