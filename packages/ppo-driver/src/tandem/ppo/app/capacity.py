"""The memory a PPO run needs on each GPU and on the host, by arithmetic: what `--dry-run` says before a start.

`estimate` is the arithmetic of one run of a decoder's shape (full fine-tuning or LoRA, shared or
resident): in GiB, what a GPU holds at its peak, what the host holds, and the disk of its model
folder, with each limit it passes named (`Estimate.why_not`). `bench/capacity_bench.py` prints it
beside each measured row; `run_memory` reads it off a run's own config for `ppo-driver train --dry-run`.

The terms, per model of P parameters (docs/benchmarks.md, "Capacity" and "Capacity with LoRA"):

- full fine-tuning: bf16 weights (2 bytes a parameter), fp32 main gradients (4), fp32
  main parameters (4), Adam's two fp32 moments (8): 18 bytes awake; a sleep keeps all
  but the gradients on the host (14). The KL loss's reference weights: 2 bytes, on the host.
- LoRA: the frozen bf16 base (2 bytes a parameter, no gradient, no main copy, no
  optimizer state) and the adapters' own 18 bytes a parameter (rank r on each adapted
  linear layer: r · (in + out)); the reference is the base with the adapters off (nothing
  more). The base stays on the GPU while its model sleeps, unless `base_offload`
  (`--lora-base-offload`): then its host copy is made once, and with `base_share`
  (`--lora-base-share`) the critic's base (the actor's without its untied output layer) is the
  actor's host copy.
- the engine: bf16 weights on the GPU while it samples, and its KV cache (`kv_fraction` of the
  GPU: the most the engine takes; `run_estimate` takes what the rollout needs where that is
  less); on the host when released (shared), and with LoRA's adapter sync always (the base it
  merges each sync's adapters into).
- training activations of one micro batch, without recomputation: 34·s·b·h bytes a layer
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  eq. 2 without the attention scores, which flash attention never stores) and the actor's fp32
  logits with their log-softmax and gradient, 12·s·b·V bytes (the critic's value head has one
  output a token).
- a model split over tensor and pipeline parallelism holds 1/(TP·PP) of its states on each GPU,
  and 1/TP of a micro batch's activations; the engine's weights are on each GPU whole.

Shared: one role is awake at a time, the peak is the largest turn; resident: everything at once,
each train role's activations included (a resident process keeps its allocator's cache, so the
actor's and the critic's processes each hold their largest micro batch's). The arithmetic is a
floor: measured peaks were 1.2-1.4 times it (the start-up with every model loaded, temporaries,
the allocator's slack). Pure: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "Estimate",
    "Work",
    "activations_gib",
    "critic_params",
    "estimate",
    "kv_bytes_per_token",
    "kv_dim",
    "largest_terms",
    "lora_params",
    "lora_targets",
    "policy_params",
    "shape_of",
]

GIB = 1024**3
GPU_GIB = 140.0
"""The lent H200's memory: the bench's GPU where none is named."""
HOST_GIB = 128.0
DISK_GIB = 64.0
HOST_RESERVED_GIB = 8.0
"""What the host's own processes (Ray, the driver, the page cache's floor) keep; not the run's."""

FULL_BYTES_AWAKE = 2 + 4 + 4 + 8
FULL_BYTES_ASLEEP = 2 + 4 + 8
BF16 = 2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS: Mapping[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Megatron's fused names of the adapted layers (`--lora-target-modules` takes either)."""

SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)

Finetune = Literal["full", "lora"]
Mode = Literal["resident", "shared"]


def shape_of(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """A dense decoder's shape from its Hugging Face config.json; a ValueError naming what it lacks."""
    if hf_config.get("num_experts") or hf_config.get("num_local_experts"):
        raise ValueError("a mixture of experts: the arithmetic counts dense decoders only")
    missing = [k for k in SHAPE_KEYS if k not in hf_config and k != "num_key_value_heads"]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    shape = {k: int(hf_config.get(k) or hf_config["num_attention_heads"]) for k in SHAPE_KEYS}
    shape["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings", False))
    shape["attention_bias"] = bool(hf_config.get("attention_bias", hf_config.get("model_type") == "qwen2"))
    return shape


def kv_dim(shape: Mapping[str, Any]) -> int:
    """The width of a token's keys (or values) in one layer: the key-value heads times the head size."""
    return int(shape["num_key_value_heads"]) * (
        int(shape["hidden_size"]) // int(shape["num_attention_heads"])
    )


def kv_bytes_per_token(shape: Mapping[str, Any]) -> int:
    """A token's keys and values over every layer, in bf16."""
    return 2 * BF16 * int(shape["num_hidden_layers"]) * kv_dim(shape)


