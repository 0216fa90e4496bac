"""The embedded rollout engine: a Hugging Face transformers model driven by a static-cache decode loop.

The model code is transformers' own; the engine owns the loop around it:

- prompts are left-padded into one batch; the prefill writes a `StaticKVCache`;
- each decode step is, for Llama-family models on CUDA, the fused decode step
  (`_fused_decode.py`: Triton kernels around torch GEMMs, one CUDA graph per batch
  bucket, reading exactly the key positions written so far); otherwise one
  transformers forward pass of the last tokens with explicit positions and a ready
  4D mask, on CUDA replayed from a CUDA graph captured per (batch bucket,
  KV-length bucket), reading the key positions written so far rounded up to `kv_block`;
- sampling runs on the device with seeded random streams (`Draws`); the host syncs only every
  `sync_every` steps, to stop when all sequences are done and to pack the
  unfinished ones into a smaller batch bucket (finished sequences are dropped);
- release/resume: the weights go to retained host buffers through tandem.lifecycle
  (`PinnedHostBackend`) and the KV cache, CUDA graphs and their memory pool are freed; with
  `kv_cache_backend="torch_memory_saver"` a release of the KV cache alone unmaps its memory
  and keeps its addresses, and the CUDA graphs with them.

A batch's generation, wave by wave, is in `_decode_loop.py`, the forward passes, the
cache and the CUDA graphs in `_forward.py`, the weight updates in `_weight_updates.py`
and LoRA adapters merged into the base in `_adapter_updates.py` (mixins of
`EmbeddedEngine`).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.lifecycle import Lifecycle, NoopBackend, PinnedHostBackend
from tandem.megatron.runtime.fault_points import fault_point
from tandem.megatron.runtime.gpu_memory import process_gpu_bytes

from ._adapter_updates import AdapterUpdates
from ._decode_loop import DecodeLoop, check_params
from ._errors import EngineMemoryReleasedError
from ._fused_decode import DecodeOpsKind, build_fused_decoder
from ._kv_cache import StaticKVCache, register_attention
from ._options import EngineOptions
from ._protocol import MEMORY_TAGS, Generation, MemoryTag, SamplingParams
from ._sampling import Draws
from ._sessions import SessionKV
from ._weight_changes import ChangeCounter, weight_magnitudes

logger = logging.getLogger(__name__)


COUNTER_TAG = "weight_changes"
"""The memory backend's tag of the change counter's bitmask when the weights' tag is frozen (`adapter_sync`)."""


