"""Tandem's PPO driver: the `ppo-driver` command (for now its `demo` job)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .cli import main

try:
    __version__ = _version("tandem-ppo-driver")
except PackageNotFoundError:  # source tree on PYTHONPATH (an offline GPU host), not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "main"]
