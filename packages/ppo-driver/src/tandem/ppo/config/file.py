"""A run's config as a file and as flags: YAML in and out, `--config FILE` merged under the other flags.

`parse_config` is what `ppo-driver train` (and `demo`) call: the YAML file gives
defaults, the flags (tyro, from `PPOConfig`'s fields and docstrings) override
them, and the merged config is validated before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tyro

from tandem.ppo.config.estimator_plan import critic_flag_given, imply_critic
from tandem.ppo.config.field_values import coerce_fields
from tandem.ppo.config.fields import FLAG_NAMES
from tandem.ppo.config.flag_help import help_text, wants_help
from tandem.ppo.config.hub import resolve_checkpoints
from tandem.ppo.config.ppo_config import PPOConfig
from tandem.ppo.config.record import RUN_CONFIG_FILE, RUN_CONFIG_MARKER, resolve_run_paths

__all__ = ["config_fields", "parse_config", "read_run_config", "read_yaml", "unvalidated", "write_yaml"]


def config_fields() -> dict[str, dataclasses.Field[Any]]:
    """The config's fields by name."""
    return {f.name: f for f in dataclasses.fields(PPOConfig)}


def unvalidated(values: Mapping[str, Any]) -> PPOConfig:
    """A config from field values (defaults for the rest), not yet validated; unknown keys refused.

    Without a `use_critic` value, the run has a critic exactly when its advantage estimator needs one.
    """
    known = config_fields()
    unknown = sorted(set(values) - set(known))
    if unknown:
        names = ", ".join(unknown)
        raise ValueError(f"config: unknown field(s) {names}; see `ppo-driver train --help` for the fields")
    coerced: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return imply_critic(PPOConfig(**coerced), given=critic_flag_given(values))


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields of a YAML config file (keys may use `-` or `_`)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config: file {str(path)!r} does not exist; fix the path")
    try:
        text = p.read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--config: {str(path)!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise ValueError(f"--config: {str(path)!r} is not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {str(path)!r} must hold a mapping of field: value")
    fields = {FLAG_NAMES.get(f, f): f for f in config_fields()}

    def field_of(key: Any) -> str:
        name = str(key).replace("-", "_")
        return fields.get(name, name)

    lines = {field_of(k.value): k.start_mark.line + 1 for k, _ in getattr(yaml.compose(text), "value", ())}
    values = coerce_fields({field_of(k): v for k, v in data.items()}, source=f"--config {path}", lines=lines)

    if text.startswith(RUN_CONFIG_MARKER):  # a run's config.yaml: its paths are relative to it
        values = resolve_run_paths(values, p.parent)
    return values


def write_yaml(config: PPOConfig, path: str | os.PathLike[str]) -> None:
    """Write the resolved config (every field) as YAML, atomically."""
    import yaml

    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(values, sort_keys=False))
    os.replace(tmp, p)


def parse_config(
    argv: Sequence[str],
    *,
    prog: str = "ppo-driver train",
    base: Mapping[str, Any] | None = None,
    validate: bool = True,
) -> PPOConfig:
    """`--config FILE` (YAML) merged under the other flags of `argv`; validated unless told not to.

    `base` gives defaults below the YAML file (the demo's own settings).
    """
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    values: dict[str, Any] = dict(base or {})
    if known.config is not None:
        values.update(read_yaml(known.config))
    default = unvalidated(values)

    if wants_help(rest):  # our own help: grouped, with examples, --config among the flags
        print(help_text(prog.split()[-1], default), end="")
        raise SystemExit(0)
    config: PPOConfig = tyro.cli(
        PPOConfig,
        args=rest,
        default=default,
        prog=prog,
        description=(
            "Train a model with PPO. --config FILE reads any of these fields from YAML "
            "(keys as below without the dashes' prefix); flags given here override it."
        ),
    )
    # Hub ids (`org/name`) become local snapshot folders before any check reads the folders.
    config = resolve_checkpoints(config)
    config = imply_critic(config, given=critic_flag_given(values, rest))
    if validate:
        config.validate()
    return config


def read_run_config(run_dir: str | os.PathLike[str], *, flag: str = "RUN_DIR") -> PPOConfig:
    """The (unvalidated) config of the run in `run_dir`; ValueError naming `flag` when it has none."""

    path = Path(run_dir) / RUN_CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"{flag}: {str(run_dir)!r} has no {RUN_CONFIG_FILE}; pass the folder of a run "
            "(`ppo-driver train` or `demo` writes RUN_DIR/config.yaml)"
        )
    values = read_yaml(path)
    values["run_dir"] = str(run_dir)  # where the run is now, wherever it was written
    return unvalidated(values)
