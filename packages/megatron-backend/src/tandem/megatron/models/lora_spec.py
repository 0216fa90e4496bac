"""LoRA's settings, its target names and its merge, in pure torch: what the trainer, the export and the engine share.

A LoRA adapter on a linear layer `W` (`out x in`) adds `scaling · B A x`, with
`A` (`rank x in`), `B` (`out x rank`, zeros at the start) and
`scaling = alpha / rank` (Hu et al. 2021, eq. 3; PEFT's `LoraLayer`). The
targets are named as Hugging Face's (and PEFT's) modules: `q_proj`, `k_proj`,
`v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`; Megatron's fused layers
are accepted as the names of their parts (`linear_qkv` is q, k and v,
`linear_proj` is o, `linear_fc1` gate and up, `linear_fc2` down), and
`all-linear` is all seven.

The adapter as PEFT saves it (`adapter_model.safetensors`): for each target of
layer L, `base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight` (A)
and `...lora_B.weight` (B), beside `adapter_config.json`. The trainer sends the
same tensors to a rollout engine under the names without PEFT's
`base_model.model.` prefix (`adapter_name`), and the engine merges each into
its weight `model.layers.L.self_attn.q_proj.weight` with `merge_lora`, from the
base weight every time, so repeated merges never drift.

Imports nothing heavy (torch only inside `merge_lora`): the config and the driver's help read the
target names, and the engines merge, without Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALL_LINEAR",
    "FUSED_TARGETS",
    "HF_LINEARS",
    "PEFT_PREFIX",
    "LoraSettings",
    "adapter_config",
    "adapter_name",
    "hf_module",
    "merge_lora",
    "resolve_targets",
    "split_adapter_name",
]

HF_LINEARS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a decoder layer that LoRA may adapt, by their Hugging Face names, in this order."""

_BLOCK = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Megatron's fused linear layers and the Hugging Face modules each is made of."""

ALL_LINEAR = "all-linear"
"""The target name for every linear layer of a decoder layer (as PEFT's `all-linear` without the head)."""

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a causal LM's module names in its saved adapter."""


@dataclass(frozen=True)
class LoraSettings:
    """One role's LoRA: the adapters' rank, scaling numerator, input dropout and target layers.

    Attributes:
        rank: the adapters' rank r (> 0).
        alpha: the scaling numerator; the adapter's output is multiplied by `alpha / rank`.
        dropout: the probability of zeroing an adapter's input element in an update's forward pass.
        targets: the adapted layers, Hugging Face names in `HF_LINEARS` order.
    """

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """What the adapter's output is multiplied by: `alpha / rank`."""
        return self.alpha / self.rank


def resolve_targets(names: Sequence[str] | None, available: Sequence[str] = HF_LINEARS) -> tuple[str, ...]:
    """The Hugging Face names of the layers `names` ask for, in `HF_LINEARS` order; None: every one.

    Accepts Hugging Face names, Megatron's fused names and `all-linear`. A name the
    model does not have is a ValueError listing the names it has (`check_lora` names the field).
    """
    if names is None:
        return tuple(n for n in HF_LINEARS if n in available)
    if isinstance(names, str):
        names = [names]
    chosen: set[str] = set()
    for name in names:
        if name == ALL_LINEAR:
            chosen.update(available)
        elif name in FUSED_TARGETS and all(p in available for p in FUSED_TARGETS[name]):
            chosen.update(FUSED_TARGETS[name])
        elif name in available:
            chosen.add(name)
        else:
            fused = [f for f, parts in FUSED_TARGETS.items() if all(p in available for p in parts)]
            raise ValueError(
                f"{name!r} is not a linear layer of this model; it has {', '.join(available)} "
                f"(Megatron's fused names {', '.join(fused)} stand for their parts; {ALL_LINEAR} for all)"
            )
    if not chosen:
        raise ValueError(f"no layer named; give at least one of {', '.join(available)}")
    return tuple(n for n in HF_LINEARS if n in chosen)


def hf_module(layer: int, target: str) -> str:
    """The Hugging Face module name of `target` in decoder layer `layer` (`model.layers.3.self_attn.q_proj`)."""
    return f"model.layers.{layer}.{_BLOCK[target]}.{target}"


def adapter_name(layer: int, target: str, matrix: Literal["A", "B"], *, peft: bool = False) -> str:
    """The name of one adapter matrix: `model.layers.L.self_attn.q_proj.lora_A.weight` (with PEFT's
    `base_model.model.` prefix when `peft`)."""
    return f"{PEFT_PREFIX if peft else ''}{hf_module(layer, target)}.lora_{matrix}.weight"


def split_adapter_name(name: str) -> tuple[str, Literal["A", "B"]]:
    """(the adapted weight's Hugging Face name, "A" or "B") of an adapter matrix's name (PEFT's prefix allowed)."""
    bare = name.removeprefix(PEFT_PREFIX)
    matrices: tuple[Literal["A", "B"], ...] = ("A", "B")
    for matrix in matrices:
        suffix = f".lora_{matrix}.weight"
        if bare.endswith(suffix):
            return bare.removesuffix(suffix) + ".weight", matrix
    raise ValueError(f"{name!r} is not a LoRA adapter matrix (…lora_A.weight or …lora_B.weight)")


def merge_lora(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`base + scaling · b @ a`, computed in float32 on `base`'s device and rounded once to `base`'s dtype.

    Shape: `base` `(out, in)`, `a` `(rank, in)`, `b` `(out, rank)`. Computing from the base
    weight every time (not adding a difference to the last merge) keeps repeated merges exact.
    """
    import torch

    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != base.shape:
        raise ValueError(
            f"merge_lora: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a weight of shape {tuple(base.shape)}"
        )
    with torch.no_grad():
        delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
        return (base.float() + scaling * delta).to(base.dtype)


def adapter_config(settings: LoraSettings, base_model: str) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for `settings` on a causal LM (every decoder layer adapted)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": list(settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "inference_mode": True,
    }


def kaiming_bound(fan_in: int) -> float:
    """The bound of PEFT's (and `nn.Linear`'s) default init of A: kaiming-uniform with a = √5, i.e. 1/√fan_in."""
    return 1.0 / math.sqrt(fan_in)
