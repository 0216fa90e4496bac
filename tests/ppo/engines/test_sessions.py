"""An episode's KV kept between its turns (`generate(..., sessions=...)`): the next turn, prefilled only
where it is new, samples what a full prefill samples, also for rows dropped from the batch early."""

from __future__ import annotations

import pytest
import torch

from tandem.ppo.engines import EmbeddedEngine, EngineOptions, SamplingParams

from .conftest import random_prompts


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> EmbeddedEngine:
    return EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", sync_every=2))


def second_turns(first: list[list[int]], replies: list[list[int]], seed: int = 1) -> list[list[int]]:
    observations = random_prompts(len(first), seed=seed, min_len=1, max_len=6)
    return [p + r + o for p, r, o in zip(first, replies, observations, strict=True)]


def test_a_kept_session_samples_what_a_full_prefill_samples(engine: EmbeddedEngine) -> None:
    # 12 rows (more than the smallest batch bucket) with stop tokens, so that rows finish early and
    # are packed out of the batch: their KV is kept before their rows are reused.
    first = random_prompts(12, seed=3, min_len=3, max_len=12)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(5, 9, 17))
    sessions = [f"e{i}" for i in range(len(first))]
    replies = [g.token_ids for g in engine.generate(first, params, sessions)]
    assert len({len(r) for r in replies}) > 1  # rows ended at different steps
    assert engine.memory_stats()["sessions_gib"] > 0
    second = second_turns(first, replies)
    assert all(
        engine._sessions.reusable(s, p) == len(f) + len(r) - 1
        for s, p, f, r in zip(sessions, second, first, replies, strict=True)
    )
    kept = engine.generate(second, params, sessions)
    full = engine.generate(second, params)  # no sessions: the whole prompt prefilled
    assert [g.token_ids for g in kept] == [g.token_ids for g in full]
    for a, b in zip(kept, full, strict=True):
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4, rtol=1e-4)


def test_a_prompt_that_does_not_continue_its_session_is_prefilled_whole(engine: EmbeddedEngine) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    first = random_prompts(2, seed=5)
    engine.generate(first, params, ["a", "b"])
    other = random_prompts(2, seed=6, min_len=12, max_len=14)
    assert engine._sessions.reusable("a", other[0]) == 0
    kept = engine.generate(other, params, ["a", "b"])
    assert [g.token_ids for g in kept] == [g.token_ids for g in engine.generate(other, params)]


def test_sessions_end_with_the_episodes_and_with_the_kv_cache(engine: EmbeddedEngine) -> None:
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    engine.generate(random_prompts(2, seed=7), params, ["x", "y"])
    engine.end_sessions(["x"])
    assert engine._sessions.reusable("x", list(range(2, 40))) == 0 and len(engine._sessions) >= 1
    engine.release_memory(["kv_cache"])
    assert len(engine._sessions) == 0
    engine.resume_memory(["kv_cache"])
    with pytest.raises(ValueError, match="1 sessions for 2 prompts"):
        engine.generate(random_prompts(2), params, ["only-one"])
