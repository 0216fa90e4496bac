"""WorkerConfig: derived sizes and the ValueErrors that name the field and the fix."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.config import FieldError, WorkerConfig
from tandem.megatron.worker.train_step import minibatch_size


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("hf")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(path)


def make(hf_dir: str, **overrides: Any) -> WorkerConfig:
    fields: dict[str, Any] = {
        "hf_checkpoint": hf_dir,
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 2,
        "global_batch_size": 4,
        "micro_batch_size": 1,
        "device": "cpu",
        "params_dtype": "float32",
    }
    fields.update(overrides)
    return WorkerConfig(**fields)


def test_defaults_build_and_derive_sizes(hf_dir: str) -> None:
    config = make(hf_dir)
    assert config.samples_per_rollout == 8
    # One sequential pass over each rollout unless asked otherwise.
    assert (config.ppo_epochs, config.shuffle_minibatches, config.use_sequence_packing) == (1, False, False)
    assert config.topology("critic") == config.topology("actor") == (1, 1)


def test_role_fields_are_picked_by_role(hf_dir: str, tmp_path: Path) -> None:
    config = make(
        hf_dir,
        lr=1e-5,
        critic_lr=2e-5,
        save=str(tmp_path / "actor"),
        load=str(tmp_path / "actor"),
        critic_save=str(tmp_path / "critic"),
        critic_load=str(tmp_path / "critic"),
    )
    assert (config.lr_of("actor"), config.lr_of("critic")) == (1e-5, 2e-5)
    assert config.save_of("critic") == str(tmp_path / "critic")
    assert config.load_of("actor") == str(tmp_path / "actor")
    assert config.hf_checkpoint_of("critic") == hf_dir
    config.check_role("critic")
    with pytest.raises(ValueError, match="role"):
        config.lr_of("judge")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_coef": float("nan")}, "kl_coef"),
        ({"kl_coef": float("inf")}, "kl_coef"),
        ({"kl_penalty_type": "k4"}, "kl_penalty_type"),
        ({"use_tis": 1}, "use_tis"),
        ({"tis_cap": 0.5}, "tis_cap"),
        ({"tis_cap": float("inf")}, "tis_cap"),
        ({"tis_cap": "2"}, "tis_cap"),
        ({"critic_tensor_model_parallel_size": 0}, "critic_tensor_model_parallel_size"),
        ({"critic_pipeline_model_parallel_size": 1.5}, "critic_pipeline_model_parallel_size"),
        ({"global_batch_size": 3}, "global_batch_size"),
        ({"micro_batch_size": 8, "global_batch_size": 4}, "micro_batch_size"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"offload_backend": "torch_memory_saver"}, "offload_backend"),
        ({"offload_backend": "disk"}, "offload_backend"),
        ({"params_dtype": "bfloat16"}, "params_dtype"),
        ({"kl_loss_type": "k4"}, "kl_loss_type"),
        ({"eps_clip_c": 1.0}, "eps_clip_c"),
        ({"gamma": 1.5}, "gamma"),
        ({"min_lr": 1.0}, "min_lr"),
        ({"lr_warmup_steps": 5, "lr_decay_steps": 5}, "lr_decay_steps"),
        ({"temperature": 0.0}, "temperature"),
        ({"value_clip": 0.0}, "value_clip"),
        ({"eps_clip": 1.0}, "eps_clip"),
        ({"loss_aggregation": "seq_sum"}, "loss_aggregation"),
        ({"log_probs_chunk_tokens": -1}, "log_probs_chunk_tokens"),
        ({"log_probs_chunk_tokens": 1.5}, "log_probs_chunk_tokens"),
        ({"log_probs_chunk_tokens": True}, "log_probs_chunk_tokens"),
        ({"log_probs_micro_batch_size": 0}, "log_probs_micro_batch_size"),
        ({"log_probs_micro_batch_size": True}, "log_probs_micro_batch_size"),
        (
            {"log_probs_micro_batch_size": 4, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 64},
            r"^log_probs_micro_batch_size: set, but `use_dynamic_batch_size`.*`log_probs_max_tokens_per_gpu`",
        ),
        ({"critic_updates_per_step": 0}, "critic_updates_per_step"),
        ({"critic_updates_per_step": 1.5}, "critic_updates_per_step"),
        ({"critic_lambd": 1.5}, "critic_lambd"),
        ({"length_adaptive_gae_alpha": 0.0}, "length_adaptive_gae_alpha"),
        ({"length_adaptive_gae_alpha": -0.05}, "length_adaptive_gae_alpha"),
        ({"length_adaptive_gae_alpha": float("inf")}, "length_adaptive_gae_alpha"),
        ({"reward_clip": 0.0}, "reward_clip"),
        ({"kl_target": -0.1, "kl_coef": 0.01}, "kl_target"),
        ({"kl_horizon": 0}, "kl_horizon"),
        ({"loss_norm_tokens": 0}, "loss_norm_tokens"),
        ({"use_tis": True, "tis_cap_low": 1.5}, "tis_cap_low"),
        ({"tis_mode": "sequence"}, "tis_mode"),
        ({"kl_loss_type": "k2+"}, "kl_loss_type"),
        ({"opd_coef": -1.0}, "opd_coef"),
        ({"opd_coef": float("nan")}, "opd_coef"),
        ({"opd_coef": 1.0, "opd_mode": "advantage"}, "opd_mode"),
        ({"packed_attention": "flash"}, "packed_attention"),
        ({"packed_attention": "varlen"}, r"^packed_attention: .*`use_sequence_packing` is off"),
        (
            {"packed_attention": "varlen", "use_sequence_packing": True},
            r"^packed_attention: .*CUDA with bfloat16",
        ),
    ],
)
def test_bad_values_name_the_field(hf_dir: str, overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make(hf_dir, **overrides)


@settings(max_examples=40, deadline=None)
@given(
    micro=st.integers(1, 8),
    forward=st.none() | st.integers(1, 64),
    tokens=st.none() | st.integers(1, 4096),
    forward_tokens=st.none() | st.integers(1, 8192),
)
def test_forward_only_micro_batches_default_to_twice_the_training_ones(
    hf_dir: str, micro: int, forward: int | None, tokens: int | None, forward_tokens: int | None
) -> None:
    by_tokens = tokens is not None
    config = make(
        hf_dir,
        rollout_batch_size=8,
        global_batch_size=8,
        micro_batch_size=micro if 8 % micro == 0 else 1,
        log_probs_micro_batch_size=None if by_tokens else forward,
        use_dynamic_batch_size=by_tokens,
        max_tokens_per_gpu=tokens,
        log_probs_max_tokens_per_gpu=forward_tokens,
    )
    # Cut by count: the given size, else twice the training micro-batch.
    expected = forward if forward is not None and not by_tokens else 2 * config.micro_batch_size
    assert config.forward_micro_batch_size == expected
    if not by_tokens:
        assert config.micro_batch_tokens(forward_only=True) is None
        assert config.micro_batch_tokens(forward_only=False) is None
        return
    # Cut by tokens: the given forward-only budget, else twice the training one.
    assert tokens is not None
    assert config.micro_batch_tokens(forward_only=False) == tokens
    expected_tokens = forward_tokens if forward_tokens is not None else 2 * tokens
    assert config.micro_batch_tokens(forward_only=True) == expected_tokens


def test_checkpoint_folders(hf_dir: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hf_checkpoint"):
        make(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="ref_load"):
        make(hf_dir, ref_load=str(tmp_path))
    # A load folder that does not exist is a typo, unless it is the run's own save folder.
    with pytest.raises(ValueError, match="load"):
        make(hf_dir, load=str(tmp_path / "typo"))
    make(hf_dir, load=str(tmp_path / "fresh"), save=str(tmp_path / "fresh"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="load"):
        make(hf_dir, load=str(tmp_path / "a_file"))
    # The critic never shares the actor's folders.
    with pytest.raises(ValueError, match="critic_save"):
        make(hf_dir, save=str(tmp_path / "x"), critic_save=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="critic_load"):
        make(hf_dir, load=str(tmp_path), critic_load=str(tmp_path))


def test_critic_needs_its_own_folders_when_the_actor_has_them(hf_dir: str, tmp_path: Path) -> None:
    config = make(hf_dir, save=str(tmp_path / "actor"))
    config.check_role("actor")
    with pytest.raises(ValueError, match="critic_save"):
        config.check_role("critic")
    config = make(hf_dir, load=str(tmp_path), critic_save=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="critic_load"):
        config.check_role("critic")


def test_world_checks(hf_dir: str) -> None:
    config = make(hf_dir, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        config.check_world(3)
    with pytest.raises(ValueError, match="world_size"):
        config.check_world(0)
    with pytest.raises(ValueError, match="global_batch_size"):
        # dp = 8 / 2 = 4 does not divide global_batch_size 4 / micro 2 ... 4 % (2 * 4) != 0
        dataclasses.replace(config, micro_batch_size=2).check_world(8)


def test_reward_level_kl_and_tis_are_accepted(hf_dir: str) -> None:
    # kl_coef != 0 runs the KL-first plan; the actor then keeps reference weights.
    config = make(hf_dir, kl_coef=0.05, kl_penalty_type="k3", use_tis=True, tis_cap=1.5)
    assert config.needs_reference and not make(hf_dir).needs_reference
    assert (config.kl_coef, config.kl_penalty_type, config.use_tis, config.tis_cap) == (0.05, "k3", True, 1.5)
    assert (make(hf_dir).kl_penalty_type, make(hf_dir).use_tis, make(hf_dir).tis_cap) == ("k1", False, 2.0)


def test_the_critic_may_have_its_own_layout_on_the_same_ranks(hf_dir: str) -> None:
    config = make(hf_dir, tensor_model_parallel_size=2, critic_tensor_model_parallel_size=1)
    assert config.topology("actor") == (2, 1) and config.topology("critic") == (1, 1)
    config.check_world(2)
    config.check_world(2, role="critic")
    assert (config.data_parallel_size(2, "actor"), config.data_parallel_size(2, "critic")) == (1, 2)
    # Each layout must cover the same ranks: TP * PP divides the world for each role.
    odd = make(hf_dir, critic_pipeline_model_parallel_size=3)
    odd.check_world(2, role="actor")
    with pytest.raises(
        FieldError,
        match=r"critic_tensor_model_parallel_size: 1 times `critic_pipeline_model_parallel_size` \(3\)",
    ) as raised:
        odd.check_world(2, role="critic")
    assert (raised.value.field, raised.value.mentions) == (
        "critic_tensor_model_parallel_size",
        ("critic_pipeline_model_parallel_size",),
    )
    with pytest.raises(ValueError, match="critic_pipeline"):
        odd.check_world(2)
    # The critic's own data-parallel size must divide the batch, too.
    wide = make(hf_dir, global_batch_size=2, rollout_batch_size=2, n_samples_per_prompt=1)
    with pytest.raises(ValueError, match=r"global_batch_size: .* critic's data-parallel size"):
        dataclasses.replace(
            wide, tensor_model_parallel_size=4, critic_tensor_model_parallel_size=1
        ).check_world(4)
    with pytest.raises(ValueError, match="role"):
        config.check_world(2, role="judge")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    rollout=st.integers(1, 16),
    n=st.integers(1, 4),
    gbs=st.integers(1, 32),
    mbs=st.integers(1, 8),
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    world=st.integers(1, 8),
)
def test_batch_sizes_either_divide_or_fail_with_the_field(
    hf_dir: str, rollout: int, n: int, gbs: int, mbs: int, tp: int, pp: int, world: int
) -> None:
    fields = {
        "rollout_batch_size": rollout,
        "n_samples_per_prompt": n,
        "global_batch_size": gbs,
        "micro_batch_size": mbs,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
    }
    fits = (rollout * n) % gbs == 0 and world % (tp * pp) == 0 and gbs % (mbs * (world // (tp * pp))) == 0
    try:
        config = make(hf_dir, **fields)
        config.check_world(world)
    except ValueError as error:
        assert not fits
        assert any(name in str(error) for name in fields), str(error)
        return
    assert fits
    dp = world // (tp * pp)
    # One rollout is a whole number of optimizer steps, each a whole number of micro-batches per rank.
    per_rank = minibatch_size(gbs, dp, rollout * n // dp)
    assert per_rank * dp == gbs and per_rank % mbs == 0
    assert (rollout * n) % gbs == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("ppo_epochs", 0), ("ppo_epochs", 1.5), ("shuffle_minibatches", 1), ("use_sequence_packing", "yes")],
)
def test_pass_flags_are_checked_by_name(hf_dir: str, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        make(hf_dir, **{field: value})


def test_sequence_packing_is_accepted_with_any_batch_and_parallel_shape(hf_dir: str) -> None:
    # Packing changes only the layout of a micro-batch (tests/megatron/test_packing.py): it needs
    # nothing of the other fields, whatever the micro-batch size or parallelism.
    for extra in ({}, {"micro_batch_size": 2}, {"tensor_model_parallel_size": 2}):
        assert make(hf_dir, use_sequence_packing=True, **extra).use_sequence_packing is True


def test_choice_errors_list_what_the_literal_admits(hf_dir: str) -> None:
    with pytest.raises(
        ValueError, match="loss_aggregation: got 'mean'; choose one of sample_mean, token_mean"
    ):
        make(hf_dir, loss_aggregation="mean")


@pytest.mark.parametrize(
    ("overrides", "first", "second"),
    [
        (
            {"advantage_estimator": "grpo", "n_samples_per_prompt": 1, "rollout_batch_size": 8},
            "advantage_estimator",
            "n_samples_per_prompt",
        ),
        (
            {"advantage_estimator": "rloo", "n_samples_per_prompt": 1, "rollout_batch_size": 8},
            "advantage_estimator",
            "n_samples_per_prompt",
        ),
        (
            {
                "advantage_estimator": "reinforce_plus_plus_baseline",
                "n_samples_per_prompt": 1,
                "rollout_batch_size": 8,
            },
            "advantage_estimator",
            "n_samples_per_prompt",
        ),
        ({"advantage_estimator": "grpo", "kl_coef": 0.01}, "kl_coef", "advantage_estimator"),
        ({"advantage_estimator": "rloo", "kl_coef": 0.01}, "kl_coef", "advantage_estimator"),
        ({"loss_type": "gspo", "loss_aggregation": "token_mean"}, "loss_aggregation", "loss_type"),
        ({"advantage_estimator": "ppo"}, "advantage_estimator", "gae"),
        ({"loss_type": "grpo"}, "loss_type", "gspo"),
        ({"grpo_std_normalization": "no"}, "grpo_std_normalization", "True or False"),
        ({"loss_type": "cispo", "eps_clip_c": 3.0}, "eps_clip_c", "loss_type"),
        ({"loss_aggregation": "seq_mean_token_sum_norm"}, "loss_norm_tokens", "loss_aggregation"),
        (
            {"advantage_estimator": "reinforce_plus_plus_baseline", "gamma": 0.99},
            "gamma",
            "reinforce_plus_plus",
        ),
        ({"advantage_estimator": "grpo", "critic_updates_per_step": 2}, "critic_updates_per_step", "gae"),
        (
            {"advantage_estimator": "grpo", "length_adaptive_gae_alpha": 0.05},
            "length_adaptive_gae_alpha",
            "gae",
        ),
        ({"advantage_estimator": "rloo", "critic_lambd": 1.0}, "critic_lambd", "gae"),
        ({"kl_target": 0.1}, "kl_target", "kl_coef"),
        ({"kl_target": 0.1, "kl_coef": 0.01, "kl_horizon": 1}, "kl_horizon", "kl_horizon"),
        ({"tis_mode": "seq_mask"}, "tis_mode", "use_tis"),
        ({"tis_cap_low": 0.5}, "tis_cap_low", "use_tis"),
        ({"advantage_estimator": "grpo", "opd_coef": 1.0}, "opd_mode", "advantage_estimator"),
        ({"advantage_estimator": "rloo", "opd_coef": 1.0}, "opd_mode", "set `opd_mode` to loss"),
        ({"opd_mode": "loss"}, "opd_mode", "opd_coef"),
    ],
)
def test_estimator_combinations_are_refused_naming_both_fields(
    hf_dir: str, overrides: dict[str, Any], first: str, second: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{first}: ") as info:
        make(hf_dir, **overrides)
    assert second in str(info.value)


def test_estimators_accept_what_they_need(hf_dir: str) -> None:
    for estimator in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        config = make(hf_dir, advantage_estimator=estimator, loss_type="gspo")
        assert config.uses_critic == (estimator == "gae")
    # REINFORCE++ takes the KL in its token rewards; a single sample per prompt is fine for it.
    make(
        hf_dir,
        advantage_estimator="reinforce_plus_plus",
        kl_coef=0.01,
        n_samples_per_prompt=1,
        rollout_batch_size=8,
    )
    make(hf_dir, advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.01)
    make(
        hf_dir, advantage_estimator="grpo", use_kl_loss=True, kl_loss_coef=0.001, grpo_std_normalization=False
    )


def test_the_new_algorithm_fields_are_accepted_where_they_apply(hf_dir: str) -> None:
    # VAPO (decoupled and length-adaptive GAE), SAO's critic updates, CISPO, Dr.GRPO's loss, the
    # adaptive KL controller, reward clipping and both TIS variants with a lower bound.
    config = make(
        hf_dir,
        lambd=0.95,
        critic_lambd=1.0,
        length_adaptive_gae_alpha=0.05,
        critic_updates_per_step=2,
        loss_type="cispo",
        eps_clip_high=0.28,
        kl_coef=0.01,
        kl_target=0.1,
        reward_clip=10.0,
        use_tis=True,
        tis_cap_low=0.5,
        tis_mode="seq_mask",
    )
    assert (config.critic_lambda, config.critic_passes) == (1.0, 2)
    assert make(hf_dir, lambd=0.9).critic_lambda == 0.9
    make(
        hf_dir,
        advantage_estimator="grpo",
        grpo_std_normalization=False,
        loss_aggregation="seq_mean_token_sum_norm",
        loss_norm_tokens=512,
    )
    for kind in ("abs", "k3+", "low_var_kl+"):
        make(hf_dir, use_kl_loss=True, kl_loss_type=kind)


def test_several_critic_updates_take_the_old_values_from_a_forward_of_their_own(hf_dir: str) -> None:
    # One epoch and one step would let the update's forward give the old values; a second pass
    # trains against the first's, so they must come from a forward of their own.
    one_step = {"global_batch_size": 8}  # the rollout's 4 × 2 samples
    assert make(hf_dir, **one_step).reuses_old_values
    config = make(hf_dir, critic_updates_per_step=2, **one_step)
    assert not config.reuses_old_values
    assert "critic_updates_per_step" in (config.old_values_redundant() or "")
    with pytest.raises(ValueError, match=r"^reuse_old_values: .*critic_updates_per_step"):
        make(hf_dir, critic_updates_per_step=2, reuse_old_values=True, **one_step)


def test_distillation_in_the_rewards_plans_the_kl_first_step_and_keeps_the_old_log_probs(hf_dir: str) -> None:
    one_step = {"global_batch_size": 8}
    reward = make(hf_dir, opd_coef=1.0, **one_step)
    # The critic's returns need the student's log-probs before it trains; no reference weights for it.
    assert reward.kl_first and reward.opd_in_rewards and not reward.needs_reference
    assert not reward.reuses_old_log_probs
    assert "opd_coef" in (reward.old_log_probs_redundant() or "")
    with pytest.raises(ValueError, match=r"^reuse_old_log_probs: .*opd_coef"):
        make(hf_dir, opd_coef=1.0, reuse_old_log_probs=True, **one_step)
    # As a loss term it changes no plan, and every estimator takes it.
    loss = make(hf_dir, opd_coef=1.0, opd_mode="loss", **one_step)
    assert not loss.kl_first and loss.reuses_old_log_probs
    make(hf_dir, advantage_estimator="grpo", opd_coef=1.0, opd_mode="loss")
    # Without a critic the actor folds it in its own step: no KL-first plan.
    assert not make(hf_dir, advantage_estimator="reinforce_plus_plus", opd_coef=1.0).kl_first


def test_no_critic_worker_for_a_critic_free_estimator(hf_dir: str) -> None:
    config = make(hf_dir, advantage_estimator="grpo")
    config.check_role("actor")
    with pytest.raises(ValueError, match=r"^advantage_estimator: grpo needs no critic"):
        config.check_role("critic")


@given(
    field=st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True),
    words=st.lists(
        st.sampled_from(["got 3", "set", "`lambd`", "`kl_coef`", "or unset", "{x}", "%s"]), max_size=6
    ),
)
def test_a_field_error_renders_its_parts_and_survives_pickling(field: str, words: list[str]) -> None:
    import pickle

    message = " ".join(words)
    mentions = tuple(dict.fromkeys(w.strip("`") for w in words if w.startswith("`")))
    error = FieldError(field, message, *mentions)
    assert str(error) == f"{field}: {message}"
    # Rendering the field bare and each mention in backticks gives the plain text back; the
    # renderer is asked for the field, then each mention, and nothing else.
    seen: list[str] = []

    def name(of: str) -> str:
        seen.append(of)
        return of if len(seen) == 1 else f"`{of}`"

    assert error.render(name) == str(error)
    assert seen == [field, *mentions]
    assert error.render(str.upper).startswith(f"{field.upper()}: ")
    rebuilt = pickle.loads(pickle.dumps(error))
    assert (rebuilt.field, rebuilt.message, rebuilt.mentions, str(rebuilt)) == (
        field,
        message,
        mentions,
        str(error),
    )


def test_a_field_error_refuses_a_mention_its_message_does_not_name() -> None:
    with pytest.raises(TypeError, match="gamma"):
        FieldError("kl_coef", "set gamma to 1", "gamma")
