"""The engine group on a local Ray with logical GPUs: input order, seeds, bad prompts, dead and stuck engines,
and engines that die and are restarted on their bundle (up to `max_restarts`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.ppo.engines import (
    EmbeddedEngine,
    EngineError,
    EngineGroup,
    EngineOptions,
    SamplingParams,
    create_engine_group,
    derive_seed,
    split_contiguous,
)

from .conftest import random_prompts

pytestmark = pytest.mark.slow


def kill_and_wait(handle: Any, timeout_s: float = 60.0) -> None:
    """`ray.kill` the engine, then wait until a call to it fails.

    The kill is asynchronous: a call made at once can still reach the living actor
    (then nothing died as far as the group could tell, and a test of what follows a
    death tests nothing).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.released_tags.remote(), timeout=10)
        except RayActorError:
            return
        except GetTimeoutError:
            continue
        time.sleep(0.05)
    raise AssertionError(f"the killed engine still answers after {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def engine_bundles(module_ray_job: str) -> Iterator[Any]:
    """Two bundles of one logical GPU each, in this module's job of the session's Ray cluster."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        yield pg
    finally:
        remove_placement_group(pg)


@pytest.fixture(scope="module")
def group(engine_bundles: Any, tiny_llama_dir: str) -> Iterator[EngineGroup]:
    options = EngineOptions(device="cpu", max_context_len=32, request_timeout_s=120)
    engines = create_engine_group(
        tiny_llama_dir,
        engine_bundles,
        [0, 1],
        num_gpus_per_engine=0.5,
        num_cpus_per_engine=0.25,
        options=options,
    )
    try:
        yield engines
    finally:
        engines.shutdown()


def test_split_is_contiguous_and_balanced() -> None:
    assert split_contiguous(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_contiguous(1, 2) == [(0, 1), (1, 1)]
    assert derive_seed(5, 0) != derive_seed(5, 1)


def test_results_come_back_in_input_order(group: EngineGroup, tiny_llama_dir: str) -> None:
    assert len(group.handles) == 2 and group.max_context_len == 32
    prompts = random_prompts(21, seed=20)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    gens = group.generate(prompts, params)
    # Each prompt's greedy response, computed alone by a local engine, is the one at its index.
    local = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    expected = [local.generate([p], params)[0].token_ids for p in prompts]
    assert [g.token_ids for g in gens] == expected


def test_a_seed_reproduces_the_group_samples(group: EngineGroup, tiny_llama_dir: str) -> None:
    prompts = random_prompts(10, seed=21)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=77, ignore_eos=True)
    first = group.generate(prompts, params)
    assert [g.token_ids for g in group.generate(prompts, params)] == [g.token_ids for g in first]
    # Engine r samples its chunk with derive_seed(seed, r).
    local = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    second_chunk = local.generate(
        prompts[5:], SamplingParams(max_new_tokens=6, seed=derive_seed(77, 1), ignore_eos=True)
    )
    assert [g.token_ids for g in first[5:]] == [g.token_ids for g in second_chunk]


def test_memory_weights_and_health_through_the_group(group: EngineGroup, tiny_llama_dir: str) -> None:
    prompts = random_prompts(6, seed=22)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    before = group.generate(prompts, params)
    group.release_memory()
    group.release_memory()  # idempotent
    with pytest.raises(EngineError, match=r"rank 0.*released"):
        group.generate(prompts, params)
    group.resume_memory(["weights"])
    group.flush_cache()
    group.resume_memory(["kv_cache"])
    assert [g.token_ids for g in group.generate(prompts, params)] == [g.token_ids for g in before]
    assert group.health() == [True, True]


def test_a_too_long_prompt_names_its_index_and_the_limit(group: EngineGroup) -> None:
    prompts = [[2] * 4, [3] * 4, [4] * 33]
    with pytest.raises(ValueError, match=r"prompt 2 has 33 tokens.*context of 32"):
        group.generate(prompts, SamplingParams(max_new_tokens=2))


class _StuckEngine:
    """Answers health at once and never finishes a generate."""

    def max_context_len(self) -> int:
        return 64

    def health(self) -> bool:
        return True

    def generate(self, prompts: Any, params: Any) -> list[Any]:
        time.sleep(3600)
        return []


def test_a_stuck_engine_is_named_within_the_timeout(engine_bundles: Any) -> None:
    import ray

    stuck: Any = ray.remote(_StuckEngine).options(num_cpus=0)
    handles = [stuck.remote(), stuck.remote()]
    try:
        group = EngineGroup(handles, max_context_len=64, timeout_s=2.0)
        with pytest.raises(EngineError, match=r"rank 0: generate did not answer within 2 s.*\[0, 1\]"):
            group.generate([[2], [3]], SamplingParams(max_new_tokens=1))
        assert group.health() == [False, False]  # queued behind the stuck generate
    finally:
        for h in handles:
            ray.kill(h)


def test_a_dead_engine_is_named(engine_bundles: Any, tiny_llama_dir: str) -> None:

    options = EngineOptions(device="cpu", request_timeout_s=60)
    engines = create_engine_group(
        tiny_llama_dir, engine_bundles, [0, 1], num_gpus_per_engine=0.25, options=options
    )
    try:
        kill_and_wait(engines.handles[1])
        with pytest.raises(EngineError, match="rank 1: generate failed: the engine's actor died"):
            engines.generate(random_prompts(4, seed=23), SamplingParams(max_new_tokens=2))
        assert engines.health() == [True, False]
    finally:
        engines.shutdown()


def test_a_dead_engine_is_restarted_on_its_bundle_and_given_its_prompts_again(
    engine_bundles: Any, group: EngineGroup, tiny_llama_dir: str
) -> None:

    options = EngineOptions(device="cpu", max_context_len=32, request_timeout_s=120)
    engines = create_engine_group(
        tiny_llama_dir, engine_bundles, [0, 1], num_gpus_per_engine=0.25, options=options, max_restarts=1
    )
    restarted: list[tuple[int, Any]] = []
    engines.on_restart = lambda rank, handle: restarted.append((rank, handle))
    try:
        prompts = random_prompts(9, seed=24)
        params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
        expected = [g.token_ids for g in group.generate(prompts, params)]  # a healthy group, same seeds
        kill_and_wait(engines.handles[1])  # its process is gone, as after an OOM kill
        assert [g.token_ids for g in engines.generate(prompts, params)] == expected
        assert engines.restarts == [0, 1]
        ((rank, handle),) = restarted
        assert rank == 1 and handle is engines.handles[1]
        assert engines.health() == [True, True]

        # One more death of rank 1 is one too many: the rank is named.
        kill_and_wait(engines.handles[1])
        with pytest.raises(
            EngineError, match=r"rank 1: died again after 1 restarts \(--max-engine-restarts 1\)"
        ):
            engines.generate(prompts, params)
    finally:
        engines.shutdown()


def test_a_restarted_engine_is_put_back_in_the_groups_memory_state(
    engine_bundles: Any, tiny_llama_dir: str
) -> None:
    import ray

    options = EngineOptions(device="cpu", max_context_len=32, request_timeout_s=120)
    engines = create_engine_group(
        tiny_llama_dir, engine_bundles, [0, 1], num_gpus_per_engine=0.25, options=options, max_restarts=3
    )
    try:
        engines.release_memory()
        kill_and_wait(engines.handles[0])
        engines.resume_memory(["weights"])  # rank 0 dies in this call: restarted released, then resumed
        assert engines.restarts == [1, 0]
        assert [ray.get(h.released_tags.remote()) for h in engines.handles] == [["kv_cache"], ["kv_cache"]]
        engines.resume_memory(["kv_cache"])
        assert [ray.get(h.released_tags.remote()) for h in engines.handles] == [[], []]
    finally:
        engines.shutdown()
