"""The teacher's worker gives transformers' own log-probs of each response token, however it batches; it sleeps.

References come from `AutoModelForCausalLM` itself: each sample alone, its logits
divided by the temperature, log-softmaxed and read at the response's tokens. The
worker must give the same numbers with budgets that cut the samples into one batch
or many and logits computed a few rows at a time, for a model with its own output
head (Llama) and one with tied embeddings (Qwen2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.ppo.rollout.teacher import TeacherOptions

from .conftest import VOCAB

FP32_ATOL = 1e-5
TEMPERATURE = 0.7


def samples() -> tuple[list[list[int]], list[int]]:
    """Samples of many lengths (prompt + response) and their response lengths (one token up to all but one)."""
    gen = torch.Generator().manual_seed(3)
    rows, lengths = [], []
    for n, r in ((3, 1), (17, 9), (9, 8), (2, 1), (25, 4), (12, 11), (6, 3)):
        rows.append([int(t) for t in torch.randint(0, VOCAB, (n,), generator=gen)])
        lengths.append(r)
    return rows, lengths


def reference(model: Any, row: list[int], response_length: int, temperature: float) -> torch.Tensor:
    """transformers' log-probs of `row`'s last `response_length` tokens, the sample alone, under `temperature`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([row])).logits[0].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    n = len(row)
    positions = torch.arange(n - response_length - 1, n - 1)
    return log_probs[positions, torch.tensor(row[n - response_length :])]


@pytest.fixture(scope="module", params=["llama", "qwen2-tied"])
def teacher(request: pytest.FixtureRequest, causal_lm_folder: Any) -> tuple[Any, Any]:
    from tandem.ppo.rollout.teacher import TeacherWorker

    family, tied = ("qwen2", True) if request.param == "qwen2-tied" else ("llama", False)
    folder, model = causal_lm_folder(family, tie_word_embeddings=tied)
    worker = TeacherWorker(
        str(folder), TeacherOptions(device="cpu", max_tokens_per_batch=40, logits_chunk_tokens=3)
    )
    return worker, model


def test_log_probs_are_transformers_own_whatever_the_batches(teacher: tuple[Any, Any]) -> None:
    worker, model = teacher
    rows, lengths = samples()
    got = worker.log_probs(rows, lengths, TEMPERATURE)
    assert [len(t) for t in got] == lengths and all(t.dtype == torch.float32 for t in got)
    for row, n, values in zip(rows, lengths, got, strict=True):
        torch.testing.assert_close(values, reference(model, row, n, TEMPERATURE), atol=FP32_ATOL, rtol=0)
    # One sample alone, or all in one batch: the same numbers (right padding leaves each row as it is).
    whole = type(worker)(worker.model.name_or_path, TeacherOptions(device="cpu", max_tokens_per_batch=10_000))
    for a, b in zip(got, whole.log_probs(rows, lengths, TEMPERATURE), strict=True):
        torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=0)
    # The temperature divides the logits: at 1 they are the model's plain log-probs.
    plain = worker.log_probs(rows[:1], lengths[:1], 1.0)[0]
    torch.testing.assert_close(plain, reference(model, rows[0], lengths[0], 1.0), atol=FP32_ATOL, rtol=0)
    assert not torch.allclose(plain, got[0])


def test_it_sleeps_and_wakes_with_the_same_weights(teacher: tuple[Any, Any]) -> None:
    from tandem.ppo.rollout.teacher import TeacherAsleepError

    worker, _ = teacher
    rows, lengths = samples()
    before = worker.log_probs(rows, lengths, TEMPERATURE)
    worker.sleep()
    assert worker.asleep()
    with pytest.raises(TeacherAsleepError, match="wake_up"):
        worker.log_probs(rows, lengths, TEMPERATURE)
    worker.wake_up()
    for a, b in zip(before, worker.log_probs(rows, lengths, TEMPERATURE), strict=True):
        assert torch.equal(a, b)


def test_bad_samples_are_named(teacher: tuple[Any, Any]) -> None:
    worker, _ = teacher
    with pytest.raises(ValueError, match="sample 1 has no tokens"):
        worker.log_probs([[1, 2], []], [1, 1])
    with pytest.raises(
        ValueError, match=r"sample 0 has token ids outside the teacher's vocabulary \[0, 48\)"
    ):
        worker.log_probs([[1, 99]], [1])
    with pytest.raises(ValueError, match="sample 0: a response of 2 tokens in a sequence of 2"):
        worker.log_probs([[1, 2]], [2])
    with pytest.raises(ValueError, match="temperature"):
        worker.log_probs([[1, 2]], [1], 0.0)
    with pytest.raises(ValueError, match=r"TeacherOptions\.logits_chunk_tokens"):
        TeacherOptions(logits_chunk_tokens=0)
