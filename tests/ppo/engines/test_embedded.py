"""The embedded engine on CPU: greedy, log-probs, seeds, stops, context limits, weight updates."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.ppo.engines import (
    EmbeddedEngine,
    EngineMemoryReleasedError,
    EngineOptions,
    SamplingParams,
    ipc_payload,
)

from .conftest import EOS, VOCAB, make_tiny_model, random_prompts, reference_log_probs


@pytest.fixture(scope="module")
def engine(tiny_model: tuple[str, Any]) -> EmbeddedEngine:
    return EmbeddedEngine(tiny_model[0], EngineOptions(device="cpu"))


def test_greedy_is_the_argmax_of_a_forward_pass(engine: EmbeddedEngine, tiny_model: tuple[str, Any]) -> None:
    model = tiny_model[1]
    prompts = random_prompts(16, seed=1)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(g.token_ids) for g in gens] == [6] * 16
    for prompt, gen in zip(prompts, gens, strict=True):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0]
        # The token after each prefix is that prefix's argmax (padding in the batch changes nothing).
        expected = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert gen.token_ids == expected
        assert gen.finish_reason == "length"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_a_forward_pass(
    engine: EmbeddedEngine, tiny_model: tuple[str, Any], temperature: float
) -> None:
    prompts = random_prompts(12, seed=2)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=7, temperature=temperature, seed=5))
    checked = 0
    for prompt, gen in zip(prompts, gens, strict=True):
        assert len(gen.log_probs) == len(gen.token_ids)
        if not gen.token_ids:
            continue
        expected = reference_log_probs(tiny_model[1], prompt, gen.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.log_probs), expected, atol=1e-4, rtol=1e-4)
        checked += len(gen.token_ids)
    assert checked > 20


def test_greedy_log_probs_are_under_temperature_one(
    engine: EmbeddedEngine, tiny_model: tuple[str, Any]
) -> None:
    prompts = random_prompts(4, seed=3)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    for prompt, gen in zip(prompts, gens, strict=True):
        expected = reference_log_probs(tiny_model[1], prompt, gen.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(gen.log_probs), expected, atol=1e-4, rtol=1e-4)


def test_a_seed_reproduces_its_samples_and_another_seed_differs(engine: EmbeddedEngine) -> None:
    prompts = random_prompts(32, seed=4)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    other = engine.generate(
        prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=124, ignore_eos=True)
    )
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.log_probs for g in first] == [g.log_probs for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


def test_top_k_one_is_greedy_and_top_p_keeps_the_draw_in_the_nucleus(engine: EmbeddedEngine) -> None:
    prompts = random_prompts(8, seed=5)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    top1 = engine.generate(
        prompts, SamplingParams(max_new_tokens=5, temperature=1.3, top_k=1, seed=0, ignore_eos=True)
    )
    assert [g.token_ids for g in top1] == [g.token_ids for g in greedy]
    tiny_p = engine.generate(
        prompts, SamplingParams(max_new_tokens=5, temperature=1.0, top_p=1e-6, seed=0, ignore_eos=True)
    )
    assert [g.token_ids for g in tiny_p] == [g.token_ids for g in greedy]


def test_stop_tokens_end_responses_and_are_included(engine: EmbeddedEngine) -> None:
    prompts = random_prompts(64, seed=6)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    # Stop at whatever token greedy decoding emits third in the first response.
    stop = free[0].token_ids[2]
    stopped = engine.generate(
        prompts, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True)
    )
    for full, gen in zip(free, stopped, strict=True):
        if stop in full.token_ids:
            cut = full.token_ids.index(stop) + 1
            assert gen.token_ids == full.token_ids[:cut]
            assert gen.finish_reason == "stop"
            assert gen.log_probs == pytest.approx(full.log_probs[:cut], abs=1e-5)
        else:
            assert gen.token_ids == full.token_ids and gen.finish_reason == "length"
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) <= 3


def test_eos_stops_unless_ignored(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    prompts = random_prompts(64, seed=7)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=2.0, seed=1))
    for gen in gens:
        assert EOS not in gen.token_ids[:-1]
        assert (gen.finish_reason == "stop") == (gen.token_ids[-1:] == [EOS])


def test_dropping_finished_sequences_changes_no_result(tiny_llama_dir: str) -> None:
    """Packing unfinished rows into smaller buckets (every step here) gives the same greedy responses."""
    prompts = random_prompts(40, seed=8)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(5, 7, 11, 13, 17))
    packing = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", sync_every=1))
    plain = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", sync_every=10_000))
    a = packing.generate(prompts, params)
    b = plain.generate(prompts, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.finish_reason for g in a] == [g.finish_reason for g in b]
    for x, y in zip(a, b, strict=True):
        assert x.log_probs == pytest.approx(y.log_probs, abs=1e-5)
    lengths = sorted(len(g.token_ids) for g in a)
    assert lengths[0] < 10 < lengths[-1], "some responses must finish early for packing to happen"


def test_a_too_long_prompt_is_refused_naming_its_index_and_the_limit(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", max_context_len=16))
    prompts = [[2, 3], [4] * 17, [5]]
    with pytest.raises(ValueError, match=r"prompt 1 has 17 tokens.*context of 16"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[VOCAB]], SamplingParams(max_new_tokens=2))


def test_responses_stop_at_the_context_limit(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", max_context_len=16))
    gens = engine.generate(
        [[2] * 16, [2] * 14, [2] * 3], SamplingParams(max_new_tokens=5, ignore_eos=True, seed=0)
    )
    assert [len(g.token_ids) for g in gens] == [0, 2, 5]
    assert all(g.finish_reason == "length" for g in gens)


def test_empty_batch_and_zero_new_tokens(engine: EmbeddedEngine) -> None:
    assert engine.generate([], SamplingParams()) == []
    gens = engine.generate([[2, 3]], SamplingParams(max_new_tokens=0))
    assert gens[0].token_ids == [] and gens[0].finish_reason == "length"


def _hf_state(model: Any) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.detach().clone()) for name, t in model.state_dict().items()]


@pytest.mark.parametrize("as_ipc", [False, True], ids=["tensors", "ipc_payload"])
def test_after_a_weight_update_the_logits_equal_the_source_model(tiny_llama_dir: str, as_ipc: bool) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    source = make_tiny_model("llama", seed=42)
    named = _hf_state(source)
    # Buckets of a few tensors each, as the actor sends them.
    for lo in range(0, len(named), 4):
        bucket = named[lo : lo + 4]
        engine.update_weights_from_tensors(ipc_payload(bucket) if as_ipc else bucket)
    ids = torch.tensor([random_prompts(1, seed=9, min_len=9)[0]])
    with torch.no_grad():
        expected = source(ids).logits
        got = engine.model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_weight_update_shows_in_the_next_generation(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    prompts = random_prompts(8, seed=10)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    before = engine.generate(prompts, params)
    source = make_tiny_model("llama", seed=43)
    engine.release_memory()
    engine.resume_memory(["weights"])
    engine.update_weights_from_tensors(_hf_state(source))
    engine.resume_memory(["kv_cache"])
    after = engine.generate(prompts, params)
    expected = [
        source.generate(
            torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    assert [g.token_ids for g in after] == expected
    assert [g.token_ids for g in after] != [g.token_ids for g in before]


def test_the_weights_digest_follows_the_weights(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    source = make_tiny_model("llama", seed=44)
    engine.update_weights_from_tensors(_hf_state(source))
    params = {id(p): p.detach().double() for p in engine.model.parameters()}.values()
    expected = [sum(float(p.sum()) for p in params), sum(float((p * p).sum()) for p in params)]
    assert engine.weights_digest() == pytest.approx(expected, rel=1e-12)
    engine.update_weights_from_tensors([("model.norm.weight", torch.full((32,), 2.0))])
    assert engine.weights_digest()[0] != pytest.approx(expected[0], rel=1e-12)
    engine.release_memory(["weights"])
    with pytest.raises(EngineMemoryReleasedError, match="weights_digest"):
        engine.weights_digest()


def test_weight_update_errors_name_the_problem(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    with pytest.raises(ValueError, match=r"not in the model.*model.nope"):
        engine.update_weights_from_tensors([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        engine.update_weights_from_tensors([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="pairs or an IpcPayload"):
        engine.update_weights_from_tensors([torch.zeros(3)])
    engine.release_memory(["weights"])
    with pytest.raises(EngineMemoryReleasedError, match=r"resume_memory\(\['weights'\]\)"):
        engine.update_weights_from_tensors([("model.norm.weight", torch.zeros(32))])


def test_generate_refuses_while_memory_is_released(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu"))
    prompts = random_prompts(4, seed=11)
    params = SamplingParams(max_new_tokens=4, seed=3)
    before = engine.generate(prompts, params)
    for tags in (["kv_cache"], ["weights"], ["weights", "kv_cache"]):
        engine.release_memory(tags)
        assert sorted(engine.released_tags()) == sorted(tags)
        with pytest.raises(EngineMemoryReleasedError, match="released"):
            engine.generate(prompts, params)
        engine.resume_memory()
        assert engine.released_tags() == []
        assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in before]
    with pytest.raises(ValueError, match="memory tags"):
        engine.release_memory(["optimizer"])


def test_options_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="dtype"):
        EngineOptions(dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineOptions(kv_cache_memory_fraction=0.0)
    with pytest.raises(ValueError, match="torch_memory_saver"):
        EngineOptions(offload_backend="torch_memory_saver")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sglang_urls"):
        EngineOptions(sglang_urls="http://x")  # type: ignore[arg-type]
