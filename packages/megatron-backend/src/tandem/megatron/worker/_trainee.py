"""The model one train worker trains: built, loaded, wrapped, and its tensors grouped for sleeping.

`build_trainee` builds this rank's pipeline stage of the actor or critic, loads
the Hugging Face weights (and, for an actor with a KL loss or reward-level KL, keeps the reference
weights on the host), gives it LoRA adapters when the role has them (`WorkerConfig.lora_of`: the
base then frozen), wraps it in Megatron's DDP and builds the optimizer, each
inside the memory backend's region of its tag so that torch_memory_saver tracks
them. `Trainee` then says which tensors belong to which tag for the pinned-host
backend, swaps reference weights in and out (with LoRA: switches the adapters off),
and snapshots the training state.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.lifecycle import HostCopies, MemoryBackend, PinnedHostBackend, SharedFrozen
from tandem.megatron.choices import TRAIN_PARTS, Role, memory_tag_pieces
from tandem.megatron.config import WorkerConfig
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.lora import adapters_disabled
from tandem.megatron.models.lora_spec import LoraSettings
from tandem.megatron.runtime.gpu_memory import phase_part, resident_change
from tandem.megatron.worker.checkpoint import TrainState
from tandem.megatron.worker.memory import StepWakes, storage_piece
from tandem.megatron.worker.optimizer import OptimizerBundle, build_optimizer, wrap_ddp
from tandem.megatron.worker.train_clock import TrainClock, timed_part

WEIGHTS, GRADS, OPTIMIZER = "weights", "grads", "optimizer"
"""Memory tags: weights can come back alone (weight export while asleep). `optimizer` is
torch_memory_saver's one region of the optimizer state (chosen at build time)."""
MAIN_PARAMS, OPTIMIZER_MOMENTS = "main_params", "optimizer_moments"
"""The pinned-host backend's two kinds of tag of the optimizer state: its fp32 main weights, and its
moments (Adam's), which a memory plan may put to sleep apart; each in `optimizer_pieces` tags
(`optimizer_moments.0` …: `choices.memory_tag_pieces`)."""
PASSES, OPTIMIZER_STEP = TRAIN_PARTS
"""A train's measured phase in two (`gpu_memory.phase_part`): the passes, the rest beside its optimizer steps."""
BASE = "base"
"""The memory tag of a LoRA model's frozen base (every parameter that does not train)."""


def _params_dtype(config: WorkerConfig) -> torch.dtype:
    return torch.bfloat16 if config.params_dtype == "bfloat16" else torch.float32