def policy_params(shape: Mapping[str, Any]) -> int:
    """Parameters of a Qwen2- or Llama-style decoder of this shape (biases on q, k, v where
    `attention_bias`, Qwen2's default; tied or untied head)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = kv_dim(shape)
    bias = h + 2 * kv if shape.get("attention_bias", True) else 0
    attn = h * h + 2 * h * kv + h * h + bias
    layer = attn + 3 * h * i + 2 * h
    embedding = shape["vocab_size"] * h
    head = 0 if shape.get("tie_word_embeddings", True) else embedding
    return int(embedding + n * layer + h + head)


def critic_params(shape: Mapping[str, Any]) -> int:
    """The critic of the same shape: the backbone and a scalar value head (`hidden -> 1`, with bias)."""
    h = shape["hidden_size"]
    untied_head = 0 if shape.get("tie_word_embeddings", True) else shape["vocab_size"] * h
    return policy_params(shape) - untied_head + h + 1


def lora_targets(names: tuple[str, ...] | None) -> tuple[str, ...]:
    """Hugging Face names of the adapted layers (`--lora-target-modules`: either names; None or `all-linear`: all)."""
    if not names or "all-linear" in names:
        return LORA_TARGETS
    out: list[str] = []
    for name in names:
        out += FUSED_TARGETS.get(name, (name,))
    return tuple(t for t in LORA_TARGETS if t in out)


def lora_params(shape: Mapping[str, Any], rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Adapter parameters of rank `rank` on each adapted linear layer of every decoder layer: r · (in + out)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = kv_dim(shape)
    sizes = {
        "q_proj": h + h,
        "k_proj": h + kv,
        "v_proj": h + kv,
        "o_proj": h + h,
        "gate_proj": h + i,
        "up_proj": h + i,
        "down_proj": i + h,
    }
    return int(rank * n * sum(sizes[t] for t in targets))


@dataclass(frozen=True)
class Work:
    """A step's shape: micro batches of `micro_batch` sequences of `seq_len` tokens, on a GPU of `gpu_gib`
    whose engine's KV cache takes `kv_fraction` of it (the bench's: 16 x 640 tokens, 10 % of an H200)."""

    micro_batch: int = 16
    seq_len: int = 640
    kv_fraction: float = 0.1
    gpu_gib: float = GPU_GIB
    kv_gib: float | None = None
    """The KV cache's GiB where it is known to be less than `kv_fraction` of the GPU (what a rollout needs)."""
    host_gib: float = HOST_GIB
    """The host's memory (the lent H200 host's 128 GiB by default)."""


@dataclass(frozen=True)
class Estimate:
    """One run by arithmetic (GiB); `why_not` names each limit passed, empty when it fits."""

    shape: str
    finetune: str
    mode: str
    params: int
    trained_params: int
    gpu_peak_gib: float
    host_gib: float
    disk_gib: float
    gpu_terms: dict[str, float]
    host_terms: dict[str, float]
    why_not: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def activations_gib(shape: Mapping[str, Any], work: Work, *, logits: bool = True) -> float:
    """One micro batch's training activations: 34·s·b·h bytes a layer and, for the actor (`logits`), 12·s·b·V
    for the logits; the critic's value head makes one figure a token."""
    tokens = work.seq_len * work.micro_batch
    layers = 34 * tokens * shape["hidden_size"] * shape["num_hidden_layers"]
    return float(layers + (12 * tokens * shape["vocab_size"] if logits else 0)) / GIB


@dataclass(frozen=True)
class _Role:
    """One train role's GiB on a GPU awake, on the host asleep (by term), and on the GPU asleep."""

    awake: float
    asleep: dict[str, float]
    stays: float
    trained: int


def _role(params: int, rank: int | None, adapters: int, base_offload: bool, split: int) -> _Role:
    if rank is None:
        state = FULL_BYTES_AWAKE * params / GIB / split
        return _Role(state, {"state": FULL_BYTES_ASLEEP * params / GIB / split}, 0.0, params)
    state = FULL_BYTES_AWAKE * adapters / GIB / split
    base = BF16 * params / GIB / split
    if base_offload:  # its host copy is made once; a sleep frees it, a wake copies it back
        return _Role(state + base, {"adapters": state, "base": base}, 0.0, adapters)
    return _Role(state, {"adapters": state}, base, adapters)


