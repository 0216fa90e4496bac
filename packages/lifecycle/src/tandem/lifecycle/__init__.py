"""tandem.lifecycle (skeleton; filled by its own issue)."""

from importlib.metadata import version as _version

__version__ = _version("tandem-lifecycle")

__all__ = ["__version__"]
