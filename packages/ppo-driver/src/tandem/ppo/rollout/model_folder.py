"""The error for a model folder that does not exist ("folder missing"), said alike for every flag that
names one: the config's checks, the hub's resolution (`config.hub`) and the run's preflight.

The standard library only: the config layer reads it without loading torch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["missing_folder"]


def missing_folder(name: str, flag: str, *, hub: tuple[str, str] | None = None) -> ValueError:
    """The error for a model folder `name` that does not exist: "folder missing", where it was looked for,
    and the ways on; `hub`: (what the hub said of `name` as an id, what to do about it), for an id-like name."""
    where = Path(name).expanduser().absolute()
    last = Path(name).name or name
    download = f"download the model there (`hf download ORG/{last} --local-dir {name}`)"
    if hub is None:
        return ValueError(
            f"{flag}: folder {name!r} is missing (no {where}); {download}, or give its hub id instead "
            f"({flag} ORG/{last}, with the organisation that publishes it; downloaded once into the Hugging "
            "Face cache)"
        )
    problem, fix = hub
    return ValueError(
        f"{flag}: folder {name!r} is missing (no {where}), and as a hub id {problem}; if it is a folder, "
        f"{download}; if a hub id, {fix}"
    )