@dataclass
class Trainee:
    """One rank's model of one role, with its optimizer and (actor with KL loss) reference weights.

    Attributes:
        role: "actor" or "critic".
        config: the worker config.
        spec: the model shape from the Hugging Face config.
        chunks: the DDP-wrapped model chunks (one: no virtual pipelining).
        optim: optimizer, LR schedule and clipping.
        device: where the model lives.
        backend: the memory backend whose regions hold the weights and optimizer state.
        reference: host copies of the reference weights, one per parameter of
            `chunks[0].module`, in `parameters()` order (`HostCopies`: one exact-size
            buffer, page-locked on the GPU); None without a KL loss or reward-level KL
            (`WorkerConfig.needs_reference`), and with LoRA (the reference is the base).
        lora: the role's LoRA settings; None when it trains in full.
        step_wakes: the tags this train wakes for each optimizer step alone (`StepWakes`); None: none.
        clock: the train's seconds by part (`TrainClock`); None outside a worker's train.
    """

    role: Role
    config: WorkerConfig
    spec: ModelSpec
    chunks: list[Any]
    optim: OptimizerBundle
    device: torch.device
    backend: MemoryBackend
    reference: Sequence[torch.Tensor] | None = None
    lora: LoraSettings | None = None
    step_wakes: StepWakes | None = None
    """Set by the worker for one train (`TrainWorker.keep_asleep_for_passes`): tags asleep through the passes,
    woken for each optimizer step."""
    clock: TrainClock | None = None
    """Set by the worker for one train: the train's seconds by part (`train_clock`)."""

    @property
    def module(self) -> torch.nn.Module:
        """The GPTModel inside the DDP wrapper."""
        module: torch.nn.Module = self.chunks[0].module
        return module

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, in `parameters()` order."""
        return list(self.module.parameters())

    @property
    def has_reference(self) -> bool:
        """Whether `reference_weights` has a reference to swap in: host copies, or a LoRA model's base."""
        return self.reference is not None or (self.lora is not None and self.config.needs_reference)

    def optimizer_step(self) -> tuple[float, float]:
        """One optimizer step; (grad norm, lr). Inside the optimizer's region: Adam state is created lazily.

        Where `step_wakes` is set (a plan's `at_step`), its tags wake for the step and sleep after it. The step
        is a part of the train's measured phase (`OPTIMIZER_STEP`), its allocator peak kept apart from the
        passes'."""
        with (
            timed_part(self.clock, "optimizer_step"),
            self.step_wakes.around_step() if self.step_wakes is not None else contextlib.nullcontext(),
        ):
            self.join_optimizer()
            # The first step creates Adam's moments, which then stay: resident state, not the phase's transient.
            with phase_part(OPTIMIZER_STEP), self.backend.region(OPTIMIZER), resident_change():
                return self.optim.step(self.chunks)

    def join_optimizer(self) -> None:
        """Wait (on the GPU) for the optimizer state that a wake brings back in the background.

        The pinned-host backend resumes the optimizer's tags (`main_params`, `optimizer_moments`)
        on its side stream and returns (`register(..., resume_in_background=True)`): the optimizer
        state is first read at the optimizer step, so its copy overlaps the forward and backward
        passes before it. Whatever reads that state calls this first: the step, checkpoints, snapshots.
        """
        join = getattr(self.backend, "join", None)
        if join is not None:
            for tag in self.optimizer_tags:
                join(tag)

    # --- tensors per memory tag (pinned-host backend) ------------------------------------
    def weight_tensors(self) -> list[torch.Tensor]:
        """The trained weights: DDP's flat parameter buffers where it has them, else each trained parameter."""
        flat = [b.param_data for b in self._buffers() if getattr(b, "param_data", None) is not None]
        in_flat = {
            id(p) for b in self._buffers() if getattr(b, "param_data", None) is not None for p in b.params
        }
        return flat + [p for p in self.parameters() if id(p) not in in_flat and p.requires_grad]

    def frozen_tensors(self) -> list[torch.Tensor]:
        """The parameters that never train (a LoRA model's base), each on its own; none without LoRA."""
        return [p for p in self.parameters() if not p.requires_grad]

    def grad_tensors(self) -> list[torch.Tensor]:
        """DDP's flat gradient buffers."""
        return [b.grad_data for b in self._buffers()]

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """Optimizer-owned tensors (main weights, Adam state) that are not model weights or grads.

        Compared by storage, not by tensor: the distributed optimizer's fp32 shards of fp32
        parameters are views into DDP's flat parameter buffer, which the weights tag holds.
        """
        return self._not_model(self.optim.state_tensors())

    def main_param_tensors(self) -> Iterator[torch.Tensor]:
        """The optimizer's main weights that are not the model's weights or grads: the distributed
        optimizer's fp32 copies of bf16 weights; none on the CPU (there they are the model's weights)."""
        return self._not_model(self.optim.main_param_tensors())

    def moment_tensors(self) -> Iterator[torch.Tensor]:
        """The optimizer's moments (Adam's `exp_avg`, `exp_avg_sq`), created at the first step."""
        return self._not_model(self.optim.moment_tensors())

    @property
    def optimizer_tags(self) -> tuple[str, ...]:
        """The pinned-host backend's tags of the optimizer state: `main_params`' pieces, then
        `optimizer_moments`' (`optimizer_pieces` each)."""
        pieces = self.config.optimizer_pieces or 1
        return (*memory_tag_pieces(MAIN_PARAMS, pieces), *memory_tag_pieces(OPTIMIZER_MOMENTS, pieces))

    def optimizer_sources(self) -> dict[str, Callable[[], list[torch.Tensor]]]:
        """Each optimizer tag's tensors (`optimizer_tags`), read when called (the moments are created at the
        first step): each kind's distinct storages in order, cut where their running bytes pass each
        `1 / optimizer_pieces` of the kind's total, so that the pieces hold about equal bytes of whole
        storages, none in two pieces."""
        pieces = self.config.optimizer_pieces or 1
        kinds = {MAIN_PARAMS: self.main_param_tensors, OPTIMIZER_MOMENTS: self.moment_tensors}
        sources: dict[str, Callable[[], list[torch.Tensor]]] = {}
        for kind, tensors in kinds.items():
            for index, tag in enumerate(memory_tag_pieces(kind, pieces)):
                sources[tag] = functools.partial(storage_piece, tensors, index, pieces)
        return sources

    def _not_model(self, tensors: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        taken = {_storage_key(t) for t in (*self.weight_tensors(), *self.grad_tensors())}
        return (t for t in tensors if _storage_key(t) not in taken)

    @property
    def base_sleeps(self) -> bool:
        """Whether a sleep puts a LoRA model's frozen base away too (`lora_base_offload`)."""
        return self.lora is not None and self.config.lora_base_offload

    def base_share(self) -> SharedFrozen | None:
        """Where this rank's frozen base finds the other model's host copy of it (`lora_base_share`): a folder
        beside the actor's checkpoints, under a key of the machine, the checkpoint and this rank's shard."""
        if not self.config.shares_lora_base:
            return None
        from megatron.core import parallel_state as mpu

        checkpoint = os.path.realpath(self.config.hf_checkpoint_of(self.role))
        digest = hashlib.sha1(checkpoint.encode()).hexdigest()[:12]
        tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
        shard = (
            f"tp{mpu.get_tensor_model_parallel_rank()}of{tp}-pp{mpu.get_pipeline_model_parallel_rank()}of{pp}"
        )
        save = self.config.save
        folder = (
            Path(save).parent / ".shared_bases"
            if save
            else Path(tempfile.gettempdir()) / "tandem-shared-bases"
        )
        return SharedFrozen(folder, f"{socket.gethostname()}-{digest}-{shard}")

    @property
    def weight_tags(self) -> tuple[str, ...]:
        """The memory tags a forward pass reads: the weights, and a LoRA model's base when it sleeps."""
        return (BASE, WEIGHTS) if self.base_sleeps else (WEIGHTS,)

    def register(self, backend: MemoryBackend) -> tuple[str, ...]:
        """Register this model's tensors with a pinned-host backend; returns the tags to sleep, in order.

        Pinned-host: (`base`,) `weights`, `grads`, `main_params`, `optimizer_moments` (the last two in
        `optimizer_pieces` tags each: `optimizer_tags`); torch_memory_saver: (`base`,) `weights`,
        `optimizer` (its regions, chosen at build time).
        """
        base = (BASE,) if self.base_sleeps else ()
        if isinstance(backend, PinnedHostBackend):
            if base:
                # Copied to the host at the first sleep only: the base never changes.
                backend.register(BASE, self.frozen_tensors(), frozen=True, share=self.base_share())
            backend.register(WEIGHTS, self.weight_tensors())
            # Gradients are zeroed before every minibatch: their bytes are not worth moving.
            backend.register(GRADS, self.grad_tensors(), keep=self.config.offload_grads)
            # Callables: the moments are created at the first step, after this.
            background = self.config.background_optimizer_wake
            for tag, source in self.optimizer_sources().items():
                backend.register(tag, source, resume_in_background=background)
            return (*base, WEIGHTS, GRADS, *self.optimizer_tags)
        # torch_memory_saver: regions at build time; the gradients were allocated in the weights region.
        return (*base, WEIGHTS, OPTIMIZER)

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of the training state by memory tag (distinct storages): `base`, `weights`, `grads`, and
        the optimizer's as the backend tags it (pinned-host: `optimizer_tags`; torch_memory_saver:
        `optimizer`). For the memory plan and benchmarks."""
        optimizer: dict[str, Iterable[torch.Tensor]]
        if isinstance(self.backend, PinnedHostBackend):
            optimizer = {tag: source() for tag, source in self.optimizer_sources().items()}
        else:
            optimizer = {OPTIMIZER: self.optimizer_tensors()}
        sources: dict[str, Iterable[torch.Tensor]] = {
            BASE: self.frozen_tensors(),
            WEIGHTS: self.weight_tensors(),
            GRADS: self.grad_tensors(),
            **optimizer,
        }
        out = {}
        for tag, tensors in sources.items():
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            out[tag] = sum(storages.values())
        return out

    def _buffers(self) -> list[Any]:
        return [b for c in self.chunks for b in c.buffers + c.expert_parallel_buffers]

    # --- reference weights -----------------------------------------------------------------
    @contextmanager
    def reference_weights(self) -> Iterator[None]:
        """The reference weights in the model for the duration of the block; the trained ones after.

        The trained weights wait on the model's own device, in one transient copy of its
        weight buffers (a forward-only block needs far less memory than training does), and
        come back by a device-to-device copy; so the host holds the reference weights alone
        (`HostCopies`: one exact-size page-locked buffer), not a second set for the trained
        ones. Every copy runs on the current stream: no host sync.

        With LoRA the reference is the base model: the block runs with every adapter
        switched off, and nothing is copied.
        """
        if self.lora is not None and self.config.needs_reference:
            with adapters_disabled(self.module):
                yield
            return
        if self.reference is None:
            raise RuntimeError(
                "reference_weights: this model keeps no reference weights (use_kl_loss is off and kl_coef is 0)"
            )
        with torch.no_grad():
            weights = self.weight_tensors()
            kept = [t.clone() for t in weights]
            for param, host in zip(self.parameters(), self.reference, strict=True):
                param.copy_(host, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, trained in zip(weights, kept, strict=True):
                    t.copy_(trained)
            del kept

    # --- state -------------------------------------------------------------------------------
    def train_state(self) -> TrainState:
        """What a checkpoint saves and loads for this rank."""
        from megatron.core import parallel_state as mpu

        self.join_optimizer()

        metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if self.optim.uses_distributed_optimizer:
            # Megatron's "fully_sharded_model_space" default needs ShardedTensor.flattened_range,
            # which megatron-core 0.19 refuses; "dp_reshardable" is the format it supports.
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
            metadata["dp_cp_group"] = mpu.get_data_parallel_group(with_context_parallel=True)
        return TrainState(
            self.chunks,
            self.optim.optimizer,
            self.optim.scheduler,
            metadata,
            trained_only=self.lora is not None,
            optimizer_region=lambda: self.backend.region(OPTIMIZER),
        )

    @torch.no_grad()
    def snapshot(self) -> dict[str, torch.Tensor]:
        """CPU copies of this rank's weights, optimizer state and schedule position, by name."""
        self.join_optimizer()
        out: dict[str, torch.Tensor] = {
            f"weights/{name}": p.detach().to("cpu", copy=True) for name, p in self.module.named_parameters()
        }
        for i, tensor in enumerate(self.optim.state_tensors()):
            out[f"optimizer/{i}"] = tensor.detach().to("cpu", copy=True)
        out["scheduler/num_steps"] = torch.tensor(self.optim.scheduler.num_steps)
        return out


