"""The actor with our fused RoPE against the same actor with Megatron's unfused RoPE (compiled, fp32).

Usage (through launch.py): python launch.py 1 rope_check.py HF_DIR OUT.pt
Builds `build_model(..., fused_rope=False)` and `fused_rope=True` from the same HF
weights and records, for each, the logits and every parameter's gradient of a
test loss on padded rows (Megatron's sbhd layout) and on packed rows (THD: uneven
samples, and one row of a single sample, where Megatron indexes the frequencies
by the token's place in the row), on CUDA when torch sees a GPU, else on the CPU; the fused model also counts the calls of the
fused hooks; both record the seconds of their first pass (the fused one compiles). Then, with
recompiling made an error, both layouts again at other lengths: they must reuse
the compiled kernels. As a control that the comparison can fail, the fused
model's hooks are swapped for ones that skip RoPE, and its logits recorded again. Then the SwiGLU
hook's check (`swiglu_check.compare`), saved under "swiglu".
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.megatron.models import build_model, rope, unwrap_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import load_hf_checkpoint
from tandem.megatron.models.packing import pack_lengths, pack_tokens, packed_seq_params, position_ids
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed

VOCAB = 64


def padded_logits(gpt: Any, tokens: torch.Tensor) -> torch.Tensor:
    device = gpt.embedding.word_embeddings.weight.device
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return gpt(tokens.to(device), positions.to(device), None)


def packed_logits(gpt: Any, samples: list[torch.Tensor]) -> torch.Tensor:
    device = gpt.embedding.word_embeddings.weight.device
    row = pack_lengths([int(s.numel()) for s in samples])
    tokens = pack_tokens(samples, row).unsqueeze(0).to(device)
    params = packed_seq_params(row, device)
    return gpt(tokens, position_ids(row).unsqueeze(0).to(device), None, packed_seq_params=params)


def logits_and_grads(gpt: Any, run: Callable[[], torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
    """`run()`'s logits and the gradients of a fixed random projection of them."""
    gpt.zero_grad(set_to_none=True)
    logits = run()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5)).to(logits.device)
    (logits * weights).sum().backward()
    out = {f"{tag}:logits": logits.detach().cpu()}
    out |= {f"{tag}:grad:{n}": p.grad.detach().cpu() for n, p in gpt.named_parameters()}
    return out


def inputs(seed: int, seq: int, lengths: list[int], single: int) -> dict[str, Any]:
    """Two padded rows of `seq` tokens, samples of `lengths` to pack, one sample of `single` to pack alone."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "padded": torch.randint(0, VOCAB, (2, seq), generator=gen),
        "samples": [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths],
        "alone": [torch.randint(0, VOCAB, (single,), generator=gen)],
    }


def cases(gpt: Any, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = logits_and_grads(gpt, lambda: padded_logits(gpt, x["padded"]), "sbhd")
    out |= logits_and_grads(gpt, lambda: packed_logits(gpt, x["samples"]), "thd")
    out |= logits_and_grads(gpt, lambda: packed_logits(gpt, x["alone"]), "thd_single")
    with torch.no_grad():  # the log-prob forward
        out["sbhd_no_grad:logits"] = padded_logits(gpt, x["padded"]).cpu()
    return out


def counting(
    calls: Counter[str], name: str, hook: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[name] += 1
        return hook(*args, **kwargs)

    return counted


def main() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    hf_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
    )
    spec = ModelSpec.from_hf(hf_dir)
    first, later = inputs(1, 12, [5, 9, 3], 7), inputs(2, 9, [4, 11, 2, 6], 10)
    result: dict[Any, Any] = {}
    for fused in (False, True):
        model = build_model(spec, "actor", fused_rope=fused)
        load_hf_checkpoint(model, spec, hf_dir, "actor")
        gpt = unwrap_model(model)
        result[f"apply_rope_fusion:{fused}"] = gpt.config.apply_rope_fusion
        calls: Counter[str] = Counter()
        if fused:
            result["installed"] = rope.installed()
            for name in ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"):
                setattr(rope_utils, name, counting(calls, name, getattr(rope, name)))
        t0 = time.perf_counter()
        result[fused] = {"first": cases(gpt, first)}
        result[f"first_pass_s:{fused}"] = time.perf_counter() - t0
        if not fused:
            result[fused]["later"] = cases(gpt, later)
            continue
        with torch._dynamo.config.patch(error_on_recompile=True):
            result[fused]["later"] = cases(gpt, later)
        result["calls"] = dict(calls)
        # The control: hooks that leave q and k as they are.
        rope_utils.fused_apply_rotary_pos_emb = lambda t, *args, **kwargs: t
        rope_utils.fused_apply_rotary_pos_emb_thd = lambda t, *args, **kwargs: t
        with torch.no_grad():
            result["no_rope:logits"] = padded_logits(gpt, first["padded"]).cpu()
        rope.install()
    # The SwiGLU hook's check in the same process (Megatron's world and imports once for both).
    from swiglu_check import compare

    result["swiglu"] = compare(spec, hf_dir)
    torch.save(result, out)
    destroy_distributed()


if __name__ == "__main__":
    main()
