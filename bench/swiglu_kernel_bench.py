"""The SwiGLU's Triton kernels against eager, alone, on one GPU: forward and backward, several tile shapes.

The MLP's activation of one micro-batch (`--rows` tokens, the MLP's width `--width` per half, bf16):
eager is what Megatron's MLP runs without `bias_activation_fusion` (`torch.chunk`, `F.silu`, the product;
autograd's backward: the product's two multiplies, the SiLU's backward, the concatenation); the kernels are
`tandem.megatron.models._swiglu_kernels`' forward and backward, launched with each tile shape of `--tiles`
(rows x columns of a program, and its warps). Each figure is the wall clock of `--iters` calls after a
warm-up, the GPU synchronised before and after, divided by the calls; beside it the bytes each call reads and
writes over that time (the kernels are memory-bound: the H100's HBM3 moves about 3 TB/s).

GPU host, from the repo root:

    source .gpu-kit/setup.sh && python3 bench/swiglu_kernel_bench.py --out "$OUT/swiglu_kernel_bench.json"

Defaults are the 0.5B bench's micro-batch (16 x 640 tokens, width 4864).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def wall(fn: Callable[[], Any], iters: int) -> float:
    """Seconds a call of `fn`, the wall clock of `iters` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    p.add_argument("--rows", type=int, default=16 * 640, help="tokens of one micro-batch")
    p.add_argument("--width", type=int, default=4864, help="the MLP's width (each half of the input)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument(
        "--tiles",
        default="16x256x4,8x256x4,4x512x4,16x256x8,32x128x4,1x1024x4",
        help="tile shapes to time: ROWSxCOLSxWARPS, comma-separated",
    )
    args = p.parse_args()
    from tandem.megatron.models import _swiglu_kernels as k

    device = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(args.rows, 2 * args.width, device=device, dtype=torch.bfloat16)
    g = torch.randn(args.rows, args.width, device=device, dtype=torch.bfloat16)
    element = x.element_size()
    forward_bytes = (2 * args.width + args.width) * args.rows * element  # read x, write y
    backward_bytes = (
        (2 * args.width + args.width + 2 * args.width) * args.rows * element
    )  # read x, g; write dx

    def eager_forward() -> torch.Tensor:
        a, b = torch.chunk(x, 2, -1)
        return F.silu(a) * b

    leaf = x.detach().requires_grad_(True)

    def eager_backward() -> None:
        a, b = torch.chunk(leaf, 2, -1)
        (F.silu(a) * b).backward(g)
        leaf.grad = None

    def eager_backward_alone() -> float:
        # The backward's share: forward and backward, less the forward.
        return wall(eager_backward, args.iters) - wall(eager_forward, args.iters)

    results: dict[str, Any] = {
        "bench": "swiglu_kernel_bench",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": args.rows,
        "width": args.width,
        "iters": args.iters,
        "forward_bytes": forward_bytes,
        "backward_bytes": backward_bytes,
    }
    rows: list[dict[str, Any]] = []
    eager_fwd = wall(eager_forward, args.iters)
    eager_bwd = eager_backward_alone()
    rows.append({"what": "eager", "forward_s": eager_fwd, "backward_s": eager_bwd})
    out = torch.empty(args.rows, args.width, device=device, dtype=x.dtype)
    dx = torch.empty_like(x)
    for tile in args.tiles.split(","):
        block_rows, block_cols, warps = (int(v) for v in tile.split("x"))
        grid = (-(-args.rows // block_rows), -(-args.width // block_cols))
        options = dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, LIBDEVICE=True, num_warps=warps)

        def fwd(grid: tuple[int, int] = grid, options: dict[str, Any] = options) -> None:
            k._forward_kernel[grid](
                x, out, args.rows, args.width, x.stride(0), out.stride(0), **options, **k.COMPILE_OPTIONS
            )

        def bwd(grid: tuple[int, int] = grid, options: dict[str, Any] = options) -> None:
            k._backward_kernel[grid](
                g,
                x,
                dx,
                args.rows,
                args.width,
                g.stride(0),
                x.stride(0),
                dx.stride(0),
                **options,
                **k.COMPILE_OPTIONS,
            )

        fwd()
        bwd()
        torch.cuda.synchronize()
        assert torch.equal(out, eager_forward()), f"tile {tile}: the forward differs from eager"
        rows.append(
            {
                "what": f"kernel {tile}",
                "forward_s": wall(fwd, args.iters),
                "backward_s": wall(bwd, args.iters),
            }
        )
    for row in rows:
        row["forward_tb_s"] = forward_bytes / row["forward_s"] / 1e12
        row["backward_tb_s"] = backward_bytes / row["backward_s"] / 1e12 if row["backward_s"] > 0 else None
        print(
            f"{row['what']:>18}: forward {row['forward_s'] * 1e6:8.1f} us ({row['forward_tb_s']:.2f} TB/s), "
            f"backward {row['backward_s'] * 1e6:8.1f} us"
        )
    results["rows"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
