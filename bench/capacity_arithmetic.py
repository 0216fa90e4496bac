"""The memory a PPO run of a Qwen2.5 shape needs on one GPU, by arithmetic: full fine-tuning or LoRA, shared or resident.

`estimate(shape, finetune, mode)` says, in GiB, what the GPU holds at its peak, what
the host holds, and what the run's model folder takes on disk, and names each limit
it passes (`why_not`). It prints beside each measured row of `capacity_bench.py`, and
stands alone for a shape too big to try. The terms, per model of P parameters:

- full fine-tuning: bf16 weights (2 bytes a parameter), fp32 main gradients (4), fp32
  main parameters (4), Adam's two fp32 moments (8): 18 bytes awake; a sleep keeps all
  but the gradients on the host (14). The KL loss's reference weights: 2 bytes, on the host.
- LoRA: the frozen bf16 base (2 bytes a parameter, no gradient, no main copy, no
  optimizer state) and the adapters' own 18 bytes a parameter (rank r on q, k, v, o,
  gate, up and down: r · (in + out) each); the reference is the base with the adapters
  off (nothing more). The base stays on the GPU while its model sleeps, unless
  `base_offload` (`--lora-base-offload`): then its host copy is made once.
- the engine: bf16 weights on the GPU while it samples, and its KV cache
  (`kv_fraction` of the GPU); on the host when released (shared), and with LoRA's
  adapter sync always (the base it merges each sync's adapters into).
- training activations of one micro batch, without recomputation: 34·s·b·h bytes a layer
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 2 without the attention scores, which flash attention never stores) and
  the actor's fp32 logits with their log-softmax and gradient, 12·s·b·V bytes (the
  critic's value head has one output a token).

Shared: one role is awake at a time, the peak is the largest turn; resident: everything
at once, each train role's activations included (a resident process keeps its allocator's
cache, so the actor's and the critic's processes each hold their largest micro batch's: on one
H100 the 1.5B LoRA resident row's two train processes held 36 and 34 GiB, bases and activations,
when it ran out of memory). Limits: the H200's 140 GiB, the host's 128 GiB and the 64 GiB disk of the lent
H200 host (`GPU_GIB`, `HOST_GIB`, `DISK_GIB`); another GPU's memory as `Work.gpu_gib`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

GIB = 1024**3
GPU_GIB = 140.0
HOST_GIB = 128.0
DISK_GIB = 64.0
HOST_RESERVED_GIB = 8.0
"""What the host's own processes (Ray, the driver, the page cache's floor) keep; not the run's."""

FULL_BYTES_AWAKE = 2 + 4 + 4 + 8
FULL_BYTES_ASLEEP = 2 + 4 + 8
BF16 = 2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Finetune = Literal["full", "lora"]
Mode = Literal["resident", "shared"]


def policy_params(shape: dict[str, Any]) -> int:
    """Parameters of a Qwen2-style decoder of this shape (attention biases on q, k, v; tied or untied head)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv_dim = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    attn = h * h + h + 2 * (h * kv_dim + kv_dim) + h * h
    layer = attn + 3 * h * i + 2 * h
    embedding = shape["vocab_size"] * h
    head = 0 if shape.get("tie_word_embeddings", True) else embedding
    return embedding + n * layer + h + head


def critic_params(shape: dict[str, Any]) -> int:
    """The critic of the same shape: the backbone and a scalar value head (`hidden -> 1`, with bias)."""
    h = shape["hidden_size"]
    untied_head = 0 if shape.get("tie_word_embeddings", True) else shape["vocab_size"] * h
    return policy_params(shape) - untied_head + h + 1


def lora_params(shape: dict[str, Any], rank: int) -> int:
    """Adapter parameters of rank `rank` on every attention and MLP linear layer: r · (in + out) each."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv_dim = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    per_layer = (h + h) + 2 * (h + kv_dim) + (h + h) + 3 * (h + i)
    return rank * n * per_layer


@dataclass(frozen=True)
class Work:
    """The bench's step: micro batches of `micro_batch` sequences of `seq_len` tokens, on a GPU of `gpu_gib`
    (the engine's KV cache takes `kv_fraction` of it)."""

    micro_batch: int = 16
    seq_len: int = 640
    kv_fraction: float = 0.1
    gpu_gib: float = GPU_GIB


