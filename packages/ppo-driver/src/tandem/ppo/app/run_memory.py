"""A run's memory by arithmetic, from its own config: what `ppo-driver train --dry-run` says, and a start warns of.

`run_estimate` reads `capacity.estimate`'s terms off a run's config (its model's config.json, its
micro-batches or tokens, its LoRA ranks and targets, its layout, the KV cache its rollout needs);
`memory_lines` says whether the run fits the GPU (`--gpu-memory-gib`, else this machine's first GPU)
and the host, and each flag that would make it fit where it does not; `start_warning` is those lines
where a start on GPUs would not fit. Pure but for nvidia-smi: no torch, no Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.ppo.app.capacity import (
    GIB,
    GPU_GIB,
    HOST_GIB,
    Estimate,
    Work,
    estimate,
    kv_bytes_per_token,
    largest_terms,
    lora_targets,
    shape_of,
)

if TYPE_CHECKING:
    from tandem.ppo.config.ppo_config import PPOConfig

__all__ = [
    "ENGINE_KV_FRACTION",
    "gpu_memory_gib",
    "host_memory_gib",
    "memory_lines",
    "run_estimate",
    "run_work",
    "start_warning",
]


ENGINE_KV_FRACTION = 0.3
"""The embedded engine's default most of the GPU its KV cache takes (`EngineOptions.kv_cache_memory_fraction`)."""


def run_work(config: PPOConfig, shape: Mapping[str, Any], gpu_gib: float, host_gib: float = HOST_GIB) -> Work:
    """The step's shape of `config`: its micro-batches (or tokens a micro-batch) and its engines' KV cache."""
    seq_len = config.max_prompt_len + config.rollout_max_response_len
    if config.use_dynamic_batch_size and config.max_tokens_per_gpu:
        micro_batch, seq_len = 1, config.max_tokens_per_gpu
    else:
        micro_batch = config.micro_batch_size
    samples = -(-config.rollout_batch_size * config.n_samples_per_prompt // max(1, config.num_engines))
    needed = (
        samples * (config.max_prompt_len + config.rollout_max_response_len) * kv_bytes_per_token(shape) / GIB
    )
    fraction = config.rollout_kv_cache_memory_fraction or ENGINE_KV_FRACTION
    return Work(micro_batch, seq_len, fraction, gpu_gib, kv_gib=needed, host_gib=host_gib)


def run_estimate(
    config: PPOConfig, shape: Mapping[str, Any], gpu_gib: float, host_gib: float = HOST_GIB
) -> Estimate:
    """`estimate` of `config`'s run on GPUs of `gpu_gib` and a host of `host_gib`: its LoRA settings, its mode
    (shared where the models sleep on the engines' GPUs, else resident), its layout and its step's shape."""
    tp, pp = config.topology("actor")
    lora = config.lora_rank is not None
    return estimate(
        str(config.hf_checkpoint),
        shape,
        "lora" if lora else "full",
        "shared" if config.colocate and config.offload_train else "resident",
        rank=config.lora_rank or 16,
        base_offload=config.lora_base_offload,
        base_share=config.shares_lora_base,
        work=run_work(config, shape, gpu_gib, host_gib),
        critic=config.use_critic and config.uses_critic,
        critic_rank=config.critic_lora_rank,
        targets=lora_targets(config.lora_target_modules),
        critic_targets=lora_targets(config.critic_lora_target_modules),
        reference=config.needs_reference,
        split=tp * pp,
        activation_split=tp,
        engines=config.colocate,
    )


def gpu_memory_gib() -> float | None:
    """The first visible GPU's memory from nvidia-smi (no CUDA context); None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return float(out.split()[0]) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def host_memory_gib() -> float:
    """This machine's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def _levers(config: PPOConfig, shape: Mapping[str, Any], gpu_gib: float, host_gib: float) -> list[str]:
    """The flags that each make the run fit where it does not, with the peaks they give: sleeping in turn, LoRA,
    the bases asleep too, and the largest smaller micro-batch (or tokens a micro-batch) that fits."""
    tries: list[tuple[str, dict[str, Any]]] = []
    if config.colocate and not config.offload_train:
        tries.append(("--offload-train (the models sleep in turn)", {"offload_train": True}))
    critic = config.use_critic and config.uses_critic
    lora = {"lora_rank": config.lora_rank or 16} | ({"critic_lora_rank": 16} if critic else {})
    if config.lora_rank is None or (critic and config.critic_lora_rank is None):
        flags = " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in lora.items() if getattr(config, k) is None
        )
        tries.append((f"{flags} (LoRA adapters on a frozen base)", lora))
        if config.colocate and not config.offload_train:
            tries.append((f"{flags} --offload-train", {**lora, "offload_train": True}))
    if config.lora_rank is not None and not config.lora_base_offload:
        tries.append(("--lora-base-offload (the bases sleep too)", {"lora_base_offload": True}))
    both = config.lora_rank is not None and critic and config.critic_lora_rank is not None
    if both and config.lora_base_offload and not config.shares_lora_base:
        tries.append(("--lora-base-share True (one host copy of the two bases)", {"lora_base_share": True}))
    if config.use_dynamic_batch_size and config.max_tokens_per_gpu:
        tokens = config.max_tokens_per_gpu // 2
        while tokens >= 256:
            tries.append((f"--max-tokens-per-gpu {tokens}", {"max_tokens_per_gpu": tokens}))
            tokens //= 2
    else:
        micro = config.micro_batch_size // 2
        while micro >= 1:
            tries.append((f"--micro-batch-size {micro}", {"micro_batch_size": micro}))
            micro //= 2
    fits: list[str] = []
    smaller = False  # of the smaller micro-batches (or tokens), the largest that fits
    for flags, changes in tries:
        est = run_estimate(replace(config, **changes), shape, gpu_gib, host_gib)
        if est.why_not or (smaller and flags.startswith(("--micro-batch-size", "--max-tokens-per-gpu"))):
            continue
        smaller = smaller or flags.startswith(("--micro-batch-size", "--max-tokens-per-gpu"))
        fits.append(f"{flags}: {est.gpu_peak_gib:.0f} GiB of GPU, {est.host_gib:.0f} of host")
    return fits