class EmbeddedEngine(AdapterUpdates, DecodeLoop):
    """A rollout engine on Hugging Face transformers (CPU or one CUDA device); see the module docstring.

    Args:
        hf_dir: a Hugging Face model folder (config + weights) of a causal LM.
        options: engine options; None: the defaults.
        memory_backend: where released weights go; None: built from `options.offload_backend`.
            Must offer `register(tag, tensors)` like tandem.lifecycle's `PinnedHostBackend`
            (tests pass one that fails on demand).
        decode_ops: None: the fused decode where `options.fused_decode` applies (CUDA, Triton);
            "reference" (tests): the fused decode on any device with its pure-torch operations.
        kv_backend: with `options.kv_cache_backend="torch_memory_saver"`, what holds the KV cache;
            None: tandem.lifecycle's `TorchMemorySaverBackend` without host copies (tests pass a
            stand-in with its `region`, `pause` and `resume`).
    """

    def __init__(
        self,
        hf_dir: str,
        options: EngineOptions | None = None,
        *,
        memory_backend: Any = None,
        decode_ops: DecodeOpsKind | None = None,
        kv_backend: Any = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.options = options = options or EngineOptions()
        self.device = _pick_device(options.device)
        if self.device.type == "cpu" and options.cpu_threads is not None:
            torch.set_num_threads(options.cpu_threads)
        self.dtype = _pick_dtype(options.dtype, self.device)
        model: Any = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=self.dtype)
        model.set_attn_implementation(register_attention())
        self.model = model.to(self.device).eval().requires_grad_(False)
        _own_storages(self.model)
        config = self.model.config
        self._vocab = int(config.vocab_size)
        self._num_layers = int(config.num_hidden_layers)
        self._kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self._head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        config_len = getattr(config, "max_position_embeddings", None)
        limit = options.max_context_len or config_len
        if limit is None:
            raise ValueError(
                f"{hf_dir}: the model config has no max_position_embeddings; set EngineOptions.max_context_len"
            )
        self._max_context_len = int(limit)
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        if sliding and window is not None and self._max_context_len > window:
            raise ValueError(
                f"{hf_dir}: the model has sliding-window layers (window {window}), which the embedded engine's "
                f"mask does not model; set EngineOptions.max_context_len <= {window}"
            )
        self._eos_ids = _eos_ids(self.model)
        self._params_by_name: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        # Before the memory backend sees the weights: the fused decode makes q/k/v (gate/up) views of one buffer.
        self._fused = build_fused_decoder(
            self.model, options=options, max_context_len=self._max_context_len, ops=decode_ops
        )
        self._changes = (
            ChangeCounter(self._params_by_name, self.device) if options.count_weight_changes else None
        )
        self._weights_magnitudes = (
            weight_magnitudes(self._params_by_name, self.dtype) if options.count_weight_changes else {}
        )
        self._update_seconds = 0.0

        if memory_backend is None:
            if options.offload_backend == "none":
                memory_backend = NoopBackend()
            else:
                memory_backend = PinnedHostBackend(self.device)
        # With adapter_sync the weights are the base, copied to the host once (`_adapter_updates`); the
        # change counter's bitmask, which every sync writes, is then a tag of its own that moves each time.
        self._weight_tags = (
            ["weights", COUNTER_TAG] if options.adapter_sync and self._changes is not None else ["weights"]
        )
        frozen = {"frozen": True} if options.adapter_sync else {}
        if hasattr(memory_backend, "register"):
            memory_backend.register("weights", self._weight_tensors, **frozen)
            if COUNTER_TAG in self._weight_tags:
                memory_backend.register(COUNTER_TAG, self._counter_tensors)
        self._base_copy: Any = None
        if options.adapter_sync:
            self._base_copy = memory_backend if isinstance(memory_backend, PinnedHostBackend) else None
            if self._base_copy is None:  # released weights stay put (or another backend): a copy of its own
                self._base_copy = PinnedHostBackend(self.device)
                self._base_copy.register("weights", self._weight_tensors, frozen=True)
        self._adapters: dict[str, Any] = {}
        self._merged: set[str] = set()
        self._lifecycle = Lifecycle(memory_backend, tags=self._weight_tags)
        self._kv_saver = None
        if options.kv_cache_backend == "torch_memory_saver":
            if kv_backend is None and self.device.type != "cuda":
                raise ValueError(
                    f"EngineOptions.kv_cache_backend='torch_memory_saver' needs CUDA; this engine runs on "
                    f"{self.device.type}; use 'torch'"
                )
            self._kv_saver = kv_backend if kv_backend is not None else _kv_saver()
        self._kv_paused = False  # the KV cache's memory unmapped, its addresses kept (`_kv_saver`)
        self._kv_released = False
        self._lock = threading.RLock()
        self._generate_calls = 0  # this process's, for `fault_points` (a test kills the n-th)

        self._cache: StaticKVCache | None = None
        self._sessions = SessionKV()
        self._last_cache_shape: tuple[int, int] | None = None
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._graph_pool: Any = None
        self._side_stream: Any = None
        self._decode_fn: Callable[[int, int], torch.Tensor] = self._decode_forward
        if options.compile:
            self._decode_fn = torch.compile(self._decode_forward, dynamic=False)
        # Static inputs of the decode step (CUDA graphs read these very tensors).
        self._ids = torch.zeros(0, 1, dtype=torch.long, device=self.device)
        self._start = torch.zeros(0, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self._arange = torch.zeros(0, dtype=torch.long, device=self.device)
        self._seed = torch.zeros(1, dtype=torch.long, device=self.device)
        self._temperature = torch.zeros(1, dtype=torch.float32, device=self.device)

    # -- facts -------------------------------------------------------------------------------------

    def max_context_len(self) -> int:
        """Longest prompt + response in tokens."""
        return self._max_context_len

    def health(self) -> bool:
        """True: the engine is alive and can serve once its memory is resumed."""
        return True

    def released_tags(self) -> list[MemoryTag]:
        """The memory tags released right now."""
        tags: list[MemoryTag] = []
        if self._lifecycle.asleep:
            tags.append("weights")
        if self._kv_released:
            tags.append("kv_cache")
        return tags

    def memory_stats(self) -> dict[str, float]:
        """GiB held on the device by this process's torch allocator, the KV cache's size, the GPU's whole
        memory (`total_gib`), what the driver attributes to the process (`process_gib`, context
        included; absent where nvidia-smi does not list the process, as in some containers), and on a GPU
        the process's `pid` (the memory plan tells the run's processes from others' by it)."""
        stats = {
            "kv_cache_gib": (self._cache.nbytes() if self._cache is not None else 0) / 2**30,
            "sessions_gib": self._sessions.nbytes() / 2**30,
        }
        if self.device.type == "cuda":
            stats["allocated_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
            stats["reserved_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
            stats["total_gib"] = torch.cuda.get_device_properties(self.device).total_memory / 2**30
            stats["pid"] = os.getpid()
            process = process_gpu_bytes()
            if process is not None:
                stats["process_gib"] = process / 2**30
        return stats

    # -- memory ------------------------------------------------------------------------------------

    def release_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Free the KV cache and/or put the weights on the host; returns once the memory is free. Idempotent."""
        chosen = _check_tags(tags)
        with self._lock:
            if "kv_cache" in chosen and not self._kv_released:
                self._sessions.end()
                if self._kv_saver is None:
                    self._drop_cache()
                elif self._cache is not None:
                    # Its physical memory goes, its addresses stay: the CUDA graphs over it stay valid.
                    self._kv_saver.pause("kv_cache")
                    self._kv_paused = True
                self._kv_released = True
            if "weights" in chosen and not self._lifecycle.asleep:
                self._drop_graphs()  # they point at the weights' storages, which move
                if self._fused is not None:
                    self._fused.release()
                self._lifecycle.sleep(self._weight_tags)
                self._adapters_released()
            self._empty_device_cache()

    def resume_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Bring the weights back (as they were) and/or re-allocate the KV cache. Idempotent."""
        chosen = _check_tags(tags)
        with self._lock:
            if "weights" in chosen and self._lifecycle.asleep:
                self._lifecycle.wake_up(self._weight_tags)
            if "kv_cache" in chosen and self._kv_released:
                self._kv_released = False
                if self._kv_paused:
                    assert self._kv_saver is not None and self._cache is not None
                    self._kv_saver.resume("kv_cache")
                    self._kv_paused = False
                    self._cache.zero()  # memory mapped afresh: anything, NaN included
                elif self._last_cache_shape is not None:
                    rows, length = self._last_cache_shape
                    self._ensure_cache(rows, length)

    def flush_cache(self) -> None:
        """Forget every session's kept KV (after a weight update it belongs to the old weights)."""
        with self._lock:
            self._sessions.end()

    def end_sessions(self, sessions: Sequence[str] | None = None) -> None:
        """Forget the kept KV of `sessions` (None: all): their episodes are over."""
        with self._lock:
            self._sessions.end(sessions)

    def shutdown(self) -> None:
        """Free the KV cache and CUDA graphs before the actor goes away."""
        with self._lock:
            self._sessions.end()
            if self._kv_paused:  # mapped again before its tensors are freed
                assert self._kv_saver is not None
                self._kv_saver.resume("kv_cache")
                self._kv_paused = False
            self._drop_cache()
            if self._fused is not None:
                self._fused.release()
            self._empty_device_cache()

    # -- generation ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        sessions: Sequence[str | None] | None = None,
    ) -> list[Generation]:
        """One response per prompt, in input order; see `SamplingParams` and `Generation`.

        `sessions`: a session id per prompt (None: none), whose KV the engine keeps for the session's
        next call, which then prefills only its new tokens (`_sessions`).
        """
        self._generate_calls += 1
        fault_point("engine.generate", call=self._generate_calls)
        with self._lock:
            released = self.released_tags()
            if released:
                raise EngineMemoryReleasedError(
                    f"generate: the engine's {released} memory is released; call resume_memory() first"
                )
            token_lists = self._check_prompts(prompts)
            check_params(params)
            if sessions is not None and len(sessions) != len(token_lists):
                raise ValueError(
                    f"generate: {len(sessions)} sessions for {len(token_lists)} prompts; give one each"
                )
            self._merge_kept_adapters()
            if not token_lists:
                return []
            if params.max_new_tokens == 0:
                return [Generation([], [], "length") for _ in token_lists]
            seed = params.seed if params.seed is not None else secrets.randbits(62)
            draws = Draws.from_seed(seed, self.device)
            self._temperature.fill_(params.temperature)
            results: list[Generation] = []
            with torch.no_grad():
                for lo, hi in self._waves(token_lists, params):
                    wave_sessions = None if sessions is None else list(sessions[lo:hi])
                    results.extend(self._generate_wave(token_lists[lo:hi], params, draws, wave_sessions))
            return results

    # -- device memory -------------------------------------------------------------------------------

    def _weight_tensors(self) -> list[torch.Tensor]:
        # The change counter's bitmask goes to the host and back with the weights it describes (in a tag
        # of its own beside a frozen base).
        counter = self._counter_tensors() if COUNTER_TAG not in self._weight_tags else []
        return [*self.model.parameters(), *self.model.buffers(), *counter]

    def _counter_tensors(self) -> list[torch.Tensor]:
        return self._changes.tensors() if self._changes is not None else []


def _kv_saver() -> Any:
    """torch_memory_saver's backend for the KV cache: no host copy (a released cache's contents are dropped)."""
    from tandem.lifecycle import TorchMemorySaverBackend

    return TorchMemorySaverBackend(enable_cpu_backup=False)


def _own_storages(model: torch.nn.Module) -> None:
    """Give every weight a storage of its own that can be freed (CPU weights may map the checkpoint file)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()


def _pick_device(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("EngineOptions.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _eos_ids(model: Any) -> list[int]:
    """The model's EOS token ids (generation config first, then the model config)."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
    return []


def _check_tags(tags: Sequence[str]) -> list[str]:
    if isinstance(tags, str):
        tags = [tags]
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"memory tags {unknown}: choose among {list(MEMORY_TAGS)}")
    return list(tags)
