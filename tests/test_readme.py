"""The README's complete third-party package, extracted verbatim, installed with pip, and used."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTION = "### A complete third-party package"

USE = """
import json
from verl_fastsync import plugins
from verl_fastsync.cleanup import run_boundary
from verl_fastsync.config import FastsyncConfig
from verl_fastsync.selection import validate_names

class Device:
    calls = []
    def empty_cache(self): self.calls.append("empty_cache")
    def synchronize(self): self.calls.append("synchronize")

reg = plugins.registry()
config = FastsyncConfig(enable=True, pre_resume_cleanup="twice", post_transfer_cleanup="twice")
validate_names(config, reg)
entry = reg.cleanup["pre_resume_cleanup"]["twice"]
device = Device()
record = run_boundary("pre_resume_cleanup", "twice", entry.implementation, device, config)
print(json.dumps({"calls": device.calls, "plugin": entry.plugin, "distribution": entry.distribution,
                  "post": sorted(reg.cleanup["post_transfer_cleanup"]), "gc_ran": record.gc_ran}))
"""


def _block(text: str, after: str, lang: str) -> str:
    """The first fenced ``lang`` block after the line ``after``."""
    start = text.index(after)
    match = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no ```{lang} block after {after!r}"
    return match.group(1)


@pytest.mark.timeout(300)
def test_readme_third_party_package_works_verbatim(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(SECTION) :]
    package = tmp_path / "fastsync-twice"
    package.mkdir()
    (package / "pyproject.toml").write_text(_block(section, "`pyproject.toml`:", "toml"))
    (package / "fastsync_twice.py").write_text(_block(section, "`fastsync_twice.py`:", "python"))
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(package)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("VERL_FASTSYNC_DISABLED_PLUGINS", None)
    out = subprocess.run(
        [sys.executable, "-c", USE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["calls"] == ["empty_cache", "empty_cache"]
    assert result["plugin"] == "twice" and result["distribution"] == "fastsync-twice 0.1.0"
    assert "twice" in result["post"] and result["gc_ran"] is False
    # the README's way to switch it off for a run (every process: the environment)
    env["VERL_FASTSYNC_DISABLED_PLUGINS"] = "twice"
    out = subprocess.run(
        [sys.executable, "-c", USE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode != 0
    assert "pre_resume_cleanup='twice': cleanup policy blocked by disabled_plugins" in out.stderr
    assert "(provided by plugin 'twice', fastsync-twice 0.1.0)" in out.stderr
    assert "(blocked by disabled_plugins: twice)" in out.stderr
