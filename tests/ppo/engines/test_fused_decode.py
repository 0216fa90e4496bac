"""The fused decode step on CPU with its pure-torch operations (`decode_ops="reference"`), end to end.

The decoder's structure (weights, fused projections, RoPE tables, cache positions,
left pads, the sampler's contract) is checked against transformers on tiny random
Llama (tied and untied, with and without biases) and Qwen2 (q/k/v biases) models.
The Triton kernels are checked against the same operations in test_decode_kernels.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tandem.ppo.engines import EmbeddedEngine, EngineOptions, SamplingParams
from tandem.ppo.engines._decode_ops import ReferenceOps
from tandem.ppo.engines._fused_decode import unsupported_reason
from tandem.ppo.engines._sampling import Draws

from .conftest import make_tiny_model, random_prompts, reference_log_probs, save_model

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied-biases": ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """(HF folder, the model in memory) of one tiny variant."""
    kind, overrides = VARIANTS[request.param]
    model = _distinct(make_tiny_model(kind, **overrides))
    return save_model(model, tmp_path_factory.mktemp(request.param)), model


def _distinct(model: Any, seed: int = 0) -> Any:
    """`model` with random biases (transformers initializes them to zero, which would hide a dropped one).

    Tiny random models with tied embeddings tend to repeat one token under greedy decoding;
    the sampled log-prob tests are the ones that exercise them.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=g) / 10)
    return model


def _fused(folder: str, **options: Any) -> EmbeddedEngine:
    engine = EmbeddedEngine(folder, EngineOptions(device="cpu", **options), decode_ops="reference")
    assert engine._fused is not None
    return engine


def test_greedy_tokens_equal_the_transformers_path_and_generate(variant: tuple[str, Any]) -> None:
    folder, model = variant
    prompts = random_prompts(10, seed=20, min_len=1, max_len=12)  # left pads of 0 to 11
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    fused = _fused(folder).generate(prompts, params)
    plain = EmbeddedEngine(folder, EngineOptions(device="cpu")).generate(prompts, params)
    assert [g.token_ids for g in fused] == [g.token_ids for g in plain]
    for a, b in zip(fused, plain, strict=True):
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)
    for prompt, gen in zip(prompts, fused, strict=True):
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :]
        assert gen.token_ids == expected.tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_log_probs_equal_a_forward_pass_and_a_seed_reproduces(
    variant: tuple[str, Any], temperature: float
) -> None:
    folder, model = variant
    engine = _fused(folder)
    prompts = random_prompts(8, seed=21)
    params = SamplingParams(max_new_tokens=7, temperature=temperature, seed=5, ignore_eos=True)
    gens = engine.generate(prompts, params)
    for prompt, gen in zip(prompts, gens, strict=True):
        expected = reference_log_probs(model, prompt, gen.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.log_probs), expected, atol=1e-4, rtol=1e-4)
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in gens]
    other = SamplingParams(max_new_tokens=7, temperature=temperature, seed=6, ignore_eos=True)
    assert [g.token_ids for g in engine.generate(prompts, other)] != [g.token_ids for g in gens]


def test_top_k_and_top_p_restrict_the_draw_through_the_torch_sampler(tiny_llama_dir: str) -> None:
    engine = _fused(tiny_llama_dir)
    prompts = random_prompts(8, seed=22)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    for restricted in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        params = SamplingParams(
            max_new_tokens=5,
            temperature=1.3,
            top_k=restricted.top_k,
            top_p=restricted.top_p,
            seed=0,
            ignore_eos=True,
        )
        gens = engine.generate(prompts, params)
        assert [g.token_ids for g in gens] == [g.token_ids for g in greedy]
        # The log-probs stay those of the whole tempered distribution, not of the restricted one.
        assert all(lp < -1e-3 for g in gens for lp in g.log_probs)


def test_packing_finished_rows_changes_no_result(tiny_llama_dir: str) -> None:
    prompts = random_prompts(40, seed=23)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(5, 7, 11, 13, 17))
    a = _fused(tiny_llama_dir, sync_every=1).generate(prompts, params)
    b = _fused(tiny_llama_dir, sync_every=10_000).generate(prompts, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.finish_reason for g in a] == [g.finish_reason for g in b]
    lengths = sorted(len(g.token_ids) for g in a)
    assert lengths[0] < 8 < lengths[-1], "some responses must finish early for packing to happen"


