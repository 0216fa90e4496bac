"""Our Megatron actor and critic on the pretrained SmolLM2-135M-Instruct against transformers (fp32, CPU, gloo).

The real model's traits the random models do not have: 30 layers of real weights,
9 query and 3 key/value heads (no TP = 2: validation refuses it, see
tests/ppo/test_config.py), tied embeddings, and a 49,152-token vocabulary. Its
vocabulary is a multiple of 128, so the model is built here with
`vocab_multiple=1000`: Megatron's embedding and tied head get 50,000 rows, 848 of
them padding, which must never reach a softmax nor the export. The inputs are real
chat prompts with answers, tokenized by the model's own tokenizer.

`_scripts/real_model_checks.py` runs in two fresh processes (Megatron never
initialises inside pytest) for TP = PP = 1 (data-parallel 2) and PP = 2 (15 layers a stage).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "_scripts"
PHASES = ("1x1", "1x2")
TEMPERATURE = 0.7
VOCAB_MULTIPLE = 1000
PADDED_VOCAB = 50_000
# Logits of a 30-layer model reach about 30 in magnitude; fp32 sums in another order differ by
# a few 1e-5 per layer.
ATOL = 2e-3


def _inputs(tokenizer: Any) -> dict[str, Any]:
    pairs = [("What is 2 plus 3?", "2 + 3 = 5"), ("Say hi.", "Hi there!"), ("What is 9 plus 9?", "18")]
    tokens, response_lengths = [], []
    for question, answer in pairs:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        tokens.append(torch.tensor(prompt + response))
        response_lengths.append(len(response))
    return {
        "tokens": tokens,
        "response_lengths": response_lengths,
        "square_tokens": torch.stack([t[-12:] for t in tokens[:2]]),
        "temperature": TEMPERATURE,
        "vocab_multiple": VOCAB_MULTIPLE,
    }


@pytest.fixture(scope="module")
def run(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = tmp_path_factory.mktemp("real-parity")
    inputs = _inputs(AutoTokenizer.from_pretrained(smollm2))
    torch.save(inputs, work / "inputs.pt")
    command = [sys.executable, str(SCRIPTS / "launch.py"), "2", str(SCRIPTS / "real_model_checks.py")]
    proc = subprocess.run(
        [*command, str(smollm2), str(work), ",".join(PHASES)], capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    outputs = {
        (phase, rank): torch.load(work / "out" / phase / f"rank{rank}.pt", weights_only=False)
        for phase in PHASES
        for rank in (0, 1)
    }
    model = AutoModelForCausalLM.from_pretrained(smollm2, attn_implementation="eager").float().eval()
    return {"inputs": inputs, "outputs": outputs, "model": model}


def _last_stage(phase: str) -> list[int]:
    return [1] if phase == "1x2" else [0, 1]


@pytest.mark.parametrize("phase", PHASES)
def test_logits_through_the_padded_vocabulary_match_transformers(run: dict[str, Any], phase: str) -> None:
    with torch.no_grad():
        expected = run["model"](run["inputs"]["square_tokens"]).logits
    vocab = expected.shape[-1]
    assert vocab == 49_152
    for rank in _last_stage(phase):
        ours = run["outputs"][(phase, rank)]["logits"]
        assert ours.shape == (*expected.shape[:-1], PADDED_VOCAB)
        assert (ours[..., :vocab] - expected).abs().max().item() < ATOL
        # The padding rows are zeros: their logits are 0, inside the real ones' range, so only the
        # mask keeps them out of the softmax. With this model's logits (up to about 20) a missing
        # mask would move a log-prob by about 1e-6 only; test_models_parity.py, whose logits are
        # small, is the one that proves the mask.
        assert not ours[..., vocab:].any()
    first = run["outputs"][(phase, 0)]
    assert first["embedding_rows"] == PADDED_VOCAB


@pytest.mark.parametrize("phase", PHASES)
def test_log_probs_and_entropy_match_transformers(run: dict[str, Any], phase: str) -> None:
    inputs, model = run["inputs"], run["model"]
    for rank in _last_stage(phase):
        out = run["outputs"][(phase, rank)]
        for tokens, n, ours, entropy in zip(
            inputs["tokens"], inputs["response_lengths"], out["log_probs"], out["entropy"], strict=True
        ):
            with torch.no_grad():
                logits = model(tokens[None]).logits[0, -n - 1 : -1] / TEMPERATURE
            logp = torch.log_softmax(logits, dim=-1)
            assert (ours - logp.gather(-1, tokens[-n:, None])[:, 0]).abs().max().item() < ATOL
            assert (entropy - -(logp.exp() * logp).sum(-1)).abs().max().item() < ATOL
        # The last response token is the end of turn (pad = eos): it has a real log-prob.
        assert all(lp[-1].item() > -20 for lp in out["log_probs"])


@pytest.mark.parametrize("phase", PHASES)
def test_tied_embeddings_in_and_exported_weights_bit_for_bit(run: dict[str, Any], phase: str) -> None:
    for rank in (0, 1):
        out = run["outputs"][(phase, rank)]
        actor = out["actor_export"]
        # Tied: no lm_head.weight; the embedding comes back with its 49,152 rows, bit for bit.
        assert "lm_head.weight" not in actor["names"] and "model.embed_tokens.weight" in actor["names"]
        assert len(actor["names"]) == 1 + 30 * 9 + 1 and actor["mismatched"] == []
        critic = out["critic_export"]
        assert critic["mismatched"] == ["score.weight", "score.bias"]  # the critic's own new head
        assert set(critic["names"]) == set(actor["names"]) | {"score.weight", "score.bias"}
    for rank in _last_stage(phase):
        out = run["outputs"][(phase, rank)]
        # The actor's head is the embedding itself on one stage, an equal copy on the last of two.
        assert out["head_is_embedding"] == (phase == "1x1")
        assert out["head_equals_embedding"] and out["head_padding_is_zero"]


@pytest.mark.parametrize("phase", PHASES)
def test_critic_values_are_the_backbone_through_its_head(run: dict[str, Any], phase: str) -> None:
    inputs, model = run["inputs"], run["model"]
    for rank in _last_stage(phase):
        out = run["outputs"][(phase, rank)]
        w, b = out["score"]["weight"], out["score"]["bias"]
        for tokens, n, ours in zip(inputs["tokens"], inputs["response_lengths"], out["values"], strict=True):
            with torch.no_grad():
                hidden = model.model(tokens[None]).last_hidden_state[0, -n - 1 : -1]
            assert (ours - (hidden @ w.T[:, 0] + b)).abs().max().item() < ATOL