@dataclass(frozen=True)
class Estimate:
    """One shape's run by arithmetic (GiB); `why_not` names each limit passed, empty when it fits."""

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


def activations_gib(shape: dict[str, Any], work: Work, *, logits: bool = True) -> float:
    """One micro batch's training activations: 34·s·b·h bytes a layer and, for the actor (`logits`), 12·s·b·V
    for the logits; the critic's value head makes one figure a token."""
    tokens = work.seq_len * work.micro_batch
    layers = 34 * tokens * shape["hidden_size"] * shape["num_hidden_layers"]
    return (layers + (12 * tokens * shape["vocab_size"] if logits else 0)) / GIB


def estimate(
    name: str,
    shape: dict[str, Any],
    finetune: Finetune,
    mode: Mode,
    *,
    rank: int = 16,
    base_offload: bool = False,
    work: Work | None = None,
) -> Estimate:
    """The GPU's peak, the host's and the disk's GiB of one run (see the module docstring)."""
    work = work or Work()
    p_actor, p_critic = policy_params(shape), critic_params(shape)
    kv = work.kv_fraction * work.gpu_gib
    act, critic_act = activations_gib(shape, work), activations_gib(shape, work, logits=False)
    engine = BF16 * p_actor / GIB
    if finetune == "full":
        trained = p_actor + p_critic
        # What each model holds awake (all of it moves at a sleep), what stays on the GPU asleep.
        awake = {"actor": FULL_BYTES_AWAKE * p_actor / GIB, "critic": FULL_BYTES_AWAKE * p_critic / GIB}
        stays: dict[str, float] = {}
        host = {"reference weights": BF16 * p_actor / GIB}
        asleep = {
            "actor state": FULL_BYTES_ASLEEP * p_actor / GIB,
            "critic state": FULL_BYTES_ASLEEP * p_critic / GIB,
        }
        asleep["engine weights"] = engine
    else:
        adapters = lora_params(shape, rank)
        trained = 2 * adapters + shape["hidden_size"] + 1
        state = FULL_BYTES_AWAKE * adapters / GIB
        bases = {"actor base": BF16 * p_actor / GIB, "critic base": BF16 * p_critic / GIB}
        awake = {"actor": state, "critic": state}
        # The engine merges each sync's adapters into its base, from a host copy made once.
        host = {"engine's base": engine}
        asleep = {"actor adapters": state, "critic adapters": state}
        if base_offload:  # each base's host copy is made once; a sleep frees it, a wake copies it back
            awake = {"actor": state + bases["actor base"], "critic": state + bases["critic base"]}
            stays = {}
            asleep |= bases
        else:
            stays = bases
    if mode == "resident":
        gpu = {**stays, **awake, "engine weights": engine, "KV cache": kv}
        gpu |= {"actor activations": act, "critic activations": critic_act}
    else:
        # One turn at a time beside what stays: the engine's (weights and KV cache) or a model's training.
        turns = {
            "engine weights + KV cache": engine + kv,
            "actor training": awake["actor"] + act,
            "critic training": awake["critic"] + critic_act,
        }
        largest = max(turns, key=lambda k: turns[k])
        gpu = {**stays, largest: turns[largest]}
        host = {**host, **asleep}
    gpu_peak, host_total = sum(gpu.values()), sum(host.values())
    disk = BF16 * p_actor / GIB
    why = []
    if gpu_peak > work.gpu_gib:
        why.append(f"GPU: {gpu_peak:.0f} GiB of {work.gpu_gib:.0f} ({_largest(gpu)})")
    if host_total > HOST_GIB - HOST_RESERVED_GIB:
        why.append(f"host: {host_total:.0f} GiB of {HOST_GIB - HOST_RESERVED_GIB:.0f} ({_largest(host)})")
    if disk > DISK_GIB / 2:
        why.append(
            f"disk: the {disk:.0f} GiB bf16 folder and its load need more than the {DISK_GIB:.0f} GiB disk"
        )
    return Estimate(
        shape=name,
        finetune=finetune,
        mode=mode,
        params=p_actor,
        trained_params=trained,
        gpu_peak_gib=gpu_peak,
        host_gib=host_total,
        disk_gib=disk,
        gpu_terms=gpu,
        host_terms=host,
        why_not="; ".join(why),
    )


def _largest(terms: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v >= 1)
