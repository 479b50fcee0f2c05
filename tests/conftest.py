"""Test configuration shared by the whole suite.

``VERL_FASTSYNC_VERL_PATH`` points at a ``pip install --target`` directory holding an older verl
release (0.7.1, 0.8.0, 0.9.0); it is put first on ``sys.path`` (and ``PYTHONPATH`` for child
processes) before anything imports verl, so the suite runs against that release. Unset: the verl
installed in the venv (0.9.1). ``scripts/test.sh`` runs the suite once per release.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from typing import Any

# Helper modules of this suite (``_verl_fakes`` etc.) import as top-level modules; the directory
# itself is not a package, so it cannot collide with the ``tests`` package verl's wheels install.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_VERL_PATH = os.environ.get("VERL_FASTSYNC_VERL_PATH")
if _VERL_PATH:
    sys.path.insert(0, _VERL_PATH)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_VERL_PATH, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the full-length soak tests")


def pytest_report_header(config: pytest.Config) -> str:
    try:
        import verl

        return f"verl {verl.__version__} from {os.path.dirname(verl.__file__)}"
    except Exception as exc:  # pragma: no cover - informational only
        return f"verl not importable: {exc!r}"


def release_tuple(version: str) -> tuple[int, int, int]:
    """``"0.9.1"``, ``"0.10.0.dev"``, ``"0.9.0rc1"``, ``"0.8.0.post1"`` -> the numeric release, for
    ordering only: never rebuild a version string from it (compare ``verl.__version__`` itself)."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


@pytest.fixture(scope="session")
def verl_version() -> tuple[int, int, int]:
    """The release of verl under test, as a tuple (for ordering; see :func:`release_tuple`)."""
    import verl

    return release_tuple(verl.__version__)


@pytest.fixture(scope="session")
def verl_version_string() -> str:
    """``verl.__version__`` exactly as the release spells it (e.g. ``0.10.0.dev``)."""
    import verl

    return str(verl.__version__)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray instance for one test module (2 CPUs, no dashboard)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
