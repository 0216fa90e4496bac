"""The actor with our SwiGLU hook against the same actor with Megatron's eager SwiGLU.

`compare(spec, hf_dir)`, called by rope_check.py in its process (Megatron's world is set up once for
both checks: tests/megatron/conftest.py's `model_checks`): builds `build_model(..., fused_swiglu=False)`
and `fused_swiglu=True` from the same HF weights (on CUDA when torch sees a GPU, where the hook runs the
Triton kernels; else on the CPU, where it runs the eager SwiGLU) and records, for each,
`bias_activation_fusion`, the logits and every parameter's gradient on padded and packed rows
(`rope_check.cases`), and how often the MLPs called the hook. As a control that the comparison can fail,
the hook is swapped for one that drops the SiLU, and the logits recorded again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from rope_check import cases, counting, inputs, padded_logits

from tandem.megatron.models import build_model, swiglu, unwrap_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import load_hf_checkpoint


def compare(spec: ModelSpec, hf_dir: Path) -> dict[Any, Any]:
    """The two models' figures, as the module docstring says (Megatron's world initialised already)."""
    from megatron.core.transformer import mlp

    x = inputs(1, 12, [5, 9, 3], 7)
    result: dict[Any, Any] = {}
    for fused in (False, True):
        # Megatron's own compiled fusion off, as a worker has it without `jit_fusions` (on CUDA the config
        # turns it on by default): the reference is the eager SwiGLU.
        model = build_model(spec, "actor", fused_swiglu=fused, bias_activation_fusion=fused)
        load_hf_checkpoint(model, spec, hf_dir, "actor")
        gpt = unwrap_model(model)
        result[f"bias_activation_fusion:{fused}"] = gpt.config.bias_activation_fusion
        calls: Counter[str] = Counter()
        if fused:
            result["installed"] = swiglu.installed()
            mlp.bias_swiglu_impl = counting(calls, "bias_swiglu_impl", swiglu.bias_swiglu_impl)
        result[fused] = cases(gpt, x)
        result["calls"] = dict(calls)
    # The control: a hook that leaves the SiLU out.
    mlp.bias_swiglu_impl = lambda y, *args: torch.chunk(y, 2, -1)[0] * torch.chunk(y, 2, -1)[1]
    with torch.no_grad():
        result["no_silu:logits"] = padded_logits(gpt, x["padded"]).cpu()
    swiglu.install()
    return result
