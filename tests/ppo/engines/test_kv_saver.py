"""The embedded engine's KV cache at fixed addresses (`kv_cache_backend="torch_memory_saver"`).

On the CPU a stand-in of tandem.lifecycle's `TorchMemorySaverBackend` (its `region`, `pause`
and `resume`) checks the engine's side: the cache is one buffer built inside the region, a
release of the KV cache alone pauses it and keeps the cache and the decode's CUDA graphs (an
entry put in their table stands for them), a resume maps it again and zeroes it, and the next
generation gives the same tokens; with torch's allocator the same release drops both. On a GPU
the real saver runs in a process started with its hook (`_scripts/kv_saver_check.py`): the
memory comes back at a release, the graphs are the same objects after a resume, nothing is
captured again, and the tokens are the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.ppo.engines import EmbeddedEngine, EngineMemoryReleasedError, EngineOptions, SamplingParams
from tandem.ppo.engines._kv_cache import ONE_BUFFER_ALIGN, ONE_BUFFER_MIN_BYTES, StaticKVCache

from .conftest import random_prompts

SAVER = EngineOptions(device="auto", kv_cache_backend="torch_memory_saver")


class StandInSaver:
    """What the engine asks of torch_memory_saver's backend, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.inside: str | None = None

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        self.calls.append(("region", tag))
        self.inside = tag
        try:
            yield
        finally:
            self.inside = None

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))


def test_a_kv_only_release_keeps_the_cache_and_the_graphs_and_gives_the_same_tokens(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = StandInSaver()
    built_in: list[str | None] = []
    original = StaticKVCache.__init__

    def recording(self: StaticKVCache, **kwargs: object) -> None:
        built_in.append(saver.inside)
        assert kwargs["one_buffer"] is True
        original(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StaticKVCache, "__init__", recording)
    engine = EmbeddedEngine(tiny_llama_dir, SAVER, kv_backend=saver)
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    first = engine.generate(prompts, params)
    cache = engine._cache
    assert cache is not None and cache.buffer is not None and built_in == ["kv_cache"]
    graphs = {(8, 0): object()}  # stands for the decode's captured graphs (CUDA only)
    engine._graphs.update(graphs)

    engine.release_memory(["kv_cache"])
    assert saver.calls[-1] == ("pause", "kv_cache") and engine.released_tags() == ["kv_cache"]
    assert engine._cache is cache and engine._graphs == graphs, "addresses kept: cache and graphs stay"
    with pytest.raises(EngineMemoryReleasedError):
        engine.generate(prompts, params)
    engine.release_memory(["kv_cache"])  # idempotent: no second pause
    assert [c for c in saver.calls if c[0] == "pause"] == [("pause", "kv_cache")]

    cache.buffer.fill_(float("nan"))  # what memory mapped afresh may hold
    engine.resume_memory(["kv_cache"])
    assert saver.calls[-1] == ("resume", "kv_cache") and engine.released_tags() == []
    assert engine._cache is cache and not cache.buffer.isnan().any() and not cache.buffer.any()
    engine._graphs.clear()  # the stand-ins are no graphs to replay
    again = engine.generate(prompts, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    assert built_in == ["kv_cache"], "nothing built again"

    # A longer batch grows the cache: built again, inside the region.
    engine.generate(random_prompts(12, seed=6, min_len=20, max_len=30), params)
    assert built_in == ["kv_cache", "kv_cache"] and engine._cache is not cache

    # A release of the weights too moves them (new addresses): the graphs go, as with torch's allocator.
    engine._graphs.update(graphs)
    engine.release_memory()
    assert engine._graphs == {} and engine.released_tags() == ["weights", "kv_cache"]
    engine.resume_memory()
    assert engine.released_tags() == []
    engine.shutdown()


def test_with_torchs_allocator_a_kv_release_drops_the_cache_and_the_graphs(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    engine.generate(random_prompts(4, seed=5), SamplingParams(max_new_tokens=3, seed=1))
    assert engine._cache is not None and engine._cache.buffer is None
    engine._graphs[(8, 0)] = object()
    engine.release_memory(["kv_cache"])
    assert engine._cache is None and engine._graphs == {}


def test_one_buffer_takes_whole_segments_and_its_views_are_the_layers() -> None:
    cache = StaticKVCache(
        num_layers=3, rows=2, kv_heads=2, length=8, head_dim=4, dtype=torch.bfloat16,
        device=torch.device("cpu"), one_buffer=True,
    )  # fmt: skip
    assert cache.buffer is not None
    nbytes = cache.buffer.numel() * cache.buffer.element_size()
    assert nbytes >= ONE_BUFFER_MIN_BYTES and nbytes % ONE_BUFFER_ALIGN == 0
    for i, t in enumerate((*cache.keys, *cache.values)):
        assert t.shape == (2, 2, 8, 4) and t.is_contiguous()
        assert t.data_ptr() == cache.buffer.data_ptr() + i * t.numel() * t.element_size()
    cache.keys[1].fill_(1.0)
    cache.zero()
    assert not cache.buffer.any()


def test_the_option_needs_cuda_and_names_itself(tiny_llama_dir: str) -> None:
    with pytest.raises(
        ValueError, match="kv_cache_backend='torch_memory_saver' needs CUDA but device is 'cpu'"
    ):
        EngineOptions(device="cpu", kv_cache_backend="torch_memory_saver")
    with pytest.raises(ValueError, match="kv_cache_backend="):
        EngineOptions(kv_cache_backend="vmm")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA; this engine runs on cpu"):
            EmbeddedEngine(tiny_llama_dir, SAVER)


@pytest.mark.gpu
def test_on_a_gpu_the_released_memory_comes_back_and_the_graphs_are_not_captured_again(
    tmp_path: Path,
) -> None:
    from tandem.lifecycle import torch_memory_saver_env

    script = Path(__file__).parent / "_scripts" / "kv_saver_check.py"
    env = dict(os.environ, **torch_memory_saver_env())
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(
        next(x for x in out.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT ")
    )
    kv_gib = report["kv_cache_gib"]
    assert kv_gib > 0.5, report
    # The KV cache's physical memory is handed back, and mapped again at the resume.
    assert report["freed_at_release_gib"] > 0.9 * kv_gib, report
    assert report["taken_at_resume_gib"] > 0.9 * kv_gib, report
    assert report["same_graphs"] and report["graphs"] >= 1, report
    assert report["same_tokens"], report
    # The torch allocator's engine, for the contrast: its graphs were captured again.
    assert not report["torch_same_graphs"], report
