"""Weight chunks to an engine on another GPU go through Ray as CPU tensors: plain pickling against `zero_copy`.

`update_weights` sends an engine that does not share the actor's GPU (`--no-colocate`,
or the other GPU of `two_gpu_bench`'s `split` run) CPU copies of its HF tensors, one
`send_chunk` (one Ray call, waited for) per chunk. This times that call alone, the
CPU copies made already, for `--mib` MiB of bf16 tensors of 16 MiB each in chunks of
`--chunk-mib`: the tensors pickled as they are (their bytes copied into the pickle
and out again) against `host_tensors.zero_copy` (numpy views that Ray's object store
passes out of band), median of `--repeats`. The receiver checks every tensor's dtype
and its first and last 64 values, so a wrong path fails the run.

    ./uvw run python bench/host_tensor_bench.py --out /tmp/host_tensors.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

from tandem.megatron.models.host_tensors import zero_copy


@ray.remote
class Receiver:
    """Stands in for an engine: checks each tensor's dtype, size and ends (a full sum would outweigh the transfer)."""

    def __init__(self, ends: dict[str, torch.Tensor]) -> None:
        self.ends = ends

    def update_weights_from_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int:
        for name, tensor in named:
            ends = torch.cat([tensor[:64], tensor[-64:]])
            if tensor.dtype != torch.bfloat16 or not torch.equal(ends, self.ends[name]):
                raise AssertionError(f"{name} arrived wrong")
        return len(named)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="MiB of bf16 tensors in all")
    p.add_argument("--chunk-mib", type=int, default=512, help="MiB a chunk (update_weights_chunk_bytes)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for attempt in range(3):  # a busy machine's node can time out starting: try again
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            ray.shutdown()
    per_tensor = 8 * 1024 * 1024  # 16 MiB of bf16
    named = [(f"w{i}", torch.randn(per_tensor).to(torch.bfloat16)) for i in range(args.mib // 16)]
    per_chunk = max(1, args.chunk_mib // 16)
    chunks = [named[i : i + per_chunk] for i in range(0, len(named), per_chunk)]
    receiver = Receiver.remote({n: torch.cat([t[:64], t[-64:]]) for n, t in named})  # type: ignore[attr-defined]
    ways: dict[str, Any] = {"pickled tensors": lambda t: t, "zero_copy": zero_copy}
    result: dict[str, Any] = {
        "mib": args.mib,
        "chunk_mib": args.chunk_mib,
        "repeats": args.repeats,
        "rows": {},
    }
    for name, wrap in ways.items():
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            for chunk in chunks:
                ray.get(receiver.update_weights_from_tensors.remote([(n, wrap(t)) for n, t in chunk]))
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times[1:])  # the first pays the object store's first allocation
        result["rows"][name] = {
            "seconds": seconds,
            "gb_per_s": args.mib * 2**20 / seconds / 1e9,
            "all": times,
        }
    ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{args.mib} MiB of bf16 in chunks of {args.chunk_mib} MiB, median of {args.repeats}\n")
    print("| path | s | GB/s |\n|---|---:|---:|")
    for name, row in result["rows"].items():
        print(f"| {name} | {row['seconds']:.3f} | {row['gb_per_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
