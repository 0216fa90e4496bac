"""LoRA adapters on Megatron's fused linear layers, split over tensor parallelism as the base layer is.

`apply_lora(model, spec, settings, seed=...)` gives each targeted linear layer of
this stage a `LoraAdapter` (its attribute `lora`) and freezes every other
parameter but the critic's value head. The base layer's own parameters keep
their names (`decoder.layers.0.self_attention.linear_qkv.weight`), so loading and
exporting Hugging Face weights read them as before; the adapters' are
`....linear_qkv.lora.a` and `....linear_qkv.lora.b.q_proj`.

Tensor parallelism (TP), for `y = W x + s · B A x`:

- **Column-parallel base** (`linear_qkv`, `linear_fc1`; `W` split by output
  rows, input `x` whole on every rank): `A` is replicated (the whole input), `B`
  is split by output rows as `W` is, so each rank computes its own rows of
  `s · B A x`. The low-rank `z = A x` passes Megatron's
  `copy_to_tensor_model_parallel_region` (forward identity, backward all-reduce):
  each rank's `∂L/∂z` holds only its rows' part, and the all-reduce makes it the
  whole, so `A`'s gradient is the same on every rank (a tensor-parallel duplicate).
- **Row-parallel base** (`linear_proj`, `linear_fc2`; `W` split by input
  columns, `x` split likewise, output all-reduced): `A` is split by input
  columns as `W` is, `B` is replicated. Each rank's `A_r x_r` is a partial sum
  of `z`, completed by `reduce_from_tensor_model_parallel_region` (forward
  all-reduce of `rank` numbers a token, backward identity); `B z` is then the
  same on every rank, as the base layer's all-reduced output is.

Fused layers hold several Hugging Face modules: `linear_qkv` is q, k and v
(rows grouped by key/value head: each group's query heads, its key head, its
value head), `linear_fc1` is gate then up. Each targeted part has its own `A`
(stacked into one parameter, `a`) and `B` (`b[part]`), exactly PEFT's adapters
on the separate modules; their outputs are laid out as the base layer's rows.

`A` starts as PEFT's default (kaiming-uniform, bound 1/√in) drawn from a
generator seeded by (seed, layer, layer name), the same whatever the TP size,
and `B` at zeros: the adapted model starts as the base. Dropout (PEFT's
`lora_dropout`) zeroes adapter inputs in passes with gradients only.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.lora_spec import FUSED_TARGETS, LoraSettings, kaiming_bound
from tandem.megatron.models.networks import ValueHead, unwrap_model

__all__ = [
    "ADAPTER",
    "LAYER_LINEARS",
    "LoraAdapter",
    "adapters",
    "adapters_disabled",
    "apply_lora",
    "is_adapter_param",
    "merged_weight",
]

Parallel = Literal["column", "row"]

LAYER_LINEARS: tuple[tuple[str, str, Parallel], ...] = (
    ("self_attention", "linear_qkv", "column"),
    ("self_attention", "linear_proj", "row"),
    ("mlp", "linear_fc1", "column"),
    ("mlp", "linear_fc2", "row"),
)
"""(block, linear, how TP splits it) of each linear layer of a decoder layer that LoRA may adapt."""

ADAPTER = "lora"
"""The attribute (and parameter-name component) that holds a linear layer's adapter."""


def is_adapter_param(name: str) -> bool:
    """Whether parameter `name` of a model is an adapter's (`....linear_qkv.lora.a`)."""
    return f".{ADAPTER}." in f".{name}"


