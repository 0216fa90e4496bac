"""Reload an NCCL process group on one GPU (world size 1): collectives before, after and across cycles.

Run by test_gpu.py in a fresh process; prints `RESULT {json}` with the device memory
held before the communicator existed, with it, and after `destroy_all()`; and, for a
local one-rank group (the default), what its collectives left on the device.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from tandem.lifecycle import ProcessGroupTornDownError, destroy_all, reload_all, reloadable_groups

GIB = 2**30


def used() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    with reloadable_groups():
        local: Any = dist.new_group(ranks=[0], backend=None, group_desc="DATA_PARALLEL_GROUP")
    with reloadable_groups(local_single_rank=False):
        group: Any = dist.new_group(ranks=[0], backend=None, group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    x = torch.ones(1 << 20, device="cuda")
    before = used()
    # The local group: collectives in the process, no communicator, nothing to tear down.
    gathered = torch.zeros(1 << 20, device="cuda")
    for _ in range(3):
        dist.all_reduce(x, group=local)
        dist.all_gather_into_tensor(gathered, x, group=local)
        dist.barrier(group=local)
    local_ok = bool((x == 1).all() and (gathered == 1).all())
    local_gib = used()
    destroy_all()
    local_alive = bool(local.alive)
    reload_all()
    cycles = []
    for _ in range(4):
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        with_comm = used()
        destroy_all()
        torch.cuda.synchronize()
        torn_down = used()
        try:
            dist.all_reduce(x, group=group)
            refused = False
        except ProcessGroupTornDownError:
            refused = True
        reload_all()
        cycles.append({"with_comm_gib": with_comm, "torn_down_gib": torn_down, "refused": refused})
    dist.all_reduce(x, group=group)
    ok = bool((x == 1).all())  # a one-rank sum leaves the values as they were
    dist.destroy_process_group()
    result = {
        "before_gib": before,
        "cycles": cycles,
        "values_ok": ok,
        "local_gib": local_gib,
        "local_ok": local_ok,
        "local_alive_after_destroy_all": local_alive,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
