"""tandem.megatron (skeleton; filled by its own issue)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("tandem-megatron-backend")
except PackageNotFoundError:  # source tree on PYTHONPATH (the offline GPU host), not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