def build_trainee(config: WorkerConfig, role: Role, backend: MemoryBackend, *, on_gpu: bool) -> Trainee:
    """Build, load and wrap `role`'s model on this rank; weights and optimizer in their memory regions."""
    # Megatron-core: its modules load once the worker's process has its CPU path (`enable_cpu_compat`).
    from tandem.megatron.models.hf_weights import load_hf_checkpoint as load_hf
    from tandem.megatron.models.lora import apply_lora
    from tandem.megatron.models.networks import build_model

    spec = ModelSpec.from_hf(config.hf_checkpoint_of(role))
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    lora = config.lora_of(role)
    # A LoRA model's base gets a region of its own (torch_memory_saver): it never sleeps with the adapters.
    with backend.region(WEIGHTS if lora is None else BASE):
        model = build_model(
            spec,
            role,
            params_dtype=_params_dtype(config),
            seed=config.seed,
            fused_rope=config.fused_rope,
            fused_swiglu=config.fused_swiglu,
            packed_attention=config.packed_attention,
            vocab_multiple=config.make_vocab_size_divisible_by,
            **_jit_fusion_overrides(config.jit_fusions),
        )
        reference = None
        if role == "actor" and config.needs_reference and lora is None:
            load_hf(model, spec, config.ref_load or config.hf_checkpoint, role)
            reference = HostCopies(p.detach() for p in model.parameters())
        load_hf(model, spec, config.hf_checkpoint_of(role), role)
    with backend.region(WEIGHTS):
        if lora is not None:
            apply_lora(model, spec, lora, seed=config.seed)
        ddp = wrap_ddp(model, use_distributed_optimizer=on_gpu)
    with backend.region(OPTIMIZER):
        optim = build_optimizer([ddp], config, role)
    return Trainee(role, config, spec, [ddp], optim, device, backend, reference, lora)


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage, stable while the storage is resized (sleep frees it by resizing)."""
    return int(tensor.untyped_storage()._cdata)


def _jit_fusion_overrides(jit_fusions: bool) -> dict[str, Any]:
    """`TransformerConfig` fields that leave Megatron's compiled fusions out unless `jit_fusions`
    (the CPU never has them: `ModelSpec.transformer_config`)."""
    return {} if jit_fusions else {"bias_activation_fusion": False, "bias_dropout_fusion": False}
