"""Hugging Face weights into and out of this rank's Megatron stage.

`load_hf_checkpoint` reads a local HF folder (`config.json` plus
`model.safetensors`, or shards listed in `model.safetensors.index.json`) and
fills this rank's tensor-parallel slice of its pipeline stage; each rank reads
only the tensors of its own stage.

`export_hf_weights` is the other direction, in the form an inference engine's
weight update takes: full (unsplit), HF-named tensors in chunks of bounded
size. Every rank of the model calls it and iterates it to the end in
lockstep (it runs collectives): the owner stage gathers each tensor over its
TP group, then broadcasts it over the pipeline group, so EVERY rank receives
every chunk, on the model's device and in the model's dtype. That suits both
ways an engine is fed: each engine rank pulling full tensors from its
co-located train rank (e.g. SGLang `update_weights_from_tensor`), or one rank
(global rank 0) sending them over a broadcast group (`update_weights_from_distributed`).
A tied output head is not exported (the engine ties it to `model.embed_tokens.weight`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.megatron.choices import Role
from tandem.megatron.models._cpu_compat import enable_cpu_compat
from tandem.megatron.models.conversion import (
    ParamMap,
    hf_shape,
    param_map,
    shard,
    stage_param_names,
    to_hf,
    to_megatron,
    unshard,
)
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.host_tensors import zero_copy
from tandem.megatron.models.lora import (
    ADAPTER,
    LAYER_LINEARS,
    LoraAdapter,
    adapters,
    is_adapter_param,
    merged_weight,
)
from tandem.megatron.models.lora_spec import FUSED_TARGETS, LoraSettings, adapter_name, hf_module
from tandem.megatron.models.networks import ValueHead, unwrap_model


class SafetensorsReader:
    """Lazy access to the tensors of a local HF checkpoint folder (single file or sharded index)."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.root = Path(hf_dir)
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = dict(weight_map)
        else:
            files = sorted(self.root.glob("*.safetensors"))
            if not files:
                raise ValueError(
                    f"load_hf_checkpoint: no *.safetensors in {self.root}; pass a HF model folder "
                    "saved with safetensors (save_pretrained(..., safe_serialization=True))"
                )
            from safetensors import safe_open

            self._file_of = {}
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    self._file_of.update(dict.fromkeys(handle.keys(), f.name))
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`, read from its file."""
        if name not in self._file_of:
            raise ValueError(
                f"load_hf_checkpoint: tensor {name!r} is missing from the checkpoint in {self.root}"
            )
        from safetensors import safe_open

        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.root / file), framework="pt")
        tensor: torch.Tensor = self._handles[file].get_tensor(name)
        return tensor


def _stage_layout(gpt: Any, pp_rank: int | None = None) -> tuple[int, int]:
    """(first global layer, number of layers) of pipeline stage `pp_rank` (this one by default)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return (
        int(get_transformer_layer_offset(gpt.config, pp_rank=pp_rank)),
        int(get_num_layers_to_build(gpt.config, pp_rank=pp_rank)),
    )


def _role_of(gpt: Any) -> Role:
    role: Role | None = getattr(gpt, "tandem_role", None)
    if role is None:  # a GPTModel built elsewhere: only the last stage can tell
        role = "critic" if isinstance(getattr(gpt, "output_layer", None), ValueHead) else "actor"
    return role


def load_hf_checkpoint(model: Any, spec: ModelSpec, hf_dir: str | Path, role: Role) -> None:
    """Copy a local HF checkpoint into this rank's slice of its stage of `model`.

    The critic's `ValueHead` is the checkpoint's `score` head when it has one: a
    critic saved by `export_hf_weights`, or a one-label reward model (a Hugging Face
    sequence-classification folder, whose backbone is then the critic's: OpenRLHF's
    default start). A score head without a bias loads with bias 0; one of another
    shape (a classifier of several labels) is refused. A checkpoint without a score
    head (a causal LM) leaves the value head at its init.
    """
    enable_cpu_compat()
    from megatron.core import parallel_state as mpu

    gpt = unwrap_model(model)
    if _role_of(gpt) != role:
        raise ValueError(f"load_hf_checkpoint: role {role!r} does not match the model ({_role_of(gpt)})")
    reader = SafetensorsReader(hf_dir)
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    offset, _ = _stage_layout(gpt)
    for name, param in gpt.named_parameters():
        if is_adapter_param(name):
            continue  # an adapter is the trainer's, not the checkpoint's
        pm = param_map(spec, name, layer_offset=offset, role=role)
        if role == "critic" and name.startswith("output_layer."):
            head = _score_head(reader, pm.hf[0], param)
            if head is None:
                continue
            tensors = [head]
        else:
            tensors = [reader.get(n) for n in pm.hf]
        full = to_megatron(spec, pm, tensors)
        if _is_vocab(pm):
            full = _pad_rows(full, param.shape[0] * tp_size)
        local = shard(pm.split, full, tp_rank, tp_size)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(
                f"load_hf_checkpoint: {pm.hf} give {tuple(local.shape)} for {name} but the model has "
                f"{tuple(param.shape)}; the checkpoint does not match config.json"
            )
        with torch.no_grad():
            param.copy_(local)


VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
"""HF tensors with one row per token: Megatron's copies have `padded_vocab_size` rows."""


def _is_vocab(pm: ParamMap) -> bool:
    return pm.hf[0] in VOCAB_TENSORS


def _pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """`full` with zero rows appended up to `rows` (Megatron's padded vocabulary)."""
    if full.shape[0] > rows:
        raise ValueError(
            f"load_hf_checkpoint: the checkpoint has {full.shape[0]} vocabulary rows but the model only "
            f"{rows}; the checkpoint does not match config.json's vocab_size"
        )
    if full.shape[0] == rows:
        return full
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def _score_head(reader: SafetensorsReader, hf_name: str, param: torch.Tensor) -> torch.Tensor | None:
    """The checkpoint's `score.weight` / `score.bias` for the critic's value head; None without a score head.

    A reward model's head often has no bias (`nn.Linear(hidden, 1, bias=False)`): its
    value head bias is then 0, so that the critic's values are the reward model's scores.
    """
    if "score.weight" not in reader:
        return None
    if hf_name not in reader:  # score.bias of a head without one
        return torch.zeros(param.shape, dtype=param.dtype)
    tensor = reader.get(hf_name)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"load_hf_checkpoint: {hf_name} in {reader.root} has shape {tuple(tensor.shape)}, but the critic's "
            f"value head needs {tuple(param.shape)}; start the critic from a reward model with num_labels=1 "
            "(one score), or from a causal LM"
        )
    return tensor


def _gather_tp(local: torch.Tensor, pm: ParamMap) -> torch.Tensor:
    from megatron.core import parallel_state as mpu

    tp_size = mpu.get_tensor_model_parallel_world_size()
    if pm.split == "replicated" or tp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return unshard(pm.split, parts)


def _export_plan(gpt: Any, spec: ModelSpec, role: Role) -> list[tuple[int, ParamMap]]:
    """(owner pipeline stage, ParamMap) of every exported tensor of the whole model, in order."""
    from megatron.core import parallel_state as mpu

    pp_size = mpu.get_pipeline_model_parallel_world_size()
    plan = []
    for stage in range(pp_size):
        offset, num_layers = _stage_layout(gpt, pp_rank=stage)
        names = stage_param_names(
            spec,
            role=role,
            num_local_layers=num_layers,
            pre_process=stage == 0,
            post_process=stage == pp_size - 1,
            tied_copy=pp_size > 1,
        )
        for name in names:
            pm = param_map(spec, name, layer_offset=offset, role=role)
            if pm.exported:
                plan.append((stage, pm))
    return plan


Planned = Iterator[tuple[int, list[tuple[str, tuple[int, ...]]], Callable[[], list[torch.Tensor]]]]
"""(owner pipeline stage, [(name, shape)], produce) of each group of exported tensors, in the same order
on every rank; the owner stage's `produce()` makes the group's tensors."""


def _stage_groups(
    planned: Planned, *, dtype: torch.dtype, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every planned group on every rank: made by its owner stage, broadcast over the pipeline."""
    from megatron.core import parallel_state as mpu

    pp_group = mpu.get_pipeline_model_parallel_group()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    for stage, names, produce in planned:
        if stage == pp_rank:
            tensors = [t.contiguous().clone() for t in produce()]
        else:
            tensors = [torch.empty(shape, dtype=dtype, device=device) for _, shape in names]
        if pp_size > 1:
            src = dist.get_global_rank(pp_group, stage)
            for t in tensors:
                dist.broadcast(t, src=src, group=pp_group)
        yield list(zip((n for n, _ in names), tensors, strict=True))


def _in_chunks(
    groups: Iterator[list[tuple[str, torch.Tensor]]], chunk_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors of `groups` in lists of at most `chunk_bytes`; a group is never split (a group larger
    than that comes alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for group in groups:
        nbytes = sum(t.numel() * t.element_size() for _, t in group)
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk += group
        size += nbytes
    if chunk:
        yield chunk


def export_hf_weights(
    model: Any, spec: ModelSpec, chunk_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full HF-named tensors of the whole model, in chunks of at most `chunk_bytes` (one tensor larger than that comes alone).

    Every rank of the model must iterate it to the end (collectives inside);
    every rank gets every chunk (see the module docstring). Tensors are fresh
    copies on the model's device, in its parameter dtype. A LoRA model's layers
    come with their adapters merged in (`lora.merged_weight`): a plain model of the
    same architecture.
    """
    if chunk_bytes < 1:
        raise ValueError(f"export_hf_weights: chunk_bytes is {chunk_bytes}; it must be positive")
    enable_cpu_compat()
    gpt = unwrap_model(model)
    role = _role_of(gpt)
    params = dict(gpt.named_parameters())
    device = next(iter(params.values())).device

    def produce(pm: ParamMap) -> Callable[[], list[torch.Tensor]]:
        @torch.no_grad()
        def made() -> list[torch.Tensor]:
            full = _gather_tp(_local_weight(gpt, pm.megatron, params[pm.megatron]), pm)
            if _is_vocab(pm):
                full = full[: spec.vocab_size]  # the padding rows are Megatron's, not the model's
            return [t for _, t in to_hf(spec, pm, full)]

        return made

    planned = (
        (stage, [(n, hf_shape(spec, n)) for n in pm.hf], produce(pm))
        for stage, pm in _export_plan(gpt, spec, role)
    )
    # Every parameter is stored in the config's dtype (`build_model`); each HF tensor on its own.
    singles = (
        [named]
        for group in _stage_groups(planned, dtype=gpt.config.params_dtype, device=device)
        for named in group
    )
    yield from _in_chunks(singles, chunk_bytes)


def _local_weight(gpt: Any, name: str, param: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of parameter `name` as exported: an adapted layer's weight with its adapter merged."""
    owner, _, leaf = name.rpartition(".")
    if (
        leaf == "weight"
        and owner
        and isinstance(getattr(gpt.get_submodule(owner), ADAPTER, None), LoraAdapter)
    ):
        return merged_weight(gpt.get_submodule(owner))
    return param.detach()


def export_lora_adapters(
    model: Any, spec: ModelSpec, settings: LoraSettings, chunk_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's LoRA adapters, whole (gathered over TP and PP), in chunks of at most `chunk_bytes`.

    Named as PEFT saves them, without its `base_model.model.` prefix
    (`model.layers.3.self_attn.q_proj.lora_A.weight`, `(rank, in)`; `...lora_B.weight`,
    `(out, rank)`). Every rank must iterate it to the end (collectives inside) and gets
    every chunk; the adapters of one Megatron layer always come in one chunk.
    """
    if chunk_bytes < 1:
        raise ValueError(f"export_lora_adapters: chunk_bytes is {chunk_bytes}; it must be positive")
    enable_cpu_compat()
    from megatron.core import parallel_state as mpu

    gpt = unwrap_model(model)
    device = next(iter(gpt.parameters())).device
    found = dict(adapters(gpt))
    r = settings.rank

    def produce(local_name: str) -> Callable[[], list[torch.Tensor]]:
        @torch.no_grad()
        def made() -> list[torch.Tensor]:
            adapter = found[local_name]
            out = []
            for part, a in zip(adapter.targets, adapter.a.detach().split(r, dim=0), strict=True):
                b = adapter.b[part].detach()
                if adapter.parallel == "row":  # A split by input columns, as the base
                    a = _gather_tp(a, ParamMap(local_name, (), "columns"))
                else:  # B split by output rows, as the base
                    b = _gather_tp(b, ParamMap(local_name, (), "rows"))
                out += [a, b]
            return out

        return made

    def planned() -> Planned:
        for stage in range(mpu.get_pipeline_model_parallel_world_size()):
            offset, num_layers = _stage_layout(gpt, pp_rank=stage)
            for local in range(num_layers):
                for block, linear, _ in LAYER_LINEARS:
                    names: list[tuple[str, tuple[int, ...]]] = []
                    for target in (t for t in FUSED_TARGETS[linear] if t in settings.targets):
                        rows, cols = hf_shape(spec, hf_module(offset + local, target) + ".weight")
                        names += [
                            (adapter_name(offset + local, target, "A"), (r, cols)),
                            (adapter_name(offset + local, target, "B"), (rows, r)),
                        ]
                    if names:
                        yield stage, names, produce(f"decoder.layers.{local}.{block}.{linear}")

    yield from _in_chunks(_stage_groups(planned(), dtype=gpt.config.params_dtype, device=device), chunk_bytes)


def send_chunk(
    target: Any,
    named: list[tuple[str, torch.Tensor]],
    pack: Callable[[Any], Any] | None = None,
    *,
    method: str = "update_weights_from_tensors",
    **kwargs: Any,
) -> None:
    """Hand one chunk of `export_hf_weights` to an engine's `update_weights_from_tensors` (or, for a
    chunk of `export_lora_adapters`, its `update_adapter_from_tensors`: `method`, with `kwargs`).

    A local object gets the tensors as they are; a Ray actor handle gets CPU
    copies (as `host_tensors.zero_copy` objects, which arrive as read-only CPU
    tensors), or `pack(named)` when given (e.g. CUDA IPC handles for an engine on
    this rank's GPU: no round trip through the host). The call is waited for, so
    chunks arrive one at a time and in order, and a packed payload outlives its use.
    """
    bound = getattr(target, method)
    remote: Callable[..., Any] | None = getattr(bound, "remote", None)
    if remote is None:
        bound(named if pack is None else pack(named), **kwargs)
        return
    import ray

    if pack is not None:
        payload = pack(named)
        ray.get(remote(payload, **kwargs))
        del payload
        return
    # CPU copies that Ray passes through its object store without pickling their bytes.
    ray.get(remote([(name, zero_copy(t.detach().to("cpu"))) for name, t in named], **kwargs))
