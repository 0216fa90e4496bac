"""A rank's `RolloutBatch` through Ray: each per-sample field as one tensor against a tensor per sample.

The driver `ray.put`s each data-parallel rank's batch at the rollout's end and each train worker
`ray.get`s it at the start of its `train` (`batch.resolve_batch`), both inside the step. Torch pickles
every tensor on its own, so a batch of per-sample tensors costs its pickling and loading per sample;
`RolloutBatch.__getstate__` sends each per-sample field (tokens, loss masks, the sampler's log-probs) as
one tensor and its lengths. This times, for the PPO bench's shapes (`--shapes`, samples x prompt +
response tokens, the sampler's log-probs included), the driver's `pickle.dumps` and a Ray task's
`ray.get` of the `ray.put` object, median of `--repeats`, both ways in one run: `flat` (the batch as it
pickles) and `per_sample` (its fields' lists pickled as they are, what a batch cost before). A task
checks the tokens it got, so a wrong path fails the run.

    ./uvw run python bench/batch_pickle_bench.py --out /tmp/batch_pickle.json
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

from tandem.megatron import RolloutBatch


class PerSample:
    """A batch's fields with its per-sample lists as lists (a batch's pickle before it flattened them)."""

    def __init__(self, batch: RolloutBatch) -> None:
        self.fields = dict(batch.__dict__)


def make_batch(samples: int, prompt: int, response: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(
        tokens=[torch.randint(0, 150_000, (prompt + response,), generator=g) for _ in range(samples)],
        response_lengths=[response] * samples,
        loss_masks=[torch.ones(response) for _ in range(samples)],
        rewards=torch.randn(samples, generator=g),
        rollout_log_probs=[torch.randn(response, generator=g) for _ in range(samples)],
    )


@ray.remote
def load_seconds(refs: list[Any], first_tokens: list[int]) -> float:
    """Seconds of `ray.get` of the batch (as a worker's `resolve_batch`), its first sample's tokens checked."""
    start = time.perf_counter()
    got = ray.get(refs[0])
    seconds = time.perf_counter() - start
    fields = got.fields if isinstance(got, PerSample) else got.__dict__
    if fields["tokens"][0].tolist() != first_tokens:
        raise AssertionError("the batch arrived wrong")
    return seconds


def measure(batch: RolloutBatch, way: str, repeats: int) -> dict[str, float]:
    sent: Any = batch if way == "flat" else PerSample(batch)
    first = batch.tokens[0].tolist()
    dumps, loads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ref = ray.put(sent)
        dumps.append(time.perf_counter() - start)
        loads.append(ray.get(load_seconds.remote([ref], first)))
        del ref
    return {"put_s": statistics.median(dumps), "get_s": statistics.median(loads)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes",
        default="256x128+512,512x32+48",
        help="samples x prompt + response tokens, comma-separated (the PPO bench's 0.5B and 135M ranks)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    shapes = []
    for text in args.shapes.split(","):
        samples, lengths = text.split("x")
        prompt, response = lengths.split("+")
        shapes.append((int(samples), int(prompt), int(response)))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for samples, prompt, response in shapes:
            batch = make_batch(samples, prompt, response)
            row: dict[str, Any] = {"samples": samples, "prompt": prompt, "response": response}
            for way in ("per_sample", "flat"):
                row[way] = measure(batch, way, args.repeats)
            rows.append(row)
            print(
                f"{samples} x {prompt}+{response}: put {row['per_sample']['put_s'] * 1e3:.1f} -> "
                f"{row['flat']['put_s'] * 1e3:.1f} ms, get in a task {row['per_sample']['get_s'] * 1e3:.1f} -> "
                f"{row['flat']['get_s'] * 1e3:.1f} ms (a tensor per sample -> one a field)"
            )
    finally:
        ray.shutdown()
    report = {"bench": "batch_pickle", "command": " ".join(sys.argv), "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