class LoraAdapter(nn.Module):
    """The adapter of one Megatron linear layer: `scaling · B A x` for each targeted part, in the base's layout.

    Args:
        parallel: how TP splits the base layer ("column" or "row").
        parts: the Hugging Face modules the base layer fuses, in its row order (q, k, v).
        targets: the adapted parts (a subset of `parts`).
        widths: each part's rows per group on this rank (q: heads a group × head size).
        groups: the groups the base layer's rows interleave on this rank (key/value heads of
            `linear_qkv`; 1 elsewhere).
        in_features: the base layer's input width on this rank.
        in_full: its input width over all TP ranks (A's fan-in; A's columns for a row split).
        out_full: each targeted part's rows over all TP ranks (B's rows for a column split).
        settings: rank, alpha, dropout.
        tp: the tensor-parallel (size, rank).
        generator_seed: seed of A's init, the same on every TP rank.
        dtype / device: of the parameters.
    """

    def __init__(
        self,
        *,
        parallel: Parallel,
        parts: tuple[str, ...],
        targets: tuple[str, ...],
        widths: tuple[int, ...],
        groups: int,
        in_features: int,
        in_full: int,
        out_full: dict[str, int],
        settings: LoraSettings,
        tp: tuple[int, int],
        generator_seed: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.parallel, self.parts, self.targets = parallel, parts, targets
        self.widths, self.groups = dict(zip(parts, widths, strict=True)), groups
        self.rank, self.scaling, self.dropout = settings.rank, settings.scaling, settings.dropout
        self.enabled = True
        tp_size, tp_rank = tp
        r = settings.rank
        # A, stacked over the targets: drawn whole (the same for any TP size), then split for a row base.
        gen = torch.Generator().manual_seed(generator_seed)
        bound = kaiming_bound(in_full)
        full_a = torch.empty(len(targets) * r, in_full).uniform_(-bound, bound, generator=gen)
        if parallel == "row":
            full_a = full_a.chunk(tp_size, dim=1)[tp_rank]
        assert full_a.shape[1] == in_features, (full_a.shape, in_features)
        self.a = nn.Parameter(full_a.to(device=device, dtype=dtype))
        self.b = nn.ParameterDict()
        for part in targets:
            rows = out_full[part] // tp_size if parallel == "column" else out_full[part]
            self.b[part] = nn.Parameter(torch.zeros(rows, r, device=device, dtype=dtype))
        # What Megatron reads: which parameters TP splits (gradient norms count the others once).
        set_tensor_model_parallel_attributes(self.a, parallel == "row", 1, 1)
        for param in self.b.values():
            set_tensor_model_parallel_attributes(param, parallel == "column", 0, 1)

    # --- the forward pass -----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """`scaling · B A x` in the base layer's output layout (this rank's rows); None when disabled."""
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if not self.enabled:
            return None
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            if self.parallel == "row":  # each rank's own slice of the input: TP's RNG stream
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    x = nn.functional.dropout(x, self.dropout)
            else:  # the whole input on every rank: the RNG that all TP ranks share
                x = nn.functional.dropout(x, self.dropout)
        z = nn.functional.linear(x, self.a)
        if self.parallel == "row":
            z = reduce_from_tensor_model_parallel_region(z)
        else:
            z = copy_to_tensor_model_parallel_region(z)
        outs = {
            part: nn.functional.linear(zi, self.b[part])
            for part, zi in zip(self.targets, z.split(self.rank, dim=-1), strict=True)
        }
        return self._layout(outs, dim=-1) * self.scaling

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """`scaling · B A` in the base weight's layout on this rank, in float32."""
        a_parts = self.a.float().split(self.rank, dim=0)
        outs = {part: self.b[part].float() @ a for part, a in zip(self.targets, a_parts, strict=True)}
        return self._layout(outs, dim=0) * self.scaling

    def _layout(self, outs: dict[str, torch.Tensor], *, dim: int) -> torch.Tensor:
        """The parts' rows (along `dim`) interleaved by group as the base layer lays them out; zeros for
        parts without an adapter."""
        if len(self.parts) == 1:
            return outs[self.parts[0]]
        any_out = next(iter(outs.values())).movedim(dim, -1)
        lead = any_out.shape[:-1]
        pieces = []
        for part in self.parts:
            width = self.widths[part]
            out = outs.get(part)
            if out is None:
                piece = any_out.new_zeros(*lead, self.groups, width)
            else:
                piece = out.movedim(dim, -1).reshape(*lead, self.groups, width)
            pieces.append(piece)
        laid = torch.cat(pieces, dim=-1).reshape(*lead, -1)
        return laid.movedim(-1, dim)

    # --- checkpoints ------------------------------------------------------------------------------
    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Megatron's sharded state dict of the adapter: the TP-split matrices sharded on their split axis."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis_map = {"a": 1} if self.parallel == "row" else {f"b.{p}": 0 for p in self.targets}
        state = self.state_dict(prefix="", keep_vars=True)
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if dp_cp_group is None:
            return make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets)
        from megatron.core import parallel_state as mpu

        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            axis_map,
            sharded_offsets,
            tp_group=mpu.get_tensor_model_parallel_group(),
            dp_cp_group=dp_cp_group,
        )


