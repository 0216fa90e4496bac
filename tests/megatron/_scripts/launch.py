"""Run a Megatron test script in N fresh processes that rendezvous on a free local port.

Usage: python launch.py NPROC SCRIPT [ARGS...]
Each process gets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` in its
environment (the script passes them to `tandem.megatron.worker.parallel.init_distributed`,
or calls `init_from_env` here),
and `LAUNCH_PORTS`: more free ports, comma-separated, for scripts that
re-initialise torch.distributed several times (one port per initialisation).
Exits non-zero if any process does; a process that hangs is killed after
`LAUNCH_TIMEOUT_S` seconds (default 600). A port is free when chosen and bound by rank 0
later, and another process on the machine (a Ray worker of the session's cluster) can take
it between the two: a launch whose ranks failed with the address in use is run again on new
ports, up to `ATTEMPTS` times. Each rank's stderr is written out once its launch ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ATTEMPTS = 3
ADDRESS_IN_USE = "EADDRINUSE"


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


def launch(nproc: int, script: str, args: list[str], logs: Path) -> list[int]:
    """The ranks' exit codes; each rank's stderr in `logs`/rank<r>.err."""
    port, *more = _free_ports(6)
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LAUNCH_PORTS=",".join(map(str, more)),
            OMP_NUM_THREADS="1",
        )
        with (logs / f"rank{rank}.err").open("wb") as err:
            procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stderr=err))
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
            return [p.wait() for p in procs]
        time.sleep(0.2)
    return [int(c) for c in codes if c is not None]


def main() -> int:
    nproc, script, *args = sys.argv[1:]
    for attempt in range(1, ATTEMPTS + 1):
        with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
            codes = launch(int(nproc), script, args, Path(tmp))
            errors = "".join(
                (Path(tmp) / f"rank{r}.err").read_text(errors="replace") for r in range(int(nproc))
            )
        sys.stderr.write(errors)
        bad = [(rank, c) for rank, c in enumerate(codes) if c != 0]
        if not bad:
            return 0
        if ADDRESS_IN_USE in errors and attempt < ATTEMPTS:
            print(
                f"launch.py: a rendezvous port was taken between its choice and its use ({bad}); "
                f"launching again on new ports ({attempt + 1} of {ATTEMPTS})",
                file=sys.stderr,
            )
            continue
        print(f"launch.py: ranks failed (rank, exit code): {bad}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
