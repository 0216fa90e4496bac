"""`chunked_log_probs` under tensor parallel 2 (CPU, gloo), for `test_chunked_log_probs.py`.

Usage (under launch.py): python launch.py 2 chunked_log_probs_check.py OUT_DIR [--fused]
(`--fused`: `fused_log_probs`, the Triton kernels, in place of the chunked kernel; run it
with TRITON_INTERPRET=1 on a CPU.)
Both ranks build the same whole-vocabulary logits for each case, take their own half
of the columns, and write `OUT_DIR/<case>-rank<r>.pt`: the chunked kernel's log-probs,
entropy and gradient slice (of fixed upstream gradients of both outputs), and the same
through `vocab_parallel_log_probs` at TP 2. Rank 0 writes the cases' inputs to
`OUT_DIR/inputs.pt`, for the test's TP-1 reference on the whole logits.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from launch import init_from_env

from tandem.megatron.worker.log_probs import chunked_log_probs
from tandem.megatron.worker.parallel import destroy_distributed
from tandem.megatron.worker.response_outputs import vocab_parallel_log_probs

# name: (rows, whole padded vocabulary, tokenizer vocabulary or None, temperature, entropy, chunk, dtype)
CASES: dict[str, tuple[int, int, int | None, float, bool, int, torch.dtype]] = {
    "plain": (13, 64, None, 1.0, True, 4, torch.float32),
    "padded": (17, 96, 70, 0.7, True, 5, torch.float32),
    # Rank 1's slice is all padding: its max is the floor, its sums 0.
    "rank1_all_padding": (9, 80, 37, 1.3, True, 2, torch.float32),
    "bf16": (21, 128, 120, 0.5, True, 8, torch.bfloat16),
    "no_entropy": (11, 50, 47, 1.0, False, 3, torch.float32),
    "one_chunk": (6, 40, None, 2.0, True, 64, torch.bfloat16),
}


def case_inputs(
    index: int, case: tuple[int, int, int | None, float, bool, int, torch.dtype]
) -> dict[str, Any]:
    n, vocab, vocab_size, temperature, with_entropy, _, dtype = case
    generator = torch.Generator().manual_seed(100 + index)
    logits = (torch.randn(n, vocab, generator=generator) * 6).to(dtype)
    targets = torch.randint(0, vocab_size or vocab, (n,), generator=generator)
    upstream = [torch.randn(n, generator=generator), torch.randn(n, generator=generator)]
    return {
        "logits": logits,
        "targets": targets,
        "upstream": upstream,
        "temperature": temperature,
        "vocab_size": vocab_size,
        "with_entropy": with_entropy,
    }


def run(
    fn: Any, logits: torch.Tensor, inputs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    leaf = logits.clone().requires_grad_()
    log_probs, entropy = fn(leaf)
    loss = (inputs["upstream"][0] * log_probs).sum()
    if entropy is not None:
        loss = loss + (inputs["upstream"][1] * entropy).sum()
    (grad,) = torch.autograd.grad(loss, leaf)
    return log_probs.detach(), None if entropy is None else entropy.detach(), grad


def main() -> None:
    out = Path(sys.argv[1])
    fused = "--fused" in sys.argv[2:]
    rank = init_from_env(tensor_parallel_size=2)
    everything = {}
    for index, (name, case) in enumerate(CASES.items()):
        inputs = case_inputs(index, case)
        everything[name] = inputs
        mine = inputs["logits"].chunk(2, dim=-1)[rank].contiguous()
        kwargs = {"with_entropy": inputs["with_entropy"], "vocab_size": inputs["vocab_size"]}
        temperature, targets = inputs["temperature"], inputs["targets"]
        if fused:
            from tandem.megatron.worker.fused_log_probs import fused_log_probs

            chunked = partial(fused_log_probs, temperature=temperature, **kwargs)
        else:
            chunked = partial(chunked_log_probs, temperature=temperature, chunk_tokens=case[5], **kwargs)
        log_probs, entropy, grad = run(lambda z, f=chunked, t=targets: f(z, t), mine, inputs)
        reference = partial(vocab_parallel_log_probs, **kwargs)
        ref_log_probs, _, ref_grad = run(
            lambda z, f=reference, t=targets, T=temperature: f(z.float() / T, t), mine, inputs
        )
        torch.save(
            {
                "log_probs": log_probs,
                "entropy": entropy,
                "grad": grad,
                "ref_log_probs": ref_log_probs,
                "ref_grad": ref_grad,
            },
            out / f"{name}-rank{rank}.pt",
        )
    if rank == 0:
        torch.save(everything, out / "inputs.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
