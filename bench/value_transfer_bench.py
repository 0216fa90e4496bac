"""Benchmark of the critic -> actor value hand-off (docs/design.md target: at most 1 % of a PPO step).

`--tokens` fp32 values (default 1 Mi) in samples of about `--mean-length` tokens,
spread evenly over `--ranks` critic ranks (Ray actors), reach `--ranks` actor ranks
(Ray actors) on `--device`:

- object store, `route_per_rank`: each critic rank packs (`pack_values`: one copy
  to CPU, one `ray.put`) and returns its `Box`; the driver routes; actor rank r
  unpacks (`unpack_values`: one `ray.get`, one copy to the device) and, on CUDA,
  synchronises. Timed from the driver: both rounds of Ray calls included.
- the same, pack and unpack time inside the workers only (slowest rank each).
- object store, `route_by_sample`: to actor ranks with another data-parallel
  split: contiguous to half as many ranks, and shuffled (every actor rank draws
  from every critic box, the worst case: each fetches all boxes it draws from).
- Ray calls alone: the same two rounds of calls carrying nothing, the part
  that the train calls of a PPO step pay anyway.
- gloo broadcast on CPU: the same bytes over a process group, critic rank r ->
  actor rank r in a two-rank group each, all pairs at once; timed inside the
  workers after a barrier (slowest rank). This needs a channel between the two
  models, which Tandem avoids; it is the yardstick.
- NCCL (CUDA only): with at least 2 GPUs, the same pairwise broadcast with the
  critic ranks on the first half of the GPUs and the actor ranks on the second
  half (`min(ranks, gpus // 2)` pairs). NCCL cannot put two ranks of one
  communicator on one GPU, and in Tandem actor rank r and critic rank r share
  their GPU, so on a one-GPU host this row is a device-to-device copy of all the
  bytes instead: the floor of any hand-off that stays on the GPU.

Every hand-off is checked (per-rank sums of the values); a wrong one fails the run.

Run (the figures below are from the 2-core development container, CPU only,
shared with other jobs: read them as orders of magnitude):

    ./uvw run python bench/value_transfer_bench.py --out value_transfer_cpu.json
    # GPU host (see shared/gpu/README.md):
    source .gpu-kit/setup.sh && python3 bench/value_transfer_bench.py --device cuda --out value_transfer_gpu.json

Results on the development container (2 CPU cores shared with other engineers'
jobs, load average 8-24 during the runs; no GPU; Python 3.12, torch 2.15, Ray 2.60):

    ./uvw run python bench/value_transfer_bench.py

1,048,576 fp32 values (4.0 MiB) in 1035 samples over 8 ranks, device cpu, median of 10

| path | median ms | min ms | GB/s | note |
|---|---:|---:|---:|---|
| object store, route_per_rank (pack → route → unpack) | 190.75 | 121.02 | 0.02 | driver wall time, both rounds of Ray calls |
| object store, in-worker pack + unpack | 83.28 | 64.24 | 0.05 | slowest pack + slowest unpack |
| object store, route_by_sample (contiguous, 8 → 4 DP ranks) | 204.77 | 155.31 | 0.02 | driver wall time |
| object store, route_by_sample (shuffled, 8 → 8 DP ranks) | 210.39 | 190.16 | 0.02 | driver wall time |
| Ray calls alone (two rounds, no values) | 44.10 | 36.55 | 0.10 | paid by the train calls anyway |
| gloo broadcast, CPU (8 pairs) | 15.49 | 12.05 | 0.27 | in-worker, slowest rank, after a barrier |

With 16 worker processes on 2 cores, every row above is mostly waiting for a
core. The same bytes over 2 ranks (4 workers), `--ranks 2`:

1,048,576 fp32 values (4.0 MiB) in 1031 samples over 2 ranks, device cpu, median of 10

| path | median ms | min ms | GB/s | note |
|---|---:|---:|---:|---|
| object store, route_per_rank (pack → route → unpack) | 69.56 | 62.99 | 0.06 | driver wall time, both rounds of Ray calls |
| object store, in-worker pack + unpack | 38.67 | 30.44 | 0.11 | slowest pack + slowest unpack |
| object store, route_by_sample (contiguous, 2 → 1 DP ranks) | 55.95 | 49.40 | 0.07 | driver wall time |
| object store, route_by_sample (shuffled, 2 → 2 DP ranks) | 58.39 | 45.47 | 0.07 | driver wall time |
| Ray calls alone (two rounds, no values) | 7.05 | 6.17 | 0.59 | paid by the train calls anyway |
| gloo broadcast, CPU (2 pairs) | 4.77 | 4.17 | 0.88 | in-worker, slowest rank, after a barrier |

Reading: a hand-off of 1 Mi values costs tens to a couple of hundred milliseconds
here, against a PPO step over 1 Mi tokens that takes minutes; gloo is faster per
byte but needs the channel between the models that colocation rules out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# Workers run this interpreter rather than being re-launched through `uv run`.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Workers ask Ray for no GPU and pick their device themselves: keep Ray from hiding the GPUs from them.
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

import ray
import torch
import torch.distributed as dist

from tandem.value_transfer import (
    pack_indexed_values,
    pack_values,
    route_by_sample,
    route_per_rank,
    unpack_values,
)


def sample_value(index: int) -> float:
    """The value every token of sample `index` carries: small integers, so sums are exact in fp64."""
    return float(index % 997)


def make_lengths(tokens: int, ranks: int, mean_length: int, seed: int) -> list[list[int]]:
    """Sample lengths per rank: about `mean_length` each (half to 1.5 times), `tokens // ranks` per rank."""
    rng = random.Random(seed)
    per_rank = tokens // ranks
    out = []
    for _ in range(ranks):
        lengths: list[int] = []
        while sum(lengths) < per_rank:
            lengths.append(
                min(
                    rng.randint(max(1, mean_length // 2), max(1, 3 * mean_length // 2)),
                    per_rank - sum(lengths),
                )
            )
        out.append(lengths)
    return out


@ray.remote(num_cpus=0)
class Worker:
    """One critic or actor rank. Asks Ray for no GPU: it picks its device itself (see `--device`)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.values: list[torch.Tensor] = []
        self.indices: list[int] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def hold(self, lengths: list[int], first_index: int) -> None:
        """Make this critic rank's values on its device (samples first_index, first_index + 1, ...)."""
        self.indices = list(range(first_index, first_index + len(lengths)))
        self.values = [
            torch.full((n,), sample_value(i), device=self.device)
            for i, n in zip(self.indices, lengths, strict=True)
        ]
        self._sync()

    def pack(self, indexed: bool) -> tuple[Any, float]:
        start = time.perf_counter()
        box = pack_indexed_values(self.values, self.indices) if indexed else pack_values(self.values)
        return box, time.perf_counter() - start

    def unpack(self, payload: Any) -> tuple[float, float]:
        """Unpack to this rank's device; returns (sum of the values, seconds)."""
        start = time.perf_counter()
        values = unpack_values(payload, self.device)
        self._sync()
        elapsed = time.perf_counter() - start
        # One device sync for the checksum: one per sample costs more than the hand-off on a
        # GPU that the 2 x ranks worker processes share.
        checksum = float(torch.cat(values).double().sum()) if values else 0.0
        return checksum, elapsed

    def noop(self, payload: Any = None) -> None:
        return None

    def init_collective(
        self, backend: str, address: str, world: int, rank: int, pairs: int, device: str
    ) -> None:
        """Join a world of `world` ranks and its two-rank groups [i, pairs + i]; use `device` for buffers."""
        self.coll_device = torch.device(device)
        kwargs: dict[str, Any] = {"device_id": self.coll_device} if backend == "nccl" else {}
        if backend == "nccl":
            torch.cuda.set_device(self.coll_device)
        dist.init_process_group(backend, init_method=address, world_size=world, rank=rank, **kwargs)
        groups = [dist.new_group([i, pairs + i]) for i in range(pairs)]
        self.pair_group = groups[rank % pairs]
        self.pair_src = rank % pairs

    def broadcast(self, numel: int, repeats: int, warmup: int) -> list[float]:
        buf = torch.ones(numel, device=self.coll_device)
        times = []
        for _ in range(warmup + repeats):
            dist.barrier(group=None)
            if self.coll_device.type == "cuda":
                torch.cuda.synchronize(self.coll_device)
            start = time.perf_counter()
            dist.broadcast(buf, src=self.pair_src, group=self.pair_group)
            if self.coll_device.type == "cuda":
                torch.cuda.synchronize(self.coll_device)
            times.append(time.perf_counter() - start)
        return times[warmup:]

    def close_collective(self) -> None:
        dist.destroy_process_group()

    def device_copy(self, numel: int, repeats: int, warmup: int) -> list[float]:
        src = torch.ones(numel, device=self.device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(warmup + repeats):
            self._sync()
            start = time.perf_counter()
            dst.copy_(src)
            self._sync()
            times.append(time.perf_counter() - start)
        return times[warmup:]


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def row(path: str, seconds: Sequence[float], nbytes: int, note: str = "") -> dict[str, Any]:
    median = statistics.median(seconds)
    return {
        "path": path,
        "median_ms": median * 1e3,
        "min_ms": min(seconds) * 1e3,
        "gb_per_s": nbytes / median / 1e9 if median > 0 else float("inf"),
        "repeats": len(seconds),
        "note": note,
    }


def timed(fn: Callable[[], None], repeats: int, warmup: int) -> list[float]:
    times = []
    for _ in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def check(sums: Sequence[float], expected: Sequence[float], what: str) -> None:
    if list(sums) != list(expected):
        raise RuntimeError(f"{what}: the actor ranks received sums {list(sums)}, expected {list(expected)}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    ranks, repeats, warmup = args.ranks, args.repeats, args.warmup
    lengths = make_lengths(args.tokens, ranks, args.mean_length, args.seed)
    firsts = [sum(len(ls) for ls in lengths[:r]) for r in range(ranks)]
    sample_lengths = [n for ls in lengths for n in ls]
    tokens = sum(sample_lengths)
    nbytes = tokens * 4
    expected = [
        sum(n * sample_value(firsts[r] + i) for i, n in enumerate(ls)) for r, ls in enumerate(lengths)
    ]

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    dev = (lambda r: f"cuda:{r % gpus}") if gpus else (lambda r: "cpu")
    critics = [Worker.remote(dev(r)) for r in range(ranks)]
    actors = [Worker.remote(dev(r)) for r in range(ranks)]  # actor rank r shares critic rank r's GPU
    ray.get([c.hold.remote(ls, f) for c, ls, f in zip(critics, lengths, firsts, strict=True)])
    ray.get([a.noop.remote() for a in actors])
    rows = []

    # Object store, identical topology.
    pack_t: list[float] = []
    unpack_t: list[float] = []

    def per_rank() -> None:
        packed = ray.get([c.pack.remote(False) for c in critics])
        payloads = route_per_rank([box for box, _ in packed], ranks)
        got = ray.get([a.unpack.remote(p) for a, p in zip(actors, payloads, strict=True)])
        check([s for s, _ in got], expected, "route_per_rank")
        pack_t.append(max(t for _, t in packed))
        unpack_t.append(max(t for _, t in got))

    rows.append(
        row(
            "object store, route_per_rank (pack → route → unpack)",
            timed(per_rank, repeats, warmup),
            nbytes,
            "driver wall time, both rounds of Ray calls",
        )
    )
    inside = [p + u for p, u in zip(pack_t[warmup:], unpack_t[warmup:], strict=True)]
    rows.append(row("object store, in-worker pack + unpack", inside, nbytes, "slowest pack + slowest unpack"))

    # Object store, other data-parallel splits.
    rng = random.Random(args.seed + 1)
    shuffled = list(range(len(sample_lengths)))
    rng.shuffle(shuffled)
    half = max(1, ranks // 2)
    cut = -(-len(sample_lengths) // half)
    splits = {
        f"contiguous, {ranks} → {half} DP ranks": [
            list(range(len(sample_lengths)))[i * cut : (i + 1) * cut] for i in range(half)
        ],
        f"shuffled, {ranks} → {ranks} DP ranks": [shuffled[r::ranks] for r in range(ranks)],
    }
    for name, split in splits.items():
        want = [sum(sample_lengths[i] * sample_value(i) for i in idx) for idx in split]

        def by_sample(split: list[list[int]] = split, want: list[float] = want, name: str = name) -> None:
            indexed = [v for v, _ in ray.get([c.pack.remote(True) for c in critics])]
            payloads = route_by_sample(indexed, split)
            got = ray.get([a.unpack.remote(p) for a, p in zip(actors, payloads, strict=False)])
            check([s for s, _ in got], want, name)

        rows.append(
            row(
                f"object store, route_by_sample ({name})",
                timed(by_sample, repeats, warmup),
                nbytes,
                "driver wall time",
            )
        )

    def calls_alone() -> None:
        ray.get([c.noop.remote() for c in critics])
        ray.get([a.noop.remote(None) for a in actors])

    rows.append(
        row(
            "Ray calls alone (two rounds, no values)",
            timed(calls_alone, repeats, warmup),
            nbytes,
            "paid by the train calls anyway",
        )
    )

    def collective(
        backend: str, pairs: int, critic_dev: Callable[[int], str], actor_dev: Callable[[int], str]
    ) -> list[float]:
        address = free_address()
        members = critics[:pairs] + actors[:pairs]
        devices = [critic_dev(i) for i in range(pairs)] + [actor_dev(i) for i in range(pairs)]
        ray.get(
            [
                w.init_collective.remote(backend, address, 2 * pairs, k, pairs, d)
                for k, (w, d) in enumerate(zip(members, devices, strict=True))
            ]
        )
        per_rank_times = ray.get([w.broadcast.remote(tokens // pairs, repeats, warmup) for w in members])
        ray.get([w.close_collective.remote() for w in members])
        return [max(ts) for ts in zip(*per_rank_times, strict=True)]

    rows.append(
        row(
            f"gloo broadcast, CPU ({ranks} pairs)",
            collective("gloo", ranks, lambda i: "cpu", lambda i: "cpu"),
            nbytes,
            "in-worker, slowest rank, after a barrier",
        )
    )
    if gpus >= 2:
        pairs = min(ranks, gpus // 2)
        nccl = collective("nccl", pairs, lambda i: f"cuda:{i}", lambda i: f"cuda:{gpus // 2 + i}")
        rows.append(
            row(
                f"NCCL broadcast ({pairs} pairs, GPU i → GPU {gpus // 2} + i)",
                nccl,
                nbytes,
                "in-worker, slowest rank",
            )
        )
    elif gpus == 1:
        copy = ray.get(critics[0].device_copy.remote(tokens, repeats, warmup))
        rows.append(
            row(
                "device-to-device copy, 1 GPU (stands in for NCCL)",
                copy,
                nbytes,
                "NCCL needs a GPU per rank; floor of an on-GPU hand-off",
            )
        )

    return {
        "config": {
            "tokens": tokens,
            "bytes": nbytes,
            "ranks": ranks,
            "samples": len(sample_lengths),
            "device": args.device,
            "gpus": gpus,
            "repeats": repeats,
            "warmup": warmup,
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
            "gpu": torch.cuda.get_device_name(0) if gpus else None,
        },
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"{c['tokens']:,} fp32 values ({c['bytes'] / 2**20:.1f} MiB) in {c['samples']} samples over {c['ranks']} ranks, device {c['device']}, median of {c['repeats']}",
        "",
        "| path | median ms | min ms | GB/s | note |",
        "|---|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['path']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['gb_per_s']:.2f} | {r['note']} |"
        for r in result["rows"]
    ]
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1 << 20, help="fp32 values in all (default 1 Mi)")
    p.add_argument("--ranks", type=int, default=8, help="critic ranks and actor ranks (each)")
    p.add_argument("--mean-length", type=int, default=1024, help="mean response length in tokens")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=None, help="for ray.init (default: all)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.tokens < args.ranks:
        p.error(f"--tokens ({args.tokens}) must be at least --ranks ({args.ranks})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        result = run(args)
    finally:
        ray.shutdown()
    print(markdown(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
