"""Save rollouts of a run as the driver does, with model checkpoints through Megatron's save protocol.

Usage: python run_save.py RUN_DIR FIRST LAST
Saves rollouts FIRST..LAST (inclusive) with `save_run_checkpoint`: the driver's
state (data cursor `{"epoch": 0, "cursor": 3 * (k + 1)}`), then the critic's and
the actor's checkpoints through `tandem.megatron.worker.checkpoint.save_folder` (the
real staging, publishing and marker steps, one rank), whose `write` puts a shard
file naming the role and rollout and then `metadata.json`. `TANDEM_FAULT_POINT`
kills the process at the named point, as in a real run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tandem.megatron.runtime.checkpoint_folder import save_folder
from tandem.megatron.runtime.fault_points import set_context
from tandem.ppo.run.checkpoint import save_run_checkpoint
from tandem.ppo.run.state import DriverState


def cursor(rollout_id: int) -> dict[str, int]:
    return {"epoch": 0, "cursor": 3 * (rollout_id + 1)}


def model_save(run_dir: Path, role: str, rollout_id: int) -> None:
    def write(staging: Path) -> None:
        (staging / "shard_0.distcp").write_text(f"{role} {rollout_id}\n")
        (staging / "metadata.json").write_text("{}\n")

    set_context(role=role)
    save_folder(run_dir / role, rollout_id, write)


def main() -> None:
    run_dir, first, last = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for k in range(first, last + 1):
        state = DriverState(k, cursor(k), metrics=[{"step": i} for i in range(k + 1)])
        save_run_checkpoint(
            run_dir,
            state,
            [(role, lambda role=role, k=k: model_save(run_dir, role, k)) for role in ("critic", "actor")],
        )


if __name__ == "__main__":
    main()
