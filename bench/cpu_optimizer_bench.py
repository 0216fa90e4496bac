"""The CPU train's optimizer step: torch's AdamW as a loop over the parameters against its fused kernel, and
the gradient norm that clips first, as a float64 copy of each gradient against a float64 sum of it as read.

On the CPU megatron-core steps torch's AdamW (no Apex, no Transformer Engine) in torch's default
implementation, a Python loop over the parameters; the train worker now has it step through torch's fused
kernel (`worker.optimizer.step_fused`), and `grad_norm` (the CPU's clipping) sums each gradient's squares
in float64 without a float64 copy. This times both ways in one run, on parameters shaped as a model's
(`--shape`: SmolLM2-135M's 30 layers, hidden 576, MLP 1536, vocabulary 49,152, 135 M parameters in all, or
`tiny` for a check), median of `--repeats` after one warm-up step each: `loop` and `fused` are one AdamW step
of every parameter, `norm_copy` and `norm_read` one global norm of every gradient. Each way's parameters
after its steps are compared with the other's, and the two norms with each other, so a wrong path fails
the run.

    ./uvw run python bench/cpu_optimizer_bench.py --threads 2 --out /tmp/cpu_optimizer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {
    # (layers, hidden, MLP width, vocabulary): the embedding tied to the head, as SmolLM2's.
    "smollm2-135m": (30, 576, 1536, 49152),
    "tiny": (2, 64, 128, 512),
}


def model_params(shape: str, seed: int = 0) -> list[torch.Tensor]:
    """Parameters shaped as one of `SHAPES`' models (attention with 3 KV heads of 64 as SmolLM2's), each
    with a gradient."""
    layers, hidden, mlp, vocab = SHAPES[shape]
    kv = min(hidden, 192)
    one_layer = [
        (hidden,),
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (hidden,),
        (mlp, hidden),
        (mlp, hidden),
        (hidden, mlp),
    ]
    dims = [(vocab, hidden), *[d for _ in range(layers) for d in one_layer], (hidden,)]
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(d, generator=g) * 0.02) for d in dims]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def norm_copy(grads: list[torch.Tensor]) -> float:
    """The global norm as `grad_norm` summed it before: a float64 copy of each gradient, squared, summed."""
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        total += grad.double().pow(2).sum()
    return float(total) ** 0.5


def norm_read(grads: list[torch.Tensor]) -> float:
    """The global norm as `grad_norm` sums it now: each gradient's norm in float64 as read, squared, summed."""
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        total += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
    return float(total) ** 0.5


def seconds(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of `call` over `repeats`, after one call that is not timed."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(shape: str, repeats: int) -> dict[str, object]:
    from tandem.megatron.worker.optimizer import step_fused

    loop_params, fused_params = model_params(shape), model_params(shape)
    loop = torch.optim.AdamW(loop_params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01, foreach=False)
    fused = torch.optim.AdamW(fused_params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01)
    step_fused(fused)
    rows = {"loop": seconds(loop.step, repeats), "fused": seconds(fused.step, repeats)}
    worst = max(float((a - b).detach().abs().max()) for a, b in zip(loop_params, fused_params, strict=True))
    if worst > 1e-6:
        raise AssertionError(f"the fused step's parameters differ from the loop's by {worst}")
    grads = [p.grad for p in loop_params if p.grad is not None]
    norms = {"norm_copy": norm_copy(grads), "norm_read": norm_read(grads)}
    if abs(norms["norm_copy"] - norms["norm_read"]) > 1e-9 * norms["norm_copy"]:
        raise AssertionError(f"the two norms differ: {norms}")
    rows["norm_copy"] = seconds(lambda: norm_copy(grads), repeats)
    rows["norm_read"] = seconds(lambda: norm_read(grads), repeats)
    return {
        "shape": shape,
        "params": sum(p.numel() for p in loop_params),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "seconds": rows,
        "speedup": {"step": rows["loop"] / rows["fused"], "norm": rows["norm_copy"] / rows["norm_read"]},
        "max_param_difference": worst,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run(args.shape, args.repeats)
    for name, value in result["seconds"].items():  # type: ignore[attr-defined]
        print(f"{name:>10}: {value * 1e3:.2f} ms")
    print(f"step {result['speedup']['step']:.1f}x, norm {result['speedup']['norm']:.1f}x")  # type: ignore[index]
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