def estimate(
    name: str,
    shape: Mapping[str, Any],
    finetune: Finetune,
    mode: Mode,
    *,
    rank: int = 16,
    base_offload: bool = False,
    base_share: bool = False,
    work: Work | None = None,
    critic: bool = True,
    critic_rank: int | Literal["actor"] | None = "actor",
    targets: tuple[str, ...] = LORA_TARGETS,
    critic_targets: tuple[str, ...] | None = None,
    reference: bool = True,
    split: int = 1,
    activation_split: int = 1,
    engines: bool = True,
) -> Estimate:
    """The GPU's peak, the host's and the disk's GiB of one run (see the module docstring).

    `finetune` and `rank`: the actor's (and, by default, the critic's: `critic_rank` None trains it in full);
    `critic`: whether the run has one; `reference`: whether the KL needs reference log-probs (full
    fine-tuning keeps reference weights on the host); `split`: TP x PP, the ways each model's states are
    split over GPUs; `activation_split`: TP, the ways a micro batch's activations are; `engines`: whether the
    rollout engines share these GPUs (False: they have GPUs of their own, not counted here)."""
    work = work or Work()
    p_actor, p_critic = policy_params(shape), critic_params(shape)
    kv = (
        work.kv_fraction * work.gpu_gib
        if work.kv_gib is None
        else min(work.kv_gib, work.kv_fraction * work.gpu_gib)
    )
    act = activations_gib(shape, work) / activation_split
    critic_act = activations_gib(shape, work, logits=False) / activation_split
    engine = BF16 * p_actor / GIB
    actor_rank = rank if finetune == "lora" else None
    c_rank = actor_rank if critic_rank == "actor" else critic_rank
    roles = {
        "actor": _role(
            p_actor, actor_rank, lora_params(shape, rank, targets) if actor_rank else 0, base_offload, split
        )
    }
    if critic:
        c_adapters = (
            lora_params(shape, c_rank, critic_targets or targets) + shape["hidden_size"] + 1 if c_rank else 0
        )
        roles["critic"] = _role(p_critic, c_rank, c_adapters, base_offload, split)
    host: dict[str, float] = {}
    if actor_rank is None and reference:
        host["reference weights"] = BF16 * p_actor / GIB / split
    if (
        actor_rank is not None
    ):  # the engine merges each sync's adapters into its base, from a host copy made once
        host["engine's base"] = engine
    if base_share and base_offload and critic and actor_rank is not None and c_rank is not None:
        # One host copy of the two bases: the critic's maps the actor's (all of it but the untied head).
        roles["critic"].asleep["base"] = 0.0
    stays = {f"{r} base": m.stays for r, m in roles.items() if m.stays}
    if mode == "resident":
        gpu = {**stays, **{r: m.awake for r, m in roles.items()}}
        if engines:
            gpu |= {"engine weights": engine, "KV cache": kv}
        gpu["actor activations"] = act
        if critic:
            gpu["critic activations"] = critic_act
    else:
        # One turn at a time beside what stays: the engine's (weights and KV cache) or a model's training.
        turns = {"actor training": roles["actor"].awake + act}
        if engines:
            turns["engine weights + KV cache"] = engine + kv
        if critic:
            turns["critic training"] = roles["critic"].awake + critic_act
        largest = max(turns, key=lambda k: turns[k])
        gpu = {**stays, largest: turns[largest]}
        host |= {f"{r} {term}": gib for r, m in roles.items() for term, gib in m.asleep.items() if gib}
        if actor_rank is None and engines:
            host["engine weights"] = engine
    gpu_peak, host_total = sum(gpu.values()), sum(host.values())
    disk = BF16 * p_actor / GIB
    why = []
    if gpu_peak > work.gpu_gib:
        why.append(f"GPU: {gpu_peak:.0f} GiB of {work.gpu_gib:.0f} ({largest_terms(gpu)})")
    if host_total > work.host_gib - HOST_RESERVED_GIB:
        why.append(
            f"host: {host_total:.0f} GiB of {work.host_gib - HOST_RESERVED_GIB:.0f} ({largest_terms(host)})"
        )
    if disk > DISK_GIB / 2:
        why.append(
            f"disk: the {disk:.0f} GiB bf16 folder and its load need more than the {DISK_GIB:.0f} GiB disk"
        )
    return Estimate(
        shape=name,
        finetune=finetune,
        mode=mode,
        params=p_actor,
        trained_params=sum(m.trained for m in roles.values()),
        gpu_peak_gib=gpu_peak,
        host_gib=host_total,
        disk_gib=disk,
        gpu_terms=gpu,
        host_terms=host,
        why_not="; ".join(why),
    )


def largest_terms(terms: Mapping[str, float]) -> str:
    """The terms of at least 1 GiB, largest first: "actor training 53, engine weights 14"."""
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v >= 1)