class _AdaptedLinear:
    """Mixed into a Megatron linear layer's class by `apply_lora`: its output plus its adapter's."""

    lora: LoraAdapter

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        output, bias = super().forward(input_, *args, **kwargs)  # type: ignore[misc]
        extra = self.lora(input_)
        return (output if extra is None else output + extra.to(output.dtype)), bias

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        # The base class shards its own weight and would take the adapter's tensors for replicated ones.
        own = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[misc]
        kept = {k: v for k, v in own.items() if not k.startswith(f"{prefix}{ADAPTER}.")}
        return kept | self.lora.sharded_state_dict(f"{prefix}{ADAPTER}.", sharded_offsets, metadata)


_ADAPTED_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _ADAPTED_CLASSES:
        _ADAPTED_CLASSES[cls] = type(f"LoRA{cls.__name__}", (_AdaptedLinear, cls), {})
    return _ADAPTED_CLASSES[cls]


def _shapes(spec: ModelSpec, linear: str, tp: int) -> tuple[tuple[int, ...], int, int, int, dict[str, int]]:
    """(widths per group on a rank, groups on a rank, input on a rank, input in full, rows in full per part)."""
    h, hd = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    if linear == "linear_qkv":
        groups = spec.num_kv_heads // tp
        per_group = spec.num_attention_heads // spec.num_kv_heads
        full = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        return (per_group * hd, hd, hd), groups, h, h, full
    if linear == "linear_proj":
        return (h,), 1, q_rows // tp, q_rows, {"o_proj": h}
    if linear == "linear_fc1":
        ffn = spec.ffn_hidden_size
        return (ffn // tp, ffn // tp), 1, h, h, {"gate_proj": ffn, "up_proj": ffn}
    return (h,), 1, spec.ffn_hidden_size // tp, spec.ffn_hidden_size, {"down_proj": h}


def apply_lora(model: Any, spec: ModelSpec, settings: LoraSettings, *, seed: int) -> list[LoraAdapter]:
    """Give this stage's targeted linear layers adapters and freeze every other parameter.

    The critic's value head stays trainable. Call before wrapping in DDP (which keeps
    gradient buffers for the trainable parameters only). Returns the adapters.
    """
    from megatron.core import parallel_state as mpu

    gpt = unwrap_model(model)
    tp_size, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    head = getattr(gpt, "output_layer", None)
    trainable = set(map(id, head.parameters())) if isinstance(head, ValueHead) else set()
    for param in gpt.parameters():
        param.requires_grad_(id(param) in trainable)
    made = []
    for layer in gpt.decoder.layers:
        global_layer = int(layer.layer_number) - 1
        for block, name, parallel in LAYER_LINEARS:
            parts = FUSED_TARGETS[name]
            targets = tuple(p for p in parts if p in settings.targets)
            if not targets:
                continue
            linear = getattr(getattr(layer, block), name)
            widths, groups, in_local, in_full, out_full = _shapes(spec, name, tp_size)
            weight = linear.weight
            adapter = LoraAdapter(
                parallel=parallel,
                parts=parts,
                targets=targets,
                widths=widths,
                groups=groups,
                in_features=in_local,
                in_full=in_full,
                out_full=out_full,
                settings=settings,
                tp=(tp_size, tp_rank),
                generator_seed=zlib.crc32(f"{seed}/{global_layer}/{name}".encode()),
                dtype=weight.dtype,
                device=weight.device,
            )
            linear.__class__ = _adapted_class(type(linear))
            linear.add_module(ADAPTER, adapter)
            made.append(adapter)
    return made


def adapters(model: Any) -> Iterator[tuple[str, LoraAdapter]]:
    """(the adapted linear layer's name, its adapter) of every adapter of this stage, in module order."""
    for name, module in unwrap_model(model).named_modules():
        if isinstance(module, LoraAdapter):
            yield name.removesuffix(f".{ADAPTER}"), module


@contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """The base model for the block's duration (every adapter's output left out), then the adapters again."""
    found = [adapter for _, adapter in adapters(model)]
    states = [adapter.enabled for adapter in found]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(found, states, strict=True):
            adapter.enabled = state


def merged_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight on this rank with its adapter merged in (`W + scaling · B A`), in W's dtype."""
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    adapter = getattr(linear, ADAPTER, None)
    if not isinstance(adapter, LoraAdapter):
        return weight.detach()
    with torch.no_grad():
        return (weight.float() + adapter.delta().to(weight.device)).to(weight.dtype)
