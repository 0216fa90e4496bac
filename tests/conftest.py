"""Shared fixtures and the `gpu` marker policy for every package's tests."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Set before any test starts Ray: no usage reporting, and workers run this same
# interpreter instead of Ray re-launching them through `uv run`.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests cleanly where there is no CUDA device."""
    if any(item.get_closest_marker("gpu") for item in items) and _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker `gpu`)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
