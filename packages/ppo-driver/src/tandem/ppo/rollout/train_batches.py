"""A rollout as the train workers take it: the rewards they train on, and one `RolloutBatch` per data-parallel rank.

A rollout is cut into contiguous, equal shares per data-parallel rank, so that sample `i`
of the rollout is the same sample for the actor and the critic (`sample_indices` carries
`i`). Every response token is trainable (`loss_mask = 1`), truncated responses included
(GAE treats the value after the last token as 0; docs/design.md, "PPO math conventions"),
unless `--filter-truncated` leaves them out (mask 0); an episode's tokens are trainable
where its loss mask says. The models train on the task reward plus DAPO's overlong penalty
when `--overlong-buffer-len` is set (`training_rewards`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import ray
import torch

from tandem.megatron.algorithms.reward_shaping import overlong_penalty
from tandem.megatron.batch import RolloutBatch
from tandem.ppo.rollout.episodes.trajectory import Episode
from tandem.ppo.rollout.samples import Rollout, ShapingFields

if TYPE_CHECKING:
    from ray import ObjectRef


def training_rewards(rollout: Rollout, config: ShapingFields) -> tuple[list[float], dict[str, float]]:
    """The rewards the models train on, and their metrics: the task rewards, plus DAPO's overlong penalty.

    With `--overlong-buffer-len`, `reward_shaping.overlong_penalty` of each response's length is
    added, and `reward/overlong_penalty` (its mean) and `reward/shaped_mean` are reported.
    """
    if config.overlong_buffer_len is None:
        return list(rollout.rewards), {}
    lengths = torch.tensor([len(g.token_ids) for g in rollout.generations])
    penalty = overlong_penalty(
        lengths, config.rollout_max_response_len, config.overlong_buffer_len, config.overlong_penalty_factor
    ).tolist()
    shaped = [r + p for r, p in zip(rollout.rewards, penalty, strict=True)]
    metrics = {
        "reward/overlong_penalty": sum(penalty) / len(penalty),
        "reward/shaped_mean": sum(shaped) / len(shaped),
    }
    return shaped, metrics


def to_train_batches(
    rollout: Rollout,
    data_parallel_size: int,
    *,
    rewards: Sequence[float] | None = None,
    filter_truncated: bool = False,
) -> list[RolloutBatch]:
    """The rollout as `data_parallel_size` equal, contiguous `RolloutBatch`es (rank `r` gets share `r`).

    `rewards`: what the models train on (`training_rewards`); None: the rollout's rewards.
    `filter_truncated`: responses cut at the length cap (finish reason `length`; a truncated episode)
    get loss mask 0. A rollout of episodes gives each sample its episode's loss mask (the model's
    tokens 1, the context 0) and its rewards at their tokens (`RolloutBatch.step_rewards`), plus
    whatever `rewards` adds to the episode's return (DAPO's penalty) at its last trainable token.
    """
    rewards = rollout.rewards if rewards is None else rewards
    n = len(rollout)
    if n % data_parallel_size:
        raise ValueError(
            f"--rollout-batch-size: {n} samples do not split over {data_parallel_size} data-parallel ranks"
        )
    per_rank = n // data_parallel_size
    batches = []
    for rank in range(data_parallel_size):
        indices = range(rank * per_rank, (rank + 1) * per_rank)
        tokens, lengths, masks, log_probs, step_rewards = [], [], [], [], []
        for i in indices:
            prompt, gen = rollout.prompts[i], rollout.generations[i]
            response = list(gen.token_ids)
            tokens.append(torch.tensor([*prompt.prompt_ids, *response], dtype=torch.long))
            lengths.append(len(response))
            dropped = filter_truncated and gen.finish_reason == "length"
            mask = torch.ones(len(response), dtype=torch.float32)
            if rollout.episodes is not None:
                episode = rollout.episodes[i]
                mask = torch.tensor(episode.loss_mask, dtype=torch.float32)
                step_rewards.append(_step_rewards(episode, mask, rewards[i] - episode.reward))
            masks.append(torch.zeros_like(mask) if dropped else mask)
            log_probs.append(torch.tensor(gen.log_probs, dtype=torch.float32))
        batches.append(
            RolloutBatch(
                tokens=tokens,
                response_lengths=lengths,
                loss_masks=masks,
                rewards=torch.tensor([rewards[i] for i in indices], dtype=torch.float32),
                sample_indices=list(indices),
                rollout_log_probs=log_probs,
                step_rewards=step_rewards if rollout.episodes is not None else None,
                teacher_log_probs=None
                if rollout.teacher_log_probs is None
                else [rollout.teacher_log_probs[i] for i in indices],
            )
        )
    return batches


def _step_rewards(episode: Episode, mask: torch.Tensor, extra: float) -> torch.Tensor:
    """An episode's rewards at their tokens, and `extra` at its last trainable token (if it has one)."""
    out = torch.tensor(episode.step_rewards(), dtype=torch.float32)
    trainable = torch.nonzero(mask).flatten()
    if extra != 0 and trainable.numel():
        out[int(trainable[-1])] += extra
    return out


def shard_per_role(
    rollout: Rollout,
    data_parallel_sizes: Mapping[str, int],
    *,
    rewards: Sequence[float] | None = None,
    filter_truncated: bool = False,
) -> tuple[dict[str, list[ObjectRef[RolloutBatch]]], dict[str, list[list[int]]]]:
    """Per role, the rollout cut in that role's data-parallel shares and put in Ray's object store.

    Returns (object refs per rank, sample indices per rank), both by role; roles with the
    same data-parallel size share the same refs (a critic may have its own layout).
    `rewards`, `filter_truncated`: as `to_train_batches` takes them.
    """
    data_refs: dict[str, list[ObjectRef[RolloutBatch]]] = {}
    sample_indices: dict[str, list[list[int]]] = {}
    for role, dp in data_parallel_sizes.items():
        same = next((r for r in data_refs if data_parallel_sizes[r] == dp), None)
        if same is not None:  # the same shares: built and put once
            data_refs[role], sample_indices[role] = data_refs[same], sample_indices[same]
            continue
        batches = to_train_batches(rollout, dp, rewards=rewards, filter_truncated=filter_truncated)
        sample_indices[role] = [b.sample_indices for b in batches]
        data_refs[role] = [ray.put(b) for b in batches]
    return data_refs, sample_indices
