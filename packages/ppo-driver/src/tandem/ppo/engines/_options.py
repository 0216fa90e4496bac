"""How an engine is built and run: one frozen, documented set of options for every engine kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EngineDtype = Literal["auto", "float32", "bfloat16"]
EngineDevice = Literal["auto", "cpu", "cuda"]
EngineOffload = Literal["pinned_host", "none"]
KvCacheBackend = Literal["torch", "torch_memory_saver"]


@dataclass(frozen=True)
class EngineOptions:
    """Options of a rollout engine; the embedded engine reads the first block, SGLang the `sglang_*` fields."""

    dtype: EngineDtype = "auto"
    """Weights and KV-cache dtype of the embedded engine; "auto": bfloat16 on CUDA, float32 on CPU."""

    device: EngineDevice = "auto"
    """Where the embedded engine runs; "auto": the actor's CUDA device when there is one, else the CPU."""

    max_context_len: int | None = None
    """Longest prompt + response, in tokens; None: the model config's `max_position_embeddings`.
    A longer prompt is refused (ValueError naming its index); a response stops (`length`) at the limit."""

    fused_decode: bool = True
    """Decode with the engine's fused step (Triton kernels around torch GEMMs on transformers' weights:
    fused add+RMSNorm, RoPE + KV-cache write, split-KV grouped-query attention, SiLU*up, a one-pass
    sampler; `_fused_decode.py`) instead of transformers' forward. Applies on CUDA to model types
    llama, qwen2 and mistral without sliding-window layers; elsewhere, or off, the engine decodes
    with transformers' code (the engine logs which). Samples from the same distribution with another
    random stream than the transformers path: the same seed gives the same tokens run to run, not the
    same tokens as with the option off. The prefill is transformers' forward either way."""

    cuda_graph: bool = True
    """Capture the decode step as CUDA graphs; CUDA only. The fused decode captures one graph per batch
    bucket; transformers' step one per batch bucket and KV-length bucket (`kv_block`)."""

    compile: bool = False
    """Compile transformers' decode step with `torch.compile` (no CUDA graphs of its own; `cuda_graph`
    still captures it). Costs a compilation per batch/KV-length bucket; off by default. Not used by
    the fused decode (`fused_decode`)."""

    kv_cache_memory_fraction: float = 0.3
    """At most this fraction of the device's total memory holds the KV cache; a batch that needs more
    is generated in successive waves. CUDA only (on CPU a batch is one wave)."""

    kv_cache_backend: KvCacheBackend = "torch"
    """Where the embedded engine's KV cache lives. `torch`: torch's allocator; a release frees it and drops
    the decode's CUDA graphs (they read its addresses), and the next generate captures them again.
    `torch_memory_saver`: one buffer in a torch_memory_saver region (tag `kv_cache`, no host copy); a
    release unmaps its physical memory and keeps its virtual addresses, a resume maps fresh memory at
    them, so the CUDA graphs stay valid and nothing is captured again. CUDA only; the engine's process
    starts with the saver's LD_PRELOAD hook (`create_engine_group` passes it). A released KV cache's
    contents are gone either way (sessions' kept KV included)."""

    kv_block: int = 128
    """The KV cache's length is a multiple of this many positions; transformers' decode step attends
    over buckets of it (a CUDA graph per bucket), so a step reads only about the keys written so far
    (the fused decode reads exactly those, whatever the bucket)."""

    sync_every: int = 8
    """Decode steps between the host's checks for finished sequences (the only host syncs of the loop):
    when all are done, generation ends; when few are left, they are packed into a smaller batch."""

    cpu_threads: int | None = None
    """Threads of torch's CPU kernels of an engine on the CPU (`torch.set_num_threads`); None: the
    process's setting. The driver passes its `cpu_threads`."""

    count_weight_changes: bool = True
    """Count, at each weight update, the elements of the weights that change (and those that ever
    changed since the engine loaded them), compared on the device as the update copies
    (`_weight_changes.py`; read by `weight_changes`). Costs one bit of device memory per weight element
    (moved with the weights when they are released) and a read of the old weights during the copy."""

    offload_backend: EngineOffload = "pinned_host"
    """Where released weights go: "pinned_host" (tandem.lifecycle's retained host buffers, back at
    link speed) or "none" (weights stay resident; only the KV cache is freed)."""

    adapter_sync: bool = False
    """The actor is a LoRA model that sends its adapters (`update_adapter_from_tensors`) instead of its
    whole weights: the engine's weights are its base, copied to the host once (a release then only frees
    them, a resume copies the base back), and each sync merges the adapters into the base exactly, from
    that copy (`_adapter_updates.py`). Embedded engine only."""

    request_timeout_s: float = 600.0
    """Seconds the group waits for an engine's answer (a generate, a weight update, a release) before
    raising an `EngineError` naming its rank."""

    startup_timeout_s: float = 900.0
    """Seconds the group waits for an engine to load its model (or an SGLang server to answer /health)."""

    sglang_urls: tuple[str, ...] = ()
    """SGLang: attach to these running servers (one per rollout bundle, in rank order) instead of
    launching them."""

    sglang_launch_args: tuple[str, ...] = ()
    """SGLang: extra arguments of `python -m sglang.launch_server` (e.g. "--mem-fraction-static", "0.3")."""

    sglang_base_port: int = 30000
    """SGLang: engine rank r's launched server listens on 127.0.0.1:(sglang_base_port + r)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"EngineOptions.dtype={self.dtype!r}: choose 'auto', 'float32' or 'bfloat16'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"EngineOptions.device={self.device!r}: choose 'auto', 'cpu' or 'cuda'")
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ValueError(
                f"EngineOptions.max_context_len={self.max_context_len}: must be at least 2 or None"
            )
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"EngineOptions.kv_cache_memory_fraction={self.kv_cache_memory_fraction}: must be in (0, 1]"
            )
        if self.kv_block < 1 or self.sync_every < 1:
            raise ValueError(
                f"EngineOptions.kv_block={self.kv_block}, sync_every={self.sync_every}: both must be >= 1"
            )
        if self.offload_backend not in ("pinned_host", "none"):
            raise ValueError(
                f"EngineOptions.offload_backend={self.offload_backend!r}: choose 'pinned_host' or 'none' "
                "(torch_memory_saver is not supported by the embedded engine)"
            )
        if self.kv_cache_backend not in ("torch", "torch_memory_saver"):
            raise ValueError(
                f"EngineOptions.kv_cache_backend={self.kv_cache_backend!r}: choose 'torch' or 'torch_memory_saver'"
            )
        if self.kv_cache_backend == "torch_memory_saver" and self.device == "cpu":
            raise ValueError(
                "EngineOptions.kv_cache_backend='torch_memory_saver' needs CUDA but device is 'cpu'; use 'torch'"
            )
        if self.request_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError(
                f"EngineOptions.request_timeout_s={self.request_timeout_s}, "
                f"startup_timeout_s={self.startup_timeout_s}: both must be positive"
            )
        if isinstance(self.sglang_urls, str) or isinstance(self.sglang_launch_args, str):
            raise ValueError(
                "EngineOptions.sglang_urls / sglang_launch_args: give a tuple of strings, not a str"
            )
