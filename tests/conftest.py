"""Shared test fixtures: where the golden data lives, and the GPU marker.

The golden fixtures live in ../shared/fixtures beside the checkout (CI lays a
copy of shared/ there). Set Q27_SHARED to point elsewhere. Tests that need them
skip cleanly when they are absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _shared_dir() -> Path | None:
    env = os.environ.get("Q27_SHARED")
    candidates = [Path(env)] if env else []
    candidates += [REPO_ROOT.parent / "shared", REPO_ROOT / "shared"]
    for c in candidates:
        if (c / "fixtures").is_dir():
            return c
    return None


SHARED = _shared_dir()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if SHARED is None:
        pytest.skip("../shared (golden fixtures) not found; set Q27_SHARED")
    return SHARED


@pytest.fixture(scope="session")
def fixtures_dir(shared_dir) -> Path:
    return shared_dir / "fixtures"


def _gpu_available() -> bool:
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    # get_closest_marker, not `"gpu" in item.keywords`: keywords also hold the directory
    # name, which would skip the CPU tests that live in tests/gpu/ (kernel compilation).
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _gpu_available():
        skip = pytest.mark.skip(reason="no CUDA GPU / cupy")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def wg():
    """GPU tests of cuda/gemv_wg.cu's entries: skip on a card without its sm_90a build."""
    from q27py.gpu import kernels as K

    if not K.gemv_wgmma_supported():
        pytest.skip("no sm_90a gemv_wg build on this card")
