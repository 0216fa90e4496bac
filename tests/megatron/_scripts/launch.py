"""Run a Megatron test script in N fresh processes that rendezvous on a free local port.

Usage: python launch.py NPROC SCRIPT [ARGS...]
Each process gets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` in its
environment (the script passes them to `tandem.megatron.worker.parallel.init_distributed`,
or calls `init_from_env` here),
and `LAUNCH_PORTS`: more free ports, comma-separated, for scripts that
re-initialise torch.distributed several times (one port per initialisation).
Exits non-zero if any process does; a process that hangs is killed after
`LAUNCH_TIMEOUT_S` seconds (default 600).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def init_from_env(**parallel: int) -> int:
    """`init_distributed` from the variables this launcher sets (`parallel`: its sizes); the rank."""
    from tandem.megatron.worker.parallel import init_distributed

    rank = int(os.environ["RANK"])
    world, addr, port = (
        int(os.environ["WORLD_SIZE"]),
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
    )
    init_distributed(rank, world, addr, port, **parallel)
    return rank


def main() -> int:
    nproc, script, *args = sys.argv[1:]
    port, *more = _free_ports(6)
    procs = []
    for rank in range(int(nproc)):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=nproc,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LAUNCH_PORTS=",".join(map(str, more)),
            OMP_NUM_THREADS="1",
        )
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env))
    deadline = time.monotonic() + float(os.environ.get("LAUNCH_TIMEOUT_S", "600"))
    codes: list[int | None] = [None] * len(procs)
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            codes[i] = p.poll()
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            # One rank failed or all hang: the others would wait forever on a collective.
            time.sleep(2)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            codes = [p.wait() for p in procs]
            break
        time.sleep(0.2)
    bad = [(rank, c) for rank, c in enumerate(codes) if c != 0]
    if bad:
        print(f"launch.py: ranks failed (rank, exit code): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
