"""What a sleep pays to tear Megatron's process groups down, and a wake to build them again.

Every rank joins Megatron's parallel state (`init_distributed` inside
`reloadable_groups()`, as `TrainWorker.init` does), then runs one all-reduce on
every group it is a member of, so that each NCCL communicator exists (NCCL builds
them lazily, on the first collective, and a model's first step uses them all).
Then, `--cycles` times each, in one run:

1. `destroy_all(concurrent=False, keep_single_rank=False)`: one group after the other;
2. `destroy_all(keep_single_rank=False)`: the communicators shut down on one thread
   each, then unregistered in order;
3. `destroy_all(keep_single_rank=True)`: the same, with the groups of one rank left alive;

each followed by `reload_all()` and the all-reduces again (the wake's share, and
the first collectives that build the communicators). The groups of one rank get
communicators here (`reloadable_groups(local_single_rank=False)`), so that the rows
compare ways of tearing them down; a worker's default (`local_single_rank_groups`)
answers their collectives in the process and has none to tear down. Times are the slowest rank's,
median over cycles; the all-reduces' results are checked after every reload.

On CUDA there is one rank per GPU (NCCL); on CPU two ranks under gloo.

GPU host, from the repo root:

    source .gpu-kit/setup.sh && python3 bench/process_group_bench.py --out "$OUT/process_groups.json"

CPU smoke run (gloo, 2 ranks):

    ./uvw run python bench/process_group_bench.py --out /tmp/process_groups.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _touch_all(groups: tuple[Any, ...], device: str, expect: float) -> None:
    """One all-reduce on every group (builds its communicator); checks the sums."""
    import torch.distributed as dist

    for group in groups:
        t = torch.ones(1024, device=device)
        dist.all_reduce(t, group=group)
        if float(t[0]) != group.size() * expect:
            raise AssertionError(f"all_reduce on {group!r} gave {float(t[0])}, expected {group.size()}")
    if device != "cpu":
        torch.cuda.synchronize()


def _rank_main(rank: int, world: int, port: int, tp: int, pp: int, cycles: int, out: str) -> None:
    import torch.distributed as dist

    from tandem.lifecycle import destroy_all, reload_all, reloadable_groups, reloadable_process_groups
    from tandem.megatron.worker.parallel import destroy_distributed, init_distributed

    on_gpu = torch.cuda.is_available()
    device = f"cuda:{rank}" if on_gpu else "cpu"
    with reloadable_groups(local_single_rank=False):
        init_distributed(
            rank,
            world,
            "127.0.0.1",
            port,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            local_rank=rank,
        )
    groups = reloadable_process_groups()
    _touch_all(groups, device, 1.0)
    world_group = dist.new_group(list(range(world)), backend="gloo")  # for the timing barriers only

    def timed(fn: Any) -> float:
        dist.barrier(group=world_group)
        t0 = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=world_group)
        return float(seconds)

    rows: dict[str, dict[str, list[float]]] = {}
    variants = (
        ("one after the other", False, False),
        ("concurrent", True, False),
        ("concurrent, one-rank groups kept", True, True),
    )
    for name, concurrent, keep in variants:
        row = rows.setdefault(name, {"destroy_s": [], "reload_s": [], "first_collectives_s": []})
        for _ in range(cycles):
            row["destroy_s"].append(
                timed(lambda c=concurrent, k=keep: destroy_all(concurrent=c, keep_single_rank=k))
            )
            row["reload_s"].append(timed(reload_all))
            row["first_collectives_s"].append(timed(lambda: _touch_all(groups, device, 1.0)))
    if rank == 0:
        result = {
            "world_size": world,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "backend": "nccl" if on_gpu else "gloo",
            "groups_per_rank": len(groups),
            "one_rank_groups_per_rank": sum(g.size() == 1 for g in groups),
            "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
            "torch": torch.__version__,
            "cycles": cycles,
            "rows": {
                name: {key: statistics.median(v) for key, v in row.items()} | {"all": row}
                for name, row in rows.items()
            },
        }
        Path(out).write_text(json.dumps(result, indent=2))
    destroy_distributed()


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['groups_per_rank']} reloadable groups per rank ({result['one_rank_groups_per_rank']} of one rank), world {result['world_size']} "
        f"(TP {result['tensor_parallel_size']}, PP {result['pipeline_parallel_size']}), "
        f"{result['backend']}, {result['gpu'] or 'CPU'}, median of {result['cycles']}\n"
    )
    print("| teardown | destroy s | reload s | first collectives s |")
    print("|---|---:|---:|---:|")
    for name, row in result["rows"].items():
        print(
            f"| {name} | {row['destroy_s']:.3f} | {row['reload_s']:.3f} | {row['first_collectives_s']:.3f} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: the GPUs, or 2 on CPU)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    world = args.world_size or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    tp = args.tp or max(1, world // args.pp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(world, _free_port(), tp, args.pp, args.cycles, str(args.out)), nprocs=world)
    print_table(json.loads(args.out.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
