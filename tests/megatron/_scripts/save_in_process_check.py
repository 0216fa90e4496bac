"""Save a model twice on this rank and record what the saves started: no process, Megatron's results queue in this one.

Usage (through launch.py): python launch.py 1 save_in_process_check.py HF_DIR SAVE_DIR OUT.json
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
from pathlib import Path

from tandem.megatron.config import WorkerConfig
from tandem.megatron.worker import TrainWorker


def children() -> dict[int, str]:
    """This process's child processes (Linux: /proc), by pid, with their command lines."""
    pids = {int(p) for t in Path("/proc/self/task").iterdir() for p in (t / "children").read_text().split()}
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def main() -> None:
    hf_dir, save_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    config = WorkerConfig(
        hf_checkpoint=str(hf_dir),
        rollout_batch_size=4,
        global_batch_size=4,
        device="cpu",
        params_dtype="float32",
        save=str(save_dir),
    )
    worker = TrainWorker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    worker.init(config, "actor", os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    before = children()
    for rollout_id in (0, 1):
        worker.save_model(rollout_id)
    started = [cmd for pid, cmd in children().items() if pid not in before]
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = {
        "started": started,
        "queue": type(filesystem_async._results_queue).__module__
        + "."
        + type(filesystem_async._results_queue).__qualname__,
        "in_process": isinstance(filesystem_async._results_queue, queue.Queue),
        "complete": sorted(p.name for p in save_dir.iterdir()),
    }
    out.write_text(json.dumps(results))
    worker.shutdown()


if __name__ == "__main__":
    main()
