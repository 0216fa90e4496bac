"""Plain user code off the event loop: many plain custom generate functions at once are batched
together, and a tool or an environment that never returns is left behind on a daemon thread
(neither the rollout nor the process waits for it)."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from tandem.ppo.engines import SamplingParams
from tandem.ppo.rollout.data import PromptDataset, PromptRecord
from tandem.ppo.rollout.episodes.failures import EnvFailures
from tandem.ppo.rollout.episodes.generation import EpisodeSetup, generate_episodes
from tandem.ppo.rollout.episodes.runner import EpisodeLimits
from tandem.ppo.rollout.episodes.tools import ToolBox, parse_tool_calls

from ._stub import ScriptedEngine, text_reply, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id
LIMITS = EpisodeLimits(max_turns=2, max_turn_tokens=4, max_context=4096, env_timeout_s=0.2)
# More episodes than asyncio's default executor has threads (min(32, cores + 4)).
MANY = min(32, (os.cpu_count() or 1) + 4) + 8


def play(n: int, **setup: Any) -> tuple[Any, ScriptedEngine]:
    engine = ScriptedEngine(text_reply(TOKENIZER, "7"), EOS)
    samples = PromptDataset(
        [PromptRecord(i, "go", None, "7") for i in range(n)], TOKENIZER, max_prompt_len=64, seed=0
    ).samples
    the_setup = EpisodeSetup("t", LIMITS, EnvFailures(environment="t", limit=100, log_dir=None), **setup)
    params = SamplingParams(max_new_tokens=4, seed=1)
    rollout = generate_episodes(
        engine,
        samples,
        n_samples_per_prompt=1,
        params=params,
        tokenizer=TOKENIZER,
        setup=the_setup,
        label="t",
    )
    return rollout, engine


def test_many_plain_custom_functions_are_batched_together() -> None:
    threads: set[bool] = set()

    def agent(ctx: Any) -> Any:
        threads.add(threading.current_thread().daemon)
        trajectory = ctx.trajectory()
        trajectory.add_model(ctx.generate_blocking(ctx.prompt_ids))
        trajectory.add_reward(1.0)
        return trajectory

    # On the default executor the episodes past its threads never started, and the batch that
    # waits for every live episode never went out: the rollout hung. Joined with a bound, so that
    # a regression fails rather than hangs.
    result: list[Any] = []
    player = threading.Thread(target=lambda: result.append(play(MANY, custom=agent)), daemon=True)
    player.start()
    player.join(120)
    assert result, "the rollout of plain custom functions did not finish"
    rollout, engine = result[0]
    assert rollout.rewards == [1.0] * MANY and threads == {True}
    assert [len(prompts) for prompts, _ in engine.calls] == [MANY]  # one batch of every episode


def stuck(release: threading.Event, returned: list[bool]) -> Any:
    def wait(*_: Any) -> Any:
        release.wait(20)
        returned.append(True)
        return "late"

    return wait


def test_a_tool_that_never_returns_is_left_behind() -> None:
    release, returned = threading.Event(), []
    hang = stuck(release, returned)

    def never(x: int) -> int:
        """Never returns.

        Args:
            x: anything
        """
        return hang(x)

    counts: dict[str, float] = {}
    calls = parse_tool_calls('<tool_call>{"name": "never", "arguments": {"x": 1}}</tool_call>')
    (message,) = asyncio.run(ToolBox([never], timeout_s=0.1).run(calls, counts))
    # asyncio.run joins its default executor's threads (up to five minutes): the tool would have returned.
    assert returned == [] and "longer than 0.1 s" in message["content"]
    assert counts["tools/errors_timeout"] == 1.0
    left = [t for t in threading.enumerate() if t.name == "tandem-tool"]
    assert left and all(t.daemon for t in left)  # the interpreter's exit does not wait for it
    release.set()


def test_an_environment_that_never_answers_is_left_behind() -> None:
    release, returned = threading.Event(), []

    class Hangs:
        def reset(self, sample: Any) -> str:
            return "go"

        step = staticmethod(stuck(release, returned))

    rollout, _ = play(2, factory=Hangs)
    assert returned == [] and all(e.failed for e in rollout.episodes)
    assert all("did not return within --env-timeout 0.2 s" in (e.failure or "") for e in rollout.episodes)
    left = [t for t in threading.enumerate() if t.name == "tandem-env"]
    assert left and all(t.daemon for t in left)
    release.set()
