"""Multi-turn rollout benchmark: episodes in flight on the embedded engine against the single-turn engine.

One model (random weights, a chosen shape) and one workload: `--episodes` episodes in flight,
each of `--turns` model turns of exactly `--turn-tokens` tokens (`ignore_eos`), the
environment answering each turn with `--observation-chars` characters through the chat
template (the tiny character tokenizer's, one token a character). Reported, from one run:

1. `multi_turn`: the rollout of episodes (`tandem.ppo.rollout.episodes.generate_episodes`:
   the batcher, the chat template, the environment), its model tokens per second and the
   engine calls it made (one per turn: every episode asks at once);
2. `single_turn`: the same engine generating the same model tokens per episode in one call
   (`--episodes` prompts of `--turns × --turn-tokens` tokens): what the turns cost;
3. `reprefill`: what keeping each episode's KV cache across turns can save at most. Without it
   each turn re-prefills the whole episode so far; the seconds of those prefills alone (each
   turn's prompts generated again for one token) and the share of their tokens that an earlier
   turn had already prefilled or sampled give `upper_bound_saving_s`;
4. `kept_kv`: the same rollout with the engine keeping each episode's KV cache between its turns
   (`--keep-episode-kv`, off by default since this bench's H200 row), its tokens per second and its speed-up over re-prefilling.

CPU smoke run (tests/ppo/engines/test_bench_smoke.py runs it):

    python bench/multi_turn_bench.py --quick --out /tmp/multi-turn-bench.json

GPU host (one H200), a Qwen2.5-0.5B-shaped model, 256 episodes of 4 turns of 128 tokens:

    source .gpu-kit/setup.sh && python3 bench/multi_turn_bench.py --out multi-turn-bench.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from engine_bench import SHAPES, build_model, import_engines, sync  # noqa: E402

SHAPES = {
    **SHAPES,
    "tiny": {
        "family": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "tie_word_embeddings": False,
    },
}


class FixedTurns:
    """An environment of exactly `turns` model turns, answering each with `chars` characters."""

    def __init__(self, turns: int, chars: int) -> None:
        self.turns, self.chars = turns, chars

    def reset(self, sample: Any) -> str:
        return "go"

    def step(self, turn: Any) -> tuple[str, float, bool]:
        return "x" * self.chars, 0.0, turn.index + 1 == self.turns


class Recording:
    """The engine, with each call's prompts kept (the turns' re-prefills are timed from them)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.prompts: list[list[list[int]]] = []

    def generate(self, prompts: Any, params: Any, sessions: Any = None) -> Any:
        self.prompts.append([list(p) for p in prompts])
        return self.engine.generate(prompts, params, sessions)

    def end_sessions(self) -> None:
        self.engine.end_sessions()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import_engines()
    from tandem.ppo._tiny import build_tiny_tokenizer
    from tandem.ppo.engines import EmbeddedEngine, EngineOptions, SamplingParams
    from tandem.ppo.rollout.data import PromptDataset, PromptRecord
    from tandem.ppo.rollout.episodes.failures import EnvFailures
    from tandem.ppo.rollout.episodes.generation import EpisodeSetup, generate_episodes
    from tandem.ppo.rollout.episodes.runner import EpisodeLimits

    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = build_tiny_tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        build_model(args.shape, device, dtype, Path(folder))
        tokenizer.save_pretrained(folder)
        # One thread on the CPU: a shared machine's other jobs make OpenMP's waiting threads spin.
        threads = 1 if device.type == "cpu" else None
        engine = EmbeddedEngine(folder, EngineOptions(device=device.type, cpu_threads=threads))
        recording = Recording(engine)
        records = [PromptRecord(i, "go", None, None) for i in range(args.episodes)]
        samples = PromptDataset(records, tokenizer, max_prompt_len=64, seed=0).samples
        params = SamplingParams(max_new_tokens=args.turn_tokens, temperature=1.0, ignore_eos=True, seed=1)
        setup = EpisodeSetup(
            "bench",
            EpisodeLimits(args.turns, args.turn_tokens, max_context=engine.max_context_len()),
            EnvFailures(environment="bench", limit=0, log_dir=None),
            factory=functools.partial(FixedTurns, args.turns, args.observation_chars),
        )

        def episodes(keep_kv: bool) -> tuple[float, Any]:
            recording.prompts.clear()
            setup.keep_kv = keep_kv
            sync(device)
            start = time.perf_counter()
            rollout = generate_episodes(
                recording,
                samples,
                n_samples_per_prompt=1,
                params=params,
                tokenizer=tokenizer,
                setup=setup,
                label="b",
            )
            sync(device)
            return time.perf_counter() - start, rollout

        if not args.quick:
            episodes(False)  # warm-up: CUDA graphs, caches, the first calls' one-time costs
        kept_s, kept_rollout = episodes(True)
        multi_s, rollout = episodes(False)
        model_tokens = sum(sum(e.loss_mask) for e in rollout.episodes)
        turn_prompts = [list(p) for p in recording.prompts]

        single = SamplingParams(max_new_tokens=args.turns * args.turn_tokens, ignore_eos=True, seed=1)
        first_prompts = [s.prompt_ids for s in samples]
        if not args.quick:
            engine.generate(first_prompts, single)
        sync(device)
        start = time.perf_counter()
        single_out = engine.generate(first_prompts, single)
        sync(device)
        single_s = time.perf_counter() - start
        single_tokens = sum(len(g.token_ids) for g in single_out)

        one = SamplingParams(max_new_tokens=1, ignore_eos=True, seed=1)
        prefill_s = 0.0
        for prompts in turn_prompts:
            sync(device)
            start = time.perf_counter()
            engine.generate(prompts, one)
            sync(device)
            prefill_s += time.perf_counter() - start
        prompt_tokens = sum(len(p) for prompts in turn_prompts for p in prompts)
        # Turn k's prompt holds turn k-1's whole prompt and its sampled tokens: those were in the KV cache.
        reused = sum(
            len(prev) + args.turn_tokens
            for before, after in itertools.pairwise(turn_prompts)
            for prev in before[: len(after)]
        )
    share = reused / prompt_tokens if prompt_tokens else 0.0
    return {
        "device": str(device),
        "shape": args.shape,
        "episodes": args.episodes,
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "observation_chars": args.observation_chars,
        "multi_turn": {
            "seconds": multi_s,
            "model_tokens": model_tokens,
            "tokens_per_s": model_tokens / multi_s,
            "engine_calls": len(turn_prompts),
            "batch_sizes": [len(p) for p in turn_prompts],
            "engine_seconds": rollout.seconds.get("generate_engine"),
        },
        "kept_kv": {
            "seconds": kept_s,
            "model_tokens": sum(sum(e.loss_mask) for e in kept_rollout.episodes),
            "tokens_per_s": model_tokens / kept_s,
            "speedup_over_reprefill": multi_s / kept_s,
        },
        "single_turn": {
            "seconds": single_s,
            "model_tokens": single_tokens,
            "tokens_per_s": single_tokens / single_s,
        },
        "multi_over_single": (model_tokens / multi_s) / (single_tokens / single_s),
        "reprefill": {
            "seconds": prefill_s,
            "prompt_tokens": prompt_tokens,
            "already_cached_share": share,
            "upper_bound_saving_s": share * prefill_s,
            "upper_bound_share_of_multi_turn": share * prefill_s / multi_s,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--episodes", type=int, default=256, help="episodes in flight")
    parser.add_argument("--turns", type=int, default=4, help="model turns per episode")
    parser.add_argument("--turn-tokens", type=int, default=128, help="tokens per model turn")
    parser.add_argument(
        "--observation-chars", type=int, default=64, help="the environment's answer, in characters"
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU smoke run: the tiny shape, 8 episodes of 3 turns"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.shape, args.episodes, args.turns, args.turn_tokens, args.observation_chars = "tiny", 4, 2, 4, 4
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
