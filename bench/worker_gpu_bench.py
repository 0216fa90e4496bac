"""Sleep and wake of a real train worker on the GPU: seconds, GB/s, and GPU memory held asleep.

For each memory backend, one actor `TrainWorker` (a Ray actor on 0.4 of a GPU
bundle, as in shared placement) builds a Llama-shaped model from a random
Hugging Face checkpoint made here, takes one PPO step (so the Adam state
exists), then goes through `--cycles` sleep/wake cycles. Reported per backend:
the training state the worker moves (weights, gradients, optimizer: bytes from
the worker itself), the median sleep and wake seconds and GB/s (10^9 bytes a
second, measured around the Ray call), and the GPU memory the worker holds
asleep beyond its CUDA context (nvidia-smi; the whole GPU less the context
where nvidia-smi cannot see the worker's pid). A plain pinned-host memcpy of
the same bytes, measured first in this process, is the reference
(docs/design.md: each direction at >= 80 % of it; asleep <= 1 GiB).

GPU host, from the repo root (a few minutes for the default ~0.9 B model):

    source .gpu-kit/setup.sh && python3 bench/worker_gpu_bench.py --out worker-bench.json

It prints a markdown table for docs/benchmarks.md, shaped like this (figures made up):

    | backend (0.87 B params, 15.6 GB state, NVIDIA H200) | sleep s | wake s | sleep GB/s | wake GB/s | vs memcpy | GPU held asleep |
    |---|---|---|---|---|---|---|
    | pinned memcpy, same bytes | 0.30 | 0.31 | 52.0 | 50.3 | 100 % / 100 % | – |
    | pinned_host | 0.35 | 0.36 | 44.6 | 43.3 | 86 % / 86 % | 0.21 GiB |
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GIB = 1024**3


def make_checkpoint(path: Path, args: argparse.Namespace) -> int:
    """A random Llama in bf16, saved with save_pretrained; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_batch(n: int, vocab: int, seed: int) -> Any:
    from tandem.megatron.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(64, 256, (1,), generator=g)) for _ in range(n)]
    return RolloutBatch(
        tokens=[torch.randint(0, vocab, (64 + r,), generator=g) for r in lengths],
        response_lengths=lengths,
        loss_masks=[torch.ones(r) for r in lengths],
        rewards=torch.randn(n, generator=g),
    )


def pinned_memcpy(nbytes: int, repeats: int) -> tuple[float, float]:
    """Best seconds of a device -> pinned host copy and back of `nbytes` (capped at 16 GiB, scaled)."""
    size = min(nbytes, 16 * GIB)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    to_host, to_device = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        to_host.append(t1 - t0)
        to_device.append(time.perf_counter() - t1)
    del device, host
    torch.cuda.empty_cache()
    scale = nbytes / size
    return min(to_host) * scale, min(to_device) * scale


def held_asleep(report: dict[str, Any]) -> float | None:
    """Bytes held asleep beyond the worker's CUDA context."""
    if report.get("process") is not None and report.get("process_baseline") is not None:
        return float(report["process"] - report["process_baseline"])
    if None in (report.get("device_used"), report.get("device_before_context"), report.get("context")):
        return None
    return float(report["device_used"] - report["device_before_context"] - report["context"])