def memory_lines(
    config: PPOConfig, *, gpu_gib: float | None = None, host_gib: float | None = None
) -> list[str]:
    """What `--dry-run` says of the run's memory: the arithmetic's peaks, whether they fit the GPU (`gpu_gib`; by
    default `--gpu-memory-gib`, else this machine's first GPU) and the host, and the flags that make it fit."""
    folder = Path(config.hf_checkpoint)
    try:
        shape = shape_of(json.loads((folder / "config.json").read_text()))
    except FileNotFoundError:
        return [f"memory: no estimate: no {folder / 'config.json'} yet (a model the run builds at its start)"]
    except (ValueError, KeyError, OSError) as exc:
        return [f"memory: no estimate: {folder / 'config.json'}: {exc}"]
    gpu = gpu_gib or config.gpu_memory_gib or gpu_memory_gib()
    host = host_gib or host_memory_gib()
    est = run_estimate(config, shape, gpu or GPU_GIB, host)
    where = "each GPU" if config.colocate else "each train GPU (the engines have GPUs of their own)"
    lines = [
        f"memory, by arithmetic (a floor: measured peaks were 1.2-1.4 times it): {est.mode}, "
        f"{est.finetune} fine-tuning of {est.params / 1e9:.2f} B parameters; {where} at its peak "
        f"{est.gpu_peak_gib:.1f} GiB ({largest_terms(est.gpu_terms) or 'under 1 GiB each'}); the host "
        f"{est.host_gib:.1f} GiB"
    ]
    if gpu is None:
        lines.append("  no GPU here to judge it by: give --gpu-memory-gib for a verdict")
        return lines
    if not est.why_not:
        lines.append(
            f"  fits: {est.gpu_peak_gib:.0f} of {gpu:.0f} GiB of GPU, {est.host_gib:.0f} of {host:.0f} of host"
        )
        return lines
    lines.append(f"  does not fit: {est.why_not}")
    levers = _levers(config, shape, gpu, host)
    lines += [f"  fits with {lever}" for lever in levers] or [
        "  none of --offload-train, LoRA, smaller micro-batches fits"
    ]
    return lines


def start_warning(config: PPOConfig) -> list[str]:
    """What a start on GPUs says before Ray starts where the arithmetic, a floor, puts the run past its GPU's or
    its host's memory: `memory_lines` (the peaks, what stands in the way, the flags that fit); nothing where it
    fits, on a CPU run, or without a GPU to judge by."""
    if config.device == "cpu":
        return []
    lines = memory_lines(config)
    return lines if len(lines) > 1 and lines[1].startswith("  does not fit") else []
