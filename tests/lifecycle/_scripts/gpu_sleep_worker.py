"""Sleep and wake a GPU training state through one backend and report what happened (one JSON line).

Run by test_gpu.py in a fresh process: torch_memory_saver's preload mode needs its
hook in LD_PRELOAD from the start, and a fresh process makes the memory baseline
("what the process held before the model existed") clean.

    python gpu_sleep_worker.py --backend {pinned_host,torch_memory_saver} [--hook-mode preload] [--gib 4]
"""

from __future__ import annotations

import argparse
import json

import torch

from tandem.lifecycle import Lifecycle, PinnedHostBackend, TorchMemorySaverBackend, clear_torch_caches

TAGS = ["weights", "grads", "optimizer"]
GIB = 2**30


def device_used() -> int:
    """Bytes in use on the device (all of it: the allocator's cache, other pools, the context)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["pinned_host", "torch_memory_saver"], required=True)
    parser.add_argument("--hook-mode", choices=["preload"], default="preload")
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()

    torch.cuda.init()
    if args.backend == "pinned_host":
        backend: PinnedHostBackend | TorchMemorySaverBackend = PinnedHostBackend()
    else:
        backend = TorchMemorySaverBackend(hook_mode=args.hook_mode)
    baseline = device_used()

    # 18 bytes a parameter: bf16 weights in one flat buffer, fp32 grads in another, fp32 master
    # weights and two Adam moments as separate tensors of 1 Mi parameters each.
    n_params = int(args.gib * GIB) // 18 // (1 << 20) * (1 << 20)
    with backend.region("weights"):
        flat_params = torch.randn(n_params, dtype=torch.bfloat16, device="cuda")
    params = list(flat_params.split(1 << 20))  # views, as Megatron's parameters are
    with backend.region("grads"):
        flat_grads = torch.randn(n_params, dtype=torch.float32, device="cuda")
    with backend.region("optimizer"):
        optimizer_state = [torch.randn(1 << 20, device="cuda") for _ in range(3 * len(params))]
    if isinstance(backend, PinnedHostBackend):
        backend.register("weights", params)
        backend.register("grads", [flat_grads])
        backend.register("optimizer", lambda: optimizer_state)
    lifecycle = Lifecycle(backend, tags=TAGS, clear_caches=clear_torch_caches)
    awake = device_used()

    cycles = []
    for cycle in range(args.cycles):
        reference = [t.cpu() for t in (flat_params, flat_grads, *optimizer_state)]
        lifecycle.sleep()
        asleep = device_used()
        lifecycle.wake_up()
        identical = all(
            torch.equal(t.cpu(), r)
            for t, r in zip((flat_params, flat_grads, *optimizer_state), reference, strict=True)
        )
        # A view made before the sleep still aliases the flat buffer: write through it.
        params[1].fill_(float(cycle + 1))
        views_alias = bool((flat_params[1 << 20 : 2 << 20] == cycle + 1).all())
        cycles.append(
            {
                "asleep_extra_gib": (asleep - baseline) / GIB,
                "identical": identical,
                "views_alias": views_alias,
            }
        )
        flat_grads.mul_(0.5)  # a training step changes the state between cycles
    report = {"baseline_gib": baseline / GIB, "awake_gib": awake / GIB, "cycles": cycles}
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