def run_backend(backend: str, hf: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.util.placement_group import placement_group

    from tandem.megatron.config import WorkerConfig
    from tandem.megatron.group import create_train_group

    config = WorkerConfig(
        hf_checkpoint=str(hf),
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        global_batch_size=8,
        micro_batch_size=2,
        device="cuda",
        params_dtype="bfloat16",
        offload_backend=backend,  # type: ignore[arg-type]
        lr=1e-5,
        save=str(root / backend),
    )
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        pg = placement_group([{"GPU": 1, "CPU": 2}], strategy="PACK")
        ray.get(pg.ready())
        group = create_train_group(config, "actor", pg, [0], num_gpus_per_worker=0.4)
        worker = group.workers[0]
        ray.get(group.train(0, [ray.put(make_batch(8, args.vocab, seed=0))]))
        nbytes = ray.get(worker.call.remote("state_nbytes"))
        total = sum(nbytes.values())
        sleeps, wakes, held = [], [], []
        steps: dict[str, list[float]] = {}
        for _ in range(args.cycles):
            t0 = time.perf_counter()
            sleep_steps = ray.get(worker.call.remote("sleep"))
            t1 = time.perf_counter()
            held.append(held_asleep(ray.get(worker.call.remote("gpu_memory"))))
            t2 = time.perf_counter()
            wake_steps = ray.get(worker.call.remote("wake_up"))
            t3 = time.perf_counter()
            sleeps.append(t1 - t0)
            wakes.append(t3 - t2)
            for prefix, timings in (("sleep", sleep_steps), ("wake", wake_steps)):
                for step, seconds in timings.items():
                    steps.setdefault(f"{prefix}/{step}", []).append(seconds)
        group.kill()
    finally:
        ray.shutdown()
    sleep_s, wake_s = statistics.median(sleeps), statistics.median(wakes)
    known = [h for h in held if h is not None]
    return {
        "backend": backend,
        "state_bytes": nbytes,
        "total_bytes": total,
        "sleep_s": sleeps,
        "wake_s": wakes,
        "sleep_s_median": sleep_s,
        "wake_s_median": wake_s,
        "sleep_gb_s": total / sleep_s / 1e9,
        "wake_gb_s": total / wake_s / 1e9,
        "held_asleep_bytes": max(known) if known else None,
        # Inside the worker (Lifecycle.last_timings), median seconds per step; the rest is the Ray call.
        "steps_s_median": {step: statistics.median(v) for step, v in steps.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="pinned_host,torch_memory_saver")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("worker_gpu_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    root = Path(tempfile.mkdtemp(prefix="worker-bench-"))
    params = make_checkpoint(root / "hf", args)
    results = [run_backend(b, root / "hf", root, args) for b in args.backends.split(",") if b]
    total = results[0]["total_bytes"]
    memcpy_off, memcpy_on = pinned_memcpy(total, repeats=3)
    gpu = torch.cuda.get_device_name()
    header = f"backend ({params / 1e9:.2f} B params, {total / 1e9:.1f} GB state, {gpu})"
    print(f"| {header} | sleep s | wake s | sleep GB/s | wake GB/s | vs memcpy | GPU held asleep |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| pinned memcpy, same bytes | {memcpy_off:.2f} | {memcpy_on:.2f} | {total / memcpy_off / 1e9:.1f} "
        f"| {total / memcpy_on / 1e9:.1f} | 100 % / 100 % | – |"
    )
    for r in results:
        held = "?" if r["held_asleep_bytes"] is None else f"{r['held_asleep_bytes'] / GIB:.2f} GiB"
        print(
            f"| {r['backend']} | {r['sleep_s_median']:.2f} | {r['wake_s_median']:.2f} | {r['sleep_gb_s']:.1f} "
            f"| {r['wake_gb_s']:.1f} | {100 * memcpy_off / r['sleep_s_median']:.0f} % / "
            f"{100 * memcpy_on / r['wake_s_median']:.0f} % | {held} |"
        )
    print("\nInside the worker, median seconds per step (the rest of the wall time is the Ray call):\n")
    names = list(dict.fromkeys(step for r in results for step in r["steps_s_median"]))
    print("| step | " + " | ".join(r["backend"] for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for step in names:
        cells = [r["steps_s_median"].get(step) for r in results]
        print(f"| {step} | " + " | ".join("–" if c is None else f"{c:.3f}" for c in cells) + " |")
    print(f"\ncommand: python3 bench/worker_gpu_bench.py {' '.join(sys.argv[1:])}")
    if args.out is not None:
        report = {
            "gpu": gpu,
            "params": params,
            "memcpy_s": {"to_host": memcpy_off, "to_device": memcpy_on},
            "results": results,
        }
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
