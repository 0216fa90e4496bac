"""The optimizer side of a train worker: DDP wrapping, the Megatron optimizer, the LR schedule, clipping.

On the GPU the model trains with Megatron's distributed optimizer (fp32 main
weights and Adam state sharded over the data-parallel group) and Megatron clips
the gradients. On the CPU Megatron's distributed optimizer and its clipping
helpers are not usable, so the plain Megatron optimizer steps the fp32 model
weights and `clip_grad_norm_` here clips the gradient buffers first. Either way
Megatron's DDP wrapper owns the flat gradient buffers (summed over micro-batches,
averaged over data-parallel ranks by `finalize_model_grads`), and the
learning rate follows Megatron's `OptimizerParamScheduler`, one step per
optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.megatron.config import Role, WorkerConfig
from tandem.megatron.models._cpu_compat import cpu_compat_active, enable_cpu_compat


def wrap_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool) -> Any:
    """Wrap this rank's model in Megatron's DDP: flat fp32 gradient buffers, averaged over data parallel.

    Also sets the model config's hooks that Megatron's pipeline schedule calls
    (`finalize_model_grads_func`, `no_sync_func`).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    enable_cpu_compat()  # Megatron's DDP calls torch.cuda.current_stream()
    config: Any = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer,
        # One bucket per buffer: fewer, larger collectives; overlap is off anyway.
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = None
    config.param_sync_func = None
    return ddp


@dataclass
class OptimizerBundle:
    """The optimizer and LR schedule of one role on one rank, and how it steps.

    Attributes:
        optimizer: Megatron optimizer (distributed on the GPU, plain on the CPU).
        scheduler: Megatron's OptimizerParamScheduler.
        clip_grad: global gradient-norm bound; 0 means no clipping.
        clip_here: whether `step` clips itself (CPU) instead of Megatron (GPU).
    """

    optimizer: Any
    scheduler: Any
    clip_grad: float
    clip_here: bool

    def zero_grad(self, model_chunks: Sequence[Any]) -> None:
        """Zero the DDP gradient buffers and the optimizer's grads before an optimizer step."""
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, model_chunks: Sequence[Any]) -> tuple[float, float]:
        """One optimizer step on the reduced gradients; returns (grad norm before clipping, lr used)."""
        lr = self.lr
        own_norm = clip_grad_norm_(model_chunks, self.clip_grad) if self.clip_here else None
        success, megatron_norm, _ = self.optimizer.step()
        if not success:
            raise RuntimeError("the optimizer step failed (inf/nan gradients)")
        self.scheduler.step(increment=1)
        norm = own_norm if own_norm is not None else megatron_norm
        return (float("nan") if norm is None else float(norm)), lr

    @property
    def uses_distributed_optimizer(self) -> bool:
        """Whether Megatron's distributed optimizer (GPU) steps; the plain one (CPU) clips here."""
        return not self.clip_here

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors the optimizer owns: main (fp32) weight copies and Adam state, each once.

        Evaluated lazily so that state created at the first step is included. On
        the CPU the plain optimizer's parameters are the model's own weights, which
        the weights tag already covers; the caller removes those.
        """
        return _distinct(self._tensors(params=True, state=True))

    def main_param_tensors(self) -> Iterator[torch.Tensor]:
        """The inner torch optimizers' parameters: the distributed optimizer's fp32 main weights (GPU),
        the model's own weights on the CPU (the caller removes what the weights tag holds)."""
        return _distinct(self._tensors(params=True, state=False))

    def moment_tensors(self) -> Iterator[torch.Tensor]:
        """The optimizer's per-parameter state (Adam's `exp_avg`, `exp_avg_sq`), each once; lazily, so
        that the state the first step creates is included."""
        return _distinct(self._tensors(params=False, state=True))

    def _tensors(self, *, params: bool, state: bool) -> Iterator[Any]:
        for inner in inner_torch_optimizers(self.optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    if params:
                        yield param
                    if state:
                        yield from inner.state.get(param, {}).values()


def _distinct(tensors: Iterator[Any]) -> Iterator[torch.Tensor]:
    """The tensors among `tensors`, each once; 0-dim entries (Adam's step count) live on the host and are
    not state to move."""
    seen: set[int] = set()
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The Megatron optimizers that make up `optimizer`: each part of a chained one, else itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def inner_torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (each part of a chained one), which hold the state."""
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if inner is not None:
            yield inner


def step_fused(optimizer: torch.optim.Optimizer) -> None:
    """Have torch's Adam/AdamW `optimizer` step through its fused kernel, also after a `load_state_dict`.

    megatron-core builds torch's AdamW without Apex or Transformer Engine, with torch's default
    implementation: on the CPU that is a Python loop over the parameters. The fused kernel (torch 2.4+ has
    one for the CPU) computes the same update: a step of SmolLM2-135M's 134.5 M parameters took 92 ms
    against the loop's 468 ms on two cores (`./uvw run python bench/cpu_optimizer_bench.py --threads 2`).
    A checkpoint's param groups carry the implementation they were saved with, so a load sets the fused
    one again.
    """

    def fused(opt: torch.optim.Optimizer) -> None:
        opt.defaults.update(fused=True, foreach=False)
        for group in opt.param_groups:
            group.update(fused=True, foreach=False)

    fused(optimizer)
    optimizer.register_load_state_dict_post_hook(fused)


def build_optimizer(model_chunks: Sequence[Any], config: WorkerConfig, role: Role) -> OptimizerBundle:
    """The Megatron optimizer and LR schedule of `role` for DDP-wrapped `model_chunks`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    on_gpu = not cpu_compat_active()
    if on_gpu:
        check_one_param_dtype(model_chunks)
    lr = config.lr_of(role)
    bf16 = config.params_dtype == "bfloat16"
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min(config.min_lr, lr),
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=on_gpu,
        # Megatron's clipping helpers are CUDA-only; on the CPU `clip_grad_norm_` clips.
        clip_grad=config.clip_grad if on_gpu else 0.0,
    )
    optimizer = get_megatron_optimizer(optimizer_config, list(model_chunks), use_gloo_process_groups=False)
    if not on_gpu:  # the CPU's plain optimizer: torch's AdamW, fused (the GPU keeps megatron-core's choice)
        for inner in inner_torch_optimizers(optimizer):
            step_fused(inner)
    warmup = config.lr_warmup_steps
    if config.lr_decay_steps is None:
        decay_steps, decay_style = warmup + 1, "constant"
    else:
        decay_steps, decay_style = config.lr_decay_steps, config.lr_decay_style
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else lr,
        max_lr=lr,
        min_lr=min(config.min_lr, lr),
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        # On resume the schedule comes from this config; the checkpoint gives only the step count.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    return OptimizerBundle(optimizer, scheduler, config.clip_grad, clip_here=not on_gpu)


