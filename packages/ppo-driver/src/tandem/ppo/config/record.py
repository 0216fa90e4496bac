"""A run's own `RUN_DIR/config.yaml`: the resolved config, with the run's paths relative to its folder.

A run folder can be moved or copied and still be read (`ppo-driver eval`,
`export`, `train --config RUN_DIR/config.yaml` to resume): every path field that
lies inside the run folder is written relative to it as `./x` (`run_dir` as `.`),
other paths that exist are written absolute, and anything else (a hub name) as given. The file's first line says so
(`RUN_CONFIG_MARKER`); `read_yaml` resolves the relative paths of a file that
carries it against the file's own folder. A YAML file without that line (one a
user wrote) keeps the ordinary rule: relative paths are relative to the working
directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "PATH_FIELDS",
    "RUN_CONFIG_FILE",
    "RUN_CONFIG_MARKER",
    "resolve_run_paths",
    "run_config_text",
    "write_run_config",
]

RUN_CONFIG_FILE = "config.yaml"
RUN_CONFIG_MARKER = "# ppo-driver run config: relative paths are relative to this file's folder"
"""The first line of a run's config.yaml."""

PATH_FIELDS = (
    "run_dir",
    "hf_checkpoint",
    "critic_hf_checkpoint",
    "ref_load",
    "load",
    "save",
    "critic_load",
    "critic_save",
    "prompt_data",
    "eval_prompt_data",
    "wandb_dir",
)
"""Config fields that hold a file or folder path (`custom_rm_path` too, for its file part)."""


def _file_part(spec: str) -> tuple[str, str] | None:
    """(path, ':function') of a `/path/file.py:function` reward spec; None for `module:function`."""
    target, sep, function = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target or "\\" in target):
        return target, sep + function
    return None


def _relative(value: str, folder: Path) -> str:
    """`./x` for a path inside `folder`, an absolute path for another one that exists, else `value`."""
    path = Path(value).expanduser()
    absolute = Path(os.path.abspath(path))
    try:
        inside = absolute.relative_to(folder).as_posix()
    except ValueError:
        return str(absolute) if absolute.exists() else value  # not a path here (a hub name): as given
    return "." if inside in ("", ".") else f"./{inside}"


def _resolved(value: str, folder: Path) -> str:
    """A `./x` (or `.`) value of a run's config.yaml as a path again; any other value as it is."""
    if value == "." or value.startswith("./"):
        return os.path.normpath(folder / value)
    return value


def _paths_map(values: Mapping[str, Any], convert: Any) -> dict[str, Any]:
    out = dict(values)
    for name in PATH_FIELDS:
        if isinstance(out.get(name), str) and out[name]:
            out[name] = convert(out[name])
    spec = out.get("custom_rm_path")
    if isinstance(spec, str) and (parts := _file_part(spec)) is not None:
        out["custom_rm_path"] = convert(parts[0]) + parts[1]
    return out


def run_config_text(config: Any) -> str:
    """What `RUN_DIR/config.yaml` holds for `config`: the marker line, then every field as YAML."""
    import yaml

    folder = Path(os.path.abspath(config.run_dir))
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
    values = _paths_map(values, lambda v: _relative(v, folder))
    return RUN_CONFIG_MARKER + "\n" + yaml.safe_dump(values, sort_keys=False)


def write_run_config(config: Any) -> Path:
    """Write `RUN_DIR/config.yaml` atomically; its path."""
    path = Path(config.run_dir) / RUN_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(run_config_text(config))
    os.replace(tmp, path)
    return path


def resolve_run_paths(values: Mapping[str, Any], folder: str | os.PathLike[str]) -> dict[str, Any]:
    """`values` of a run's config.yaml with its relative paths made relative to the working directory again."""
    base = Path(os.path.abspath(folder))
    return _paths_map(values, lambda v: _resolved(v, base))
