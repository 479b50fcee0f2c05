"""The README's facts: short, the two commands first, every link resolving (file and heading), every
figure linking to how it was measured, every key of its set-up table a real key; and the guide's
complete third-party package (``examples/fastsync-twice``, shown verbatim in ``docs/hooks.md``),
installed with pip and used."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PACKAGE = ROOT / "examples" / "fastsync-twice"

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


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST both make it for this project's plain headings."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = README.splitlines()
    assert len(lines) <= 200, len(lines)
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block == [
        "bash scripts/setup.sh && .venv/bin/verl-fastsync bench",
        "bash scripts/setup.sh && bash scripts/test.sh",
    ]
    assert README.index("```bash") < README.index("\n## ")  # before any section


def test_every_readme_link_resolves_to_a_file_and_heading() -> None:
    links = re.findall(r"\]\(([^)]+)\)", README)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) > 20, local
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            assert anchor in _anchors(target), (link, sorted(_anchors(target)))


def test_every_figure_in_the_readme_links_to_how_it_was_measured() -> None:
    """A measured number (seconds, ratios, per-cent, bytes per sync) sits in a bullet that links to the
    benchmarks page, where its table says how it was measured."""
    why = README.split("## Why", 1)[1].split("\n## ", 1)[0]
    bullets = ["".join(b) for b in re.findall(r"^- (.+(?:\n  .+)*)", why, re.M)]
    figure = re.compile(r"\d+(\.\d+)?(-\d+)? ?(s|ms|x|%)\b|\d+\.\d+ ")
    measured = [b for b in bullets if figure.search(b)]
    assert len(measured) >= 3, bullets
    for bullet in measured:
        assert "docs/benchmarks.md#" in bullet, bullet
    rest = README.replace(why, "")
    rest = re.sub(r"```.*?```", "", rest, flags=re.S)
    stray = [line for line in rest.splitlines() if re.search(r"\d(\.\d+)? ?(ms|GB/s)\b|\d+(\.\d+)?x\b", line)]
    assert stray == [], "figures outside 'Why' need their measurement link: " + repr(stray)


def test_the_setup_table_names_real_keys() -> None:
    from verl_fastsync.config import ENGINE_KEYS, FastsyncConfig

    table = README.split("## Which keys for my set-up", 1)[1].split("\n## ", 1)[0]
    engine = set(re.findall(r"`E\.(\w+)=", table))
    custom = set(re.findall(r"`C\.(\w+)=", table))
    assert engine == {"transport", "delta", "senders"}, engine
    assert engine <= set(ENGINE_KEYS)
    assert custom and custom <= {f.name for f in FastsyncConfig.__dataclass_fields__.values()}, custom
    transports = set(re.findall(r"`E\.transport=(\w+)`", table))
    assert transports == {"shm", "gloo", "nixl", "nccl"}


def test_the_hooks_page_shows_the_example_package_verbatim() -> None:
    page = (ROOT / "docs" / "hooks.md").read_text()
    for name in ("pyproject.toml", "fastsync_twice.py"):
        assert f"```{{literalinclude}} ../examples/fastsync-twice/{name}" in page, name


@pytest.mark.timeout(300)
def test_the_third_party_package_works(tmp_path: Path) -> None:
    package = tmp_path / "fastsync-twice"
    package.mkdir()
    for name in ("pyproject.toml", "fastsync_twice.py"):
        (package / name).write_text((PACKAGE / name).read_text())
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
