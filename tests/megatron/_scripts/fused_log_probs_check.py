"""`fused_log_probs` on given cases in one process, for `test_fused_log_probs.py` (run with TRITON_INTERPRET=1).

Usage: python fused_log_probs_check.py CASES.pt OUT.pt
CASES.pt holds a list of dicts (logits, targets, upstream gradients of both outputs,
temperature, vocab_size, with_entropy); OUT.pt receives, for each, the kernel's
log-probs, entropy and the gradient reaching the logits (TP 1, a gloo world of one).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main() -> None:
    from megatron.core import parallel_state as mpu

    from tandem.megatron.models._cpu_compat import enable_cpu_compat
    from tandem.megatron.worker.fused_log_probs import fused_log_probs

    cases = torch.load(sys.argv[1])
    enable_cpu_compat()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    results = []
    for case in cases:
        logits = case["logits"].clone().requires_grad_()
        log_probs, entropy = fused_log_probs(
            logits,
            case["targets"],
            temperature=case["temperature"],
            vocab_size=case["vocab_size"],
            with_entropy=case["with_entropy"],
        )
        loss = (case["upstream"][0] * log_probs).sum()
        if entropy is not None:
            loss = loss + (case["upstream"][1] * entropy).sum()
        (grad,) = torch.autograd.grad(loss, logits)
        results.append(
            {
                "log_probs": log_probs.detach(),
                "entropy": None if entropy is None else entropy.detach(),
                "grad": grad,
            }
        )
    torch.save(results, sys.argv[2])
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
