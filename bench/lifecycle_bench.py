"""Sleep and wake bandwidth of the lifecycle memory backends, next to a plain pinned memcpy of the same bytes.

The state is a realistic training state of `--gib` GiB in Megatron's mixed-precision
layout: one flat bf16 parameter buffer (the parameters are views into it), one flat
fp32 gradient buffer, and the optimizer state (fp32 master weights and two Adam
moments) as one tensor per parameter, shaped like a Llama-style model (embedding,
attention and MLP matrices, small norm vectors). All figures come from one run:

1. memcpy: one device buffer of the state's size copied to and from a pinned host
   buffer (PyTorch's pinned allocator), the best of `--repeats` + 2 tries;
2. pinned_host: `PinnedHostBackend.pause()` / `resume()` of the state (sleep includes
   freeing the storages and emptying the CUDA cache); the first sleep, which also
   allocates and page-locks the host buffers, is reported on its own, then the
   median of `--repeats` cycles;
3. torch_memory_saver: the same state allocated in its regions with CPU backup, paused
   and resumed, in a child process started with `torch_memory_saver_env()`.

GB/s are 10^9 bytes a second; the goal (docs/design.md) is each direction of the
pinned_host backend at >= 80 % of the memcpy figure. A checksum of the state is
compared after the last wake, so a fast but wrong run cannot pass.

GPU host, from the repo root (about a minute for 8 GiB):

    source .gpu-kit/setup.sh && python3 bench/lifecycle_bench.py --gib 8 --out lifecycle-bench.json

CPU smoke run (tests/lifecycle/test_bench_smoke.py runs it; memcpy is then plain memory
and torch_memory_saver is skipped):

    python bench/lifecycle_bench.py --gib 0.05 --out /tmp/lifecycle-bench.json

It prints a markdown table for docs/benchmarks.md, shaped like this (figures made up):

    | what (8.02 GiB state, 152 tensors, NVIDIA H200) | sleep GB/s | wake GB/s | sleep / wake vs memcpy | GPU held asleep |
    |---|---|---|---|---|
    | pinned memcpy, same bytes | 55.0 | 55.0 | 100 % / 100 % | – |
    | pinned_host backend | 50.0 | 48.0 | 91 % / 87 % | 0.02 GiB |
    | torch_memory_saver (CPU backup) | 1.8 | 5.4 | 3 % / 10 % | 0.01 GiB |

    first pinned_host sleep (allocates and page-locks 8.02 GiB of host buffers): 2.10 s
    goal (each direction >= 80% of memcpy): met
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

try:
    import tandem.lifecycle as lifecycle
except ImportError:  # plain python3 without the workspace installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "lifecycle" / "src"))
    import tandem.lifecycle as lifecycle

GIB = 2**30
GOAL = 0.8
BYTES_PER_PARAM = 2 + 4 + 3 * 4  # bf16 weight, fp32 grad, fp32 master weight + two Adam moments


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _device_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def layer_shapes(n_params: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama-style model with at least `n_params` parameters (and at least 4 layers)."""
    for hidden in (4096, 2048, 1024, 512, 256, 128, 64):
        ffn, vocab = hidden * 11 // 4, hidden * 16
        layer = [
            (3 * hidden, hidden),
            (hidden, hidden),
            (2 * ffn, hidden),
            (hidden, ffn),
            (hidden,),
            (hidden,),
        ]
        per_layer = sum(torch.Size(s).numel() for s in layer)
        if vocab * hidden + 4 * per_layer <= n_params or hidden == 64:
            n_layers = max(
                1, -(-(n_params - vocab * hidden) // per_layer)
            )  # round up: at least the size asked
            return [(vocab, hidden), *layer * n_layers, (hidden,)]
    raise AssertionError("unreachable")


class TrainingState:
    """A flat bf16 parameter buffer with views, a flat fp32 grad buffer, and per-parameter optimizer state."""

    def __init__(
        self, gib: float, device: torch.device, region: Callable[[str], AbstractContextManager[None]]
    ):
        shapes = layer_shapes(int(gib * GIB) // BYTES_PER_PARAM)
        sizes = [torch.Size(s).numel() for s in shapes]
        n = sum(sizes)
        generator = torch.Generator(device=device).manual_seed(0)
        with region("weights"):
            self.flat_params = torch.randn(n, dtype=torch.bfloat16, device=device, generator=generator)
        self.params = [v.view(s) for v, s in zip(self.flat_params.split(sizes), shapes, strict=True)]
        with region("grads"):
            self.flat_grads = torch.randn(n, device=device, generator=generator)
        with region("optimizer"):
            self.optimizer_state = [
                torch.randn(s, device=device, generator=generator) for s in shapes for _ in range(3)
            ]

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat_params, self.flat_grads, *self.optimizer_state]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def checksum(self) -> list[int]:
        """Per-tensor integer sums of the raw bits (exact, order-free): a wrong byte changes one of them."""
        words = {2: torch.int16, 4: torch.int32}
        return [int(t.view(words[t.element_size()]).sum(dtype=torch.int64)) for t in self.tensors()]


def bench_memcpy(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Device ⇄ pinned host copies of `nbytes` (plain memory on CPU), best of `repeats`."""
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)
    result = {
        "d2h_gbps": nbytes / _best(lambda: host.copy_(dev, non_blocking=pinned), device, repeats) / 1e9,
        "h2d_gbps": nbytes / _best(lambda: dev.copy_(host, non_blocking=pinned), device, repeats) / 1e9,
    }
    return result


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    return min(_timed(fn, device) for _ in range(repeats))


def bench_backend(
    backend: lifecycle.MemoryBackend, state: TrainingState, device: torch.device, repeats: int, baseline: int
) -> dict[str, float | bool]:
    """Sleep and wake `state` through `backend`: the first sleep alone, then the median of `repeats` cycles."""
    nbytes, expected = state.nbytes, state.checksum()
    if device.type == "cuda":
        # What Lifecycle's clear_caches hook does before every sleep: the checksum's temporaries
        # would otherwise stay in torch's cache, which torch_memory_saver's pause leaves alone.
        torch.cuda.empty_cache()
    first_sleep = _timed(backend.pause, device)
    held_asleep = _device_used(device) - baseline
    first_wake = _timed(backend.resume, device)
    sleeps, wakes = [], []
    for _ in range(repeats):
        sleeps.append(_timed(backend.pause, device))
        wakes.append(_timed(backend.resume, device))
    sleep_s, wake_s = statistics.median(sleeps), statistics.median(wakes)
    return {
        "sleep_gbps": nbytes / sleep_s / 1e9,
        "wake_gbps": nbytes / wake_s / 1e9,
        "sleep_s": sleep_s,
        "wake_s": wake_s,
        "first_sleep_s": first_sleep,
        "first_wake_s": first_wake,
        "held_asleep_gib": held_asleep / GIB,
        "intact": state.checksum() == expected,
    }


def run_pinned_host(
    args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, float | bool], TrainingState]:
    baseline = _device_used(device)
    state = TrainingState(args.gib, device, lambda tag: nullcontext())
    backend = lifecycle.PinnedHostBackend(host_memory=args.host_memory)
    backend.register("weights", state.params)
    backend.register("grads", [state.flat_grads])
    backend.register("optimizer", lambda: state.optimizer_state)
    result = bench_backend(backend, state, device, args.repeats, baseline)
    result["host_gib"] = backend.host_nbytes() / GIB
    return result, state


def run_torch_memory_saver(args: argparse.Namespace) -> dict[str, float | bool | str]:
    """Run the torch_memory_saver part in a child process that starts with its preload hook."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    try:
        env = dict(os.environ, **lifecycle.torch_memory_saver_env())
    except ImportError as err:
        return {"skipped": str(err)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tms.json"
        cmd = [
            sys.executable,
            __file__,
            "--child-tms",
            "--gib",
            str(args.gib),
            "--repeats",
            str(args.repeats),
        ]
        proc = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"skipped": f"child failed: {proc.stderr[-2000:]}"}
        result: dict[str, float | bool | str] = json.loads(out.read_text())
        return result


def child_torch_memory_saver(args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    backend = lifecycle.TorchMemorySaverBackend(enable_cpu_backup=True)
    baseline = _device_used(device)
    state = TrainingState(args.gib, device, backend.region)
    result = bench_backend(backend, state, device, args.repeats, baseline)
    Path(args.out).write_text(json.dumps(result))


def _pct(value: float, reference: float) -> str:
    return f"{100 * value / reference:.0f} %"


def table(report: dict) -> str:
    memcpy, pinned, tms = report["memcpy"], report["pinned_host"], report["torch_memory_saver"]
    head = f"what ({report['state_gib']:.2f} GiB state, {report['tensors']} tensors, {report['device']})"
    rows = [
        f"| {head} | sleep GB/s | wake GB/s | sleep / wake vs memcpy | GPU held asleep |",
        "|---|---|---|---|---|",
        f"| {report['memcpy_kind']} memcpy, same bytes | {memcpy['d2h_gbps']:.1f} | {memcpy['h2d_gbps']:.1f} "
        "| 100 % / 100 % | – |",
    ]
    for name, r in (("pinned_host backend", pinned), ("torch_memory_saver (CPU backup)", tms)):
        if "skipped" in r:
            rows.append(f"| {name} | – | – | skipped: {r['skipped'].splitlines()[0][:80]} | – |")
            continue
        vs = f"{_pct(r['sleep_gbps'], memcpy['d2h_gbps'])} / {_pct(r['wake_gbps'], memcpy['h2d_gbps'])}"
        rows.append(
            f"| {name} | {r['sleep_gbps']:.1f} | {r['wake_gbps']:.1f} | {vs} | {r['held_asleep_gib']:.2f} GiB |"
        )
    rows += [
        "",
        f"first pinned_host sleep (allocates and page-locks {pinned['host_gib']:.2f} GiB of host buffers): "
        f"{pinned['first_sleep_s']:.2f} s",
        f"goal (each direction >= {GOAL:.0%} of memcpy): {'met' if report['goal_met'] else 'NOT met'}",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="size of the training state in GiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed cycles after the first one")
    parser.add_argument("--host-memory", default="registered", choices=["registered", "pinned", "pageable"])
    parser.add_argument("--out", required=True, help="where to write the JSON report")
    parser.add_argument("--child-tms", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gib <= 0 or args.repeats < 1:
        parser.error("--gib must be positive and --repeats at least 1")
    if args.child_tms:
        child_torch_memory_saver(args)
        return

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    _device_used(device)  # create the CUDA context before any baseline
    # The memcpy runs first, on an empty GPU, with the state's size computed from its shapes.
    n = sum(torch.Size(s).numel() for s in layer_shapes(int(args.gib * GIB) // BYTES_PER_PARAM))
    nbytes = n * BYTES_PER_PARAM
    memcpy = bench_memcpy(nbytes, device, args.repeats + 2)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    pinned, state = run_pinned_host(args, device)
    assert state.nbytes == nbytes, (state.nbytes, nbytes)
    n_tensors = len(state.tensors())
    del state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tms = run_torch_memory_saver(args)
    goal_met = bool(
        pinned["intact"]
        and pinned["sleep_gbps"] >= GOAL * memcpy["d2h_gbps"]
        and pinned["wake_gbps"] >= GOAL * memcpy["h2d_gbps"]
    )
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "memcpy_kind": "pinned" if device.type == "cuda" else "pageable",
        "state_gib": nbytes / GIB,
        "tensors": n_tensors,
        "host_memory": args.host_memory,
        "memcpy": memcpy,
        "pinned_host": pinned,
        "torch_memory_saver": tms,
        "goal": GOAL,
        "goal_met": goal_met,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(table(report))
    if not pinned["intact"] or tms.get("intact") is False:
        sys.exit("the state did not come back intact")


if __name__ == "__main__":
    main()