def test_weight_updates_and_release_resume_reach_the_fused_projections(tmp_path: Path) -> None:
    folder = save_model(_distinct(make_tiny_model("llama", attention_bias=True)), tmp_path / "target")
    engine = _fused(folder)
    attn = engine.model.model.layers[0].self_attn
    # q, k and v (and their biases) are views of one buffer, which the fused GEMM reads.
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.bias.untyped_storage().data_ptr() == attn.q_proj.bias.untyped_storage().data_ptr()
    source = _distinct(make_tiny_model("llama", seed=45, attention_bias=True), seed=1)
    prompts = random_prompts(8, seed=24)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    before = engine.generate(prompts, params)
    engine.release_memory()
    assert attn.q_proj.weight.untyped_storage().nbytes() == 0, "the fused buffer itself is released"
    engine.resume_memory()
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in before]
    engine.update_weights_from_tensors([(n, t.detach().clone()) for n, t in source.state_dict().items()])
    after = engine.generate(prompts, params)
    expected = [
        source.generate(
            torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    assert [g.token_ids for g in after] == expected != [g.token_ids for g in before]


def test_the_sampler_draws_from_softmax_of_logits_over_temperature() -> None:
    """Gumbel-max with Philox noise: frequencies over many rows and steps match softmax(logits / T)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    expected = torch.softmax(logits / temperature, dim=-1)
    draws = Draws.from_seed(7, torch.device("cpu"))
    counts = torch.zeros(6)
    for _ in range(4):  # four steps of 10000 rows, as a decode loop seeds them
        seed = torch.tensor([draws.next_seed()])
        tokens, log_probs = ReferenceOps().sample(
            logits.expand(10_000, 6), temperature=torch.tensor([temperature]), seed=seed
        )
        counts += torch.bincount(tokens, minlength=6)
        torch.testing.assert_close(log_probs, expected.log()[tokens])
    chi_square = float((((counts - 40_000 * expected) ** 2) / (40_000 * expected)).sum())
    # 5 degrees of freedom: P(chi2 > 30) < 2e-5, and the draws are fixed by the seed.
    assert chi_square < 30, (counts / 40_000, expected)


def test_neighbouring_seeds_and_steps_draw_unrelated_noise() -> None:
    a, b = Draws.from_seed(1, torch.device("cpu")), Draws.from_seed(2, torch.device("cpu"))
    assert abs(a.base_seed - b.base_seed) > 2**50
    assert [a.next_seed() for _ in range(3)] == [a.base_seed + 1, a.base_seed + 2, a.base_seed + 3]
    logits = torch.zeros(4, 1000)
    ops, one = ReferenceOps(), torch.tensor([1.0])
    draws = [ops.sample(logits, temperature=one, seed=torch.tensor([s]))[0] for s in (10, 11)]
    assert len(set(draws[0].tolist())) == 4, "rows of one step draw apart"
    assert draws[0].tolist() != draws[1].tolist()


def test_unsupported_models_are_named_and_keep_transformers_decode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert unsupported_reason(make_tiny_model("llama"), 64) is None
    assert "hidden_act" in str(unsupported_reason(make_tiny_model("llama", hidden_act="gelu"), 64))
    # transformers 5 names the RoPE scaling `rope_parameters` (theta inside); 4.x `rope_scaling`.
    if int(transformers.__version__.split(".")[0]) >= 5:
        scaling = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
    else:
        scaling = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    dynamic = make_tiny_model("llama", **scaling)
    assert "dynamic" in str(unsupported_reason(dynamic, 64))
    sliding = make_tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert "sliding" in str(unsupported_reason(sliding, 64))
    gelu = save_model(make_tiny_model("llama", hidden_act="gelu"), tmp_path / "gelu")
    with pytest.raises(ValueError, match=r"decode_ops='reference'.*hidden_act 'gelu'"):
        EmbeddedEngine(gelu, EngineOptions(device="cpu"), decode_ops="reference")
    with caplog.at_level(logging.INFO, logger="tandem.ppo.engines._fused_decode"):
        engine = EmbeddedEngine(gelu, EngineOptions(device="cpu"))
    assert engine._fused is None and "fused decode off" in caplog.text
    gens = engine.generate(
        random_prompts(3, seed=25), SamplingParams(max_new_tokens=3, ignore_eos=True, seed=0)
    )
    assert [len(g.token_ids) for g in gens] == [3, 3, 3]
