"""The networks and their weights: Megatron GPT stages with the actor's and the critic's heads, HF ⇄ Megatron.

`networks` (`build_model`, `ValueHead`), the Hugging Face config (`hf_config.ModelSpec`),
weights and name mapping (`hf_weights`, `conversion`), RoPE in one kernel (`rope`), SwiGLU in one (`swiglu`),
sequence packing and the core attentions that honour it (`packing`, `attention`),
and Megatron's CPU path (`_cpu_compat`). This layer may import torch, megatron-core,
safetensors, `tandem.megatron.choices`, `tandem.megatron.batch` and the algorithms
layer; never the worker or the driver side (tests/test_import_graph.py).

Names are imported on first use: `from tandem.megatron.models import build_model`
loads megatron-core only then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"build_model": "networks", "unwrap_model": "networks", "ValueHead": "networks"}

if TYPE_CHECKING:
    from .networks import ValueHead, build_model, unwrap_model


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["ValueHead", "build_model", "unwrap_model"]
