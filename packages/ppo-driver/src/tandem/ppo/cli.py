"""Console script `ppo-driver`: one subcommand per job, options from typed dataclasses (tyro)."""

from __future__ import annotations

import tyro

from ._demo import DemoArgs, run_demo


def _demo(args: DemoArgs) -> None:
    """Show how actor, critic and rollout engine share GPUs (local Ray, logical GPUs, CPU only)."""
    run_demo(args)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `ppo-driver`."""
    tyro.extras.subcommand_cli_from_dict({"demo": _demo}, args=argv, prog="ppo-driver")