def check_one_param_dtype(model_chunks: Sequence[Any]) -> None:
    """Refuse trainable parameters of more than one dtype, which Megatron's distributed optimizer mishandles.

    In each param group it lists the fp32 parameters first and the bf16 ones
    after, but looks a parameter's main weight and Adam state up by its place in
    the gradient buffers; with both dtypes in one group the two orders differ, and
    checkpoints pair state with the wrong parameter (megatron-core 0.19). Models
    from `build_model` store every parameter in `params_dtype`.
    """
    by_dtype: dict[torch.dtype, list[str]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                by_dtype.setdefault(param.dtype, []).append(name)
    if len(by_dtype) > 1:
        listed = "; ".join(
            f"{dtype}: {names[:3]}{' ...' if len(names) > 3 else ''}" for dtype, names in by_dtype.items()
        )
        raise ValueError(
            f"the model's trainable parameters have {len(by_dtype)} dtypes ({listed}); Megatron's "
            "distributed optimizer needs one: cast every parameter to params_dtype before building "
            "the optimizer"
        )


@torch.no_grad()
def grad_norm(model_chunks: Sequence[Any]) -> float:
    """Global L2 norm of the (already data-parallel-reduced) gradients over all ranks of the model.

    Each parameter counts once: tensor-parallel duplicates and the shared copy of
    tied embeddings are skipped, and the sum of squares is all-reduced over the
    model-parallel (TP x PP) group.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    total = torch.zeros((), dtype=torch.float64)
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None or not param.requires_grad:
                continue
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                # Summed in float64 as read, no float64 copy of the gradient (bench/cpu_optimizer_bench.py).
                total += torch.linalg.vector_norm(grad.detach(), dtype=torch.float64).square().cpu()
    device = next(iter(model_chunks[0].parameters())).device
    total = total.to(device)
    torch.distributed.all_reduce(total, group=mpu.get_model_parallel_group())
    return math.sqrt(float(total))


@torch.no_grad()
def clip_grad_norm_(model_chunks: Sequence[Any], max_norm: float) -> float:
    """Scale the DDP gradient buffers so the global norm is at most `max_norm`; returns the norm before.

    `max_norm` 0 measures without clipping.
    """
    norm = grad_norm(model_chunks)
    if max_norm > 0 and math.isfinite(norm):
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            for chunk in model_chunks:
                for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                    buffer.grad_data.mul_(coefficient)
    return norm
