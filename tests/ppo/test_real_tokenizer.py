"""The quirks of a real tokenizer (SmolLM2-135M-Instruct's), each through the code path that meets it.

- pad = eos (`<|im_end|>`, id 2): the end of a response is not mistaken for padding (the
  engine stops on it, keeps it as a trained token with its log-prob), and the prompt's own
  `<|im_end|>` tokens (the template closes every turn with one) are attended, not masked;
- the chat template's system prompt: a default one when the data has none, the data's own
  when given, never a doubled begin-of-turn token;
- BPE spaces: the reward function sees decoded text as a user expects ("2 + 3 = 5", no `Ġ`),
  the text transformers itself decodes;
- 9 attention heads: `--tensor-model-parallel-size 2` is refused before anything starts.

The padded vocabulary (one that is no multiple of 128 x TP) is in
tests/megatron/test_models_parity.py and test_real_model_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.ppo.engines import EmbeddedEngine, EngineOptions, SamplingParams
from tandem.ppo.rollout import generate_rollout, to_train_batches
from tandem.ppo.rollout.data import PromptDataset, read_prompts
from tandem.ppo.rollout.rewards import load_reward

pytestmark = pytest.mark.slow

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def engine(smollm2: Path) -> EmbeddedEngine:
    return EmbeddedEngine(str(smollm2), EngineOptions(device="cpu"))


def _dataset(tmp_path: Path, tokenizer: Any, rows: list[dict[str, Any]]) -> PromptDataset:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset(read_prompts(str(path)), tokenizer, max_prompt_len=256, seed=0)


def test_pad_is_eos_yet_a_response_ending_at_eos_is_not_padding(
    tmp_path: Path, tokenizer: Any, engine: EmbeddedEngine, smollm2: Path
) -> None:
    from transformers import AutoModelForCausalLM

    assert tokenizer.pad_token_id == tokenizer.eos_token_id == EOS
    # Two prompts of different lengths: one batch, left-padded inside the engine.
    rows = [
        {"prompt": "What is 2 plus 3? Answer with a single number, nothing else.", "label": "5"},
        {"prompt": "Say hi.", "label": "hi"},
    ]
    prompts = _dataset(tmp_path, tokenizer, rows).next_batch(2)
    assert all(p.prompt_ids.count(EOS) == 2 for p in prompts)  # the system and user turns end with it
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=(EOS,), seed=0, top_k=1)
    rollout = generate_rollout(
        engine,
        prompts,
        n_samples_per_prompt=1,
        params=params,
        tokenizer=tokenizer,
        reward_fn=load_reward("exact_match"),
    )
    stopped = [g for g in rollout.generations if g.finish_reason == "stop"]
    assert stopped, [g.finish_reason for g in rollout.generations]
    for g in stopped:
        assert g.token_ids[-1] == EOS and EOS not in g.token_ids[:-1]
    # The engine's log-probs are transformers' on the unpadded sequence: no token with the pad
    # id (in the prompt or at the end) was masked out as padding.
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    for prompt, g in zip(prompts, rollout.generations, strict=True):
        ids = torch.tensor([[*prompt.prompt_ids, *g.token_ids]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        n = len(prompt.prompt_ids)
        expected = logp[n - 1 : -1].gather(-1, ids[0, n:, None])[:, 0]
        assert torch.allclose(torch.tensor(g.log_probs), expected, atol=1e-3), (g.log_probs, expected)
    # The trainer's batch keeps the eos as a response token with loss mask 1.
    (batch,) = to_train_batches(rollout, 1)
    for i, g in enumerate(rollout.generations):
        assert batch.response_lengths[i] == len(g.token_ids)
        assert batch.tokens[i][-1].item() == g.token_ids[-1]
        assert batch.loss_masks[i].tolist() == [1.0] * len(g.token_ids)


def test_the_chat_templates_system_prompt(tmp_path: Path, tokenizer: Any) -> None:
    rows = [
        {"prompt": "Hi.", "label": ""},
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
            "label": "",
        },
    ]
    dataset = _dataset(tmp_path, tokenizer, rows)
    plain, own = sorted(dataset.next_batch(2), key=lambda p: p.record.index)
    assert plain.prompt_text.startswith(
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi."
    )
    assert (
        own.prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
        and DEFAULT_SYSTEM not in own.prompt_text
    )
    for p, messages in ((plain, [{"role": "user", "content": "Hi."}]), (own, rows[1]["messages"])):
        assert p.prompt_text.endswith("<|im_start|>assistant\n")
        # The ids are the template's own tokens: no begin-of-turn token added a second time.
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert p.prompt_ids == expected and p.prompt_ids[:2] != [1, 1]


def test_rewards_see_bpe_text_decoded_as_a_user_expects(
    tmp_path: Path, tokenizer: Any, engine: EmbeddedEngine
) -> None:
    seen: list[str] = []

    def reward(samples: list[Any]) -> list[float]:
        seen.extend(s.response for s in samples)
        return [0.0] * len(samples)

    rows = [{"prompt": "What is 2 plus 3? Answer with a single number, nothing else.", "label": "5"}]
    prompts = _dataset(tmp_path, tokenizer, rows).next_batch(1)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=(EOS,), seed=0, top_k=1)
    rollout = generate_rollout(
        engine, prompts, n_samples_per_prompt=1, params=params, tokenizer=tokenizer, reward_fn=reward
    )
    (text,) = seen
    ids = rollout.generations[0].token_ids
    assert len(ids) > 2 and any(tokenizer.convert_ids_to_tokens(i).startswith("Ġ") for i in ids)
    assert "Ġ" not in text and "<|im_end|>" not in text and " " in text  # spaces, not BPE markers
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_nine_heads_refuse_tensor_parallel_two_naming_the_flag(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.ppo.app.cli import run

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "Hi.", "label": ""}) + "\n")
    argv = [
        "train",
        "--hf-checkpoint",
        str(smollm2),
        "--prompt-data",
        str(data),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    argv += ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "ppo-driver train: error: --tensor-model-parallel-size: 2 does not divide the actor's 9"
    )
    assert "use one of 1, 3" in err and not (tmp_path / "run").exists()
