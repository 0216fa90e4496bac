"""Rollout engines: the embedded transformers engine, the SGLang adapter, and the group the driver uses.

`create_engine_group(hf_dir, placement_group, bundle_indices, ...)` starts one engine
actor per rollout bundle and returns an `EngineGroup`: `generate` splits prompts
across the engines in contiguous chunks and returns one `Generation` per prompt in
input order; `release_memory` / `resume_memory` by tag (`weights`, `kv_cache`);
weights reach each engine through its actor handle's `update_weights_from_tensors`
(HF-named CPU tensors, or an `ipc_payload(...)` of CUDA tensors when the actor rank
shares the engine's GPU). See docs/design.md, "Real components and how they start".

The lowest layer of tandem.ppo: it may import torch, transformers, Triton, Ray,
tandem-lifecycle and tandem.megatron's torch-free layers (`group.actors`,
`runtime`), never another part of tandem.ppo (tests/test_import_graph.py).
"""

from ._embedded import EmbeddedEngine, EngineMemoryReleasedError
from ._group import EngineDied, EngineError, EngineGroup, create_engine_group, derive_seed, split_contiguous
from ._options import EngineOptions
from ._protocol import MEMORY_TAGS, FinishReason, Generation, MemoryTag, RolloutEngine, SamplingParams
from ._sglang import INSTALL_HINT, SGLangEngine, SGLangUnavailableError
from ._weights import IpcPayload, ipc_payload

__all__ = [
    "INSTALL_HINT",
    "MEMORY_TAGS",
    "EmbeddedEngine",
    "EngineDied",
    "EngineError",
    "EngineGroup",
    "EngineMemoryReleasedError",
    "EngineOptions",
    "FinishReason",
    "Generation",
    "IpcPayload",
    "MemoryTag",
    "RolloutEngine",
    "SGLangEngine",
    "SGLangUnavailableError",
    "SamplingParams",
    "create_engine_group",
    "derive_seed",
    "ipc_payload",
    "split_contiguous",
]
