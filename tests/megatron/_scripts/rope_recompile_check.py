"""The compiled RoPE hooks (`rope.KERNELS = "compiled"`, on CUDA too) past dynamo's recompile limit: no crash, the eager results, one warning.

Usage: python rope_recompile_check.py OUT.json [DEVICE]
With `torch._dynamo.config.recompile_limit` lowered to 2, calls the sbhd and THD
hooks with many kinds of input (two dtypes, training and `no_grad`, dimensions of
size 1) and several sizes; records whether every call returned
what the eager functions return, how many kernels were compiled (one per kind), and, as the
control, whether one plain `torch.compile(fullgraph=True)` of the same function
fails on the same calls. Then, with the limit at 1, forces a recompile within one
kind (a new head size) and records the warnings: that kind must fall back to eager.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
from typing import Any

import torch

from tandem.megatron.models import rope

DTYPES = (torch.float32, torch.bfloat16)


def freqs_for(seq: int, rot_dim: int, device: str) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)


def sbhd_calls(device: str) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(t, freqs, grad mode): 8 kinds (2 dtypes, training or `no_grad`, a size-1 dim or not), 2 sizes of one."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    shapes = ((7, 2, 3, 16), (1, 2, 3, 16), (9, 3, 4, 16))  # the last: the first's kind, other sizes
    for dtype, training, shape in itertools.product(DTYPES, (True, False), shapes):
        t = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(training)
        calls.append((t, freqs_for(shape[0], 16, device), training))
    return calls


KINDS = 8
"""Kinds of call in `sbhd_calls`."""


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compiled fp32 kernels may contract multiply-adds; bf16 and fp16 round where eager does.
    return bool(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2))


def main() -> None:
    out_path = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    rope.KERNELS = "compiled"  # on CUDA too: the compiled path is what this checks
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("tandem.megatron.models.rope").addHandler(Keep(level=logging.WARNING))
    result: dict[str, Any] = {}
    torch._dynamo.config.recompile_limit = 2

    # 1. Many kinds of call through the hooks: every result the eager one.
    agree = True
    for t, freqs, grad_mode in sbhd_calls(device):
        with torch.set_grad_enabled(grad_mode):
            agree &= close(rope.fused_apply_rotary_pos_emb(t, freqs), rope.rope_sbhd(t, freqs))
    gen = torch.Generator().manual_seed(1)
    for dtype, lengths in itertools.product(DTYPES, ([3, 5], [1], [4, 1, 6])):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        t = torch.randn(sum(lengths), 2, 8, generator=gen).to(device, dtype)
        freqs = freqs_for(max(lengths) + 2, 8, device)
        agree &= close(rope.fused_apply_rotary_pos_emb_thd(t, cu, freqs), rope.rope_thd(t, cu, freqs))
    rotate: Any = rope._compiled(rope.rope_rotate)
    result["agree"] = agree
    result["kinds"] = KINDS
    result["rotate_kernels"] = len(rotate.kernels)
    result["eager_kinds_after_many_kinds"] = len(rotate.eager)
    result["warnings_after_many_kinds"] = list(warnings)

    # 2. The control: one compiled function for all those calls hits the limit.
    plain = torch.compile(rope.rope_sbhd, fullgraph=True)
    try:
        for t, freqs, grad_mode in sbhd_calls(device):
            with torch.set_grad_enabled(grad_mode):
                plain(t, freqs)
        result["plain_failed"] = None
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        result["plain_failed"] = type(exc).__name__

    # 3. A kind that exhausts its own budget (limit 1, then a new head size) runs eagerly. The
    #    reset forgets the sizes dynamo has seen, which it would otherwise treat as dynamic.
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 1
    warnings.clear()
    fallback = rope._KeyedKernel(rope.rope_sbhd)
    agree_fallback = True
    for d in (8, 12, 16, 20):
        t = torch.randn(5, 2, 3, d, generator=gen).to(device)
        freqs = freqs_for(5, d, device)
        agree_fallback &= close(fallback(t, freqs), rope.rope_sbhd(t, freqs))
    result["agree_fallback"] = agree_fallback
    result["fallback_eager_kinds"] = len(fallback.eager)
    result["fallback_warnings"] = list(warnings)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
