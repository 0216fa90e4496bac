"""A critic started from a reward model: its values at every position are the reward model's scores there.

As OpenRLHF starts its critic, `critic_hf_checkpoint` may be a one-label Hugging
Face sequence-classification folder: its backbone becomes the critic's and its
`score` head (no bias) the value head (bias 0). The test saves random Llama and
Qwen2 `ForSequenceClassification` models and runs `_scripts/critic_from_rm_check.py`
in two fresh processes on gloo for three layouts (DP 2, TP 2, PP 2). Reference:
transformers' `score(model(tokens).last_hidden_state)` at every position, whose
last position is the model's own pooled `logits`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "_scripts"
FAMILIES = ("llama", "qwen2")
PHASES = ("1x1", "2x1", "1x2")
FP32_ATOL = 1e-4
VOCAB = 128
PAD = 1


def _reward_model(family: str, num_labels: int = 1) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=num_labels,
        pad_token_id=PAD,
        eos_token_id=PAD,
        attn_implementation="eager",
    )
    torch.manual_seed(len(family))
    if family == "llama":
        model = transformers.LlamaForSequenceClassification(
            transformers.LlamaConfig(**common, rms_norm_eps=1e-5)
        )
    else:
        config = transformers.Qwen2Config(**common, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1e6})
        model = transformers.Qwen2ForSequenceClassification(config)
    assert model.score.bias is None  # transformers' reward-model head has no bias
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (1.0 if name.startswith("score") else 0.05))
    return model.float().eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("critic-from-rm")
    models = {}
    for family in FAMILIES:
        models[family] = _reward_model(family)
        models[family].save_pretrained(work / family)
        assert json.loads((work / family / "config.json").read_text())["architectures"][0].endswith(
            "ForSequenceClassification"
        )
    two = _reward_model("llama", num_labels=2)
    two.save_pretrained(work / "two-labels")
    gen = torch.Generator().manual_seed(7)
    lengths, response_lengths = [7, 11, 5], [3, 6, 2]
    inputs = {
        "folders": list(FAMILIES),
        "square_tokens": torch.randint(2, VOCAB, (2, 12), generator=gen),
        "tokens": [torch.randint(2, VOCAB, (n,), generator=gen) for n in lengths],
        "response_lengths": response_lengths,
        "two_labels": "two-labels",
    }
    torch.save(inputs, work / "inputs.pt")
    command = [sys.executable, str(SCRIPTS / "launch.py"), "2", str(SCRIPTS / "critic_from_rm_check.py")]
    proc = subprocess.run(
        [*command, str(work), ",".join(PHASES)], capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    outputs = {
        (phase, family, rank): torch.load(
            work / "out" / phase / family / f"rank{rank}.pt", weights_only=False
        )
        for phase in PHASES
        for family in FAMILIES
        for rank in (0, 1)
    }
    refused = [(work / "out" / "refused" / f"rank{r}.txt").read_text() for r in (0, 1)]
    return {"models": models, "inputs": inputs, "outputs": outputs, "refused": refused}


def _last_stage_ranks(phase: str) -> list[int]:
    return [1] if phase == "1x2" else [0, 1]


def _scores_at_every_position(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.score(model.model(tokens).last_hidden_state)[..., 0]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_values_at_every_position_are_the_reward_models_scores(
    run: dict[str, Any], family: str, phase: str
) -> None:
    model, tokens = run["models"][family], run["inputs"]["square_tokens"]
    expected = _scores_at_every_position(model, tokens)
    with torch.no_grad():  # the reference's last position is transformers' own pooled score
        pooled = model(input_ids=tokens).logits[:, 0]
    assert torch.allclose(expected[:, -1], pooled, atol=1e-6)
    for rank in _last_stage_ranks(phase):
        ours = run["outputs"][(phase, family, rank)]["all_positions"]
        assert ours.dtype == torch.float32 and ours.shape == expected.shape
        assert (ours - expected).abs().max().item() < FP32_ATOL
    if phase == "1x2":
        assert run["outputs"][(phase, family, 0)]["all_positions"] is None


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_only_values_and_the_head(run: dict[str, Any], family: str, phase: str) -> None:
    model, inputs = run["models"][family], run["inputs"]
    for rank in _last_stage_ranks(phase):
        out = run["outputs"][(phase, family, rank)]
        # The state before each response token: positions prompt - 1 .. total - 2.
        for ours, tokens, response in zip(
            out["response_values"], inputs["tokens"], inputs["response_lengths"], strict=True
        ):
            scores = _scores_at_every_position(model, tokens[None])[0]
            expected = scores[tokens.numel() - response - 1 : tokens.numel() - 1]
            assert (ours - expected).abs().max().item() < FP32_ATOL
        # The score head became the value head; the missing bias is 0 (not the seeded init's).
        assert torch.equal(out["head"]["weight"], model.score.weight.detach())
        assert torch.equal(out["head"]["bias"], torch.zeros(1))


def test_a_classifier_of_two_labels_is_refused_where_it_loads(run: dict[str, Any]) -> None:
    for message in run["refused"]:
        assert message.startswith("load_hf_checkpoint: score.weight") and "(2, 64)" in message, message


def test_a_classifier_of_two_labels_cannot_start_the_critic(tmp_path: Path) -> None:
    import transformers

    from tandem.megatron.config import WorkerConfig

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForSequenceClassification(config).save_pretrained(
        tmp_path / "two"
    )  # 2 labels by default
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match=r"^critic_hf_checkpoint: .* 2 labels"):
        WorkerConfig(
            hf_checkpoint=str(tmp_path / "lm"),
            critic_hf_checkpoint=str(tmp_path / "two"),
            rollout_batch_size=2,
            global_batch_size=2,
        )
