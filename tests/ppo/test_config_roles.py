"""PPOConfig composes the workers' configs: it holds their fields and builds one validated WorkerConfig per role.

`PPOConfig` is not a `WorkerConfig`: it shares only the check-free `WorkerFields`,
so a YAML file and flags merge without a check, and `actor_config()` /
`critic_config()` build the workers' configs, which run `WorkerConfig`'s checks
(the one place they run). The round trip draws values of every worker field,
gives them as flags, and finds each in both roles' configs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.megatron.config import FieldError, WorkerConfig, WorkerFields
from tandem.ppo.config import PPOConfig, checks, flag
from tandem.ppo.config.file import parse_config, unvalidated

from ._config_files import write_config_files

CRITIC_FREE = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")

FOLDERS = ("save", "load", "critic_save", "critic_load")
"""The worker fields that each role's config resolves (`actor_save`, `critic_save_dir`)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_config_files(tmp_path_factory.mktemp("roles"))


def cpu_run(files: dict[str, str], **values: Any) -> PPOConfig:
    base = {**files, "device": "cpu", "params_dtype": "float32", "rollout_batch_size": 4}
    return unvalidated({**base, "global_batch_size": 4, "n_samples_per_prompt": 2, **values})


def test_the_run_config_is_not_a_worker_config_and_checks_nothing_when_built(files: dict[str, str]) -> None:
    assert issubclass(PPOConfig, WorkerFields) and not issubclass(PPOConfig, WorkerConfig)
    assert "__post_init__" not in vars(PPOConfig) and not hasattr(WorkerFields, "__post_init__")
    broken = cpu_run(files, lr=-1.0)  # a worker rule broken: nothing is checked yet
    assert not isinstance(broken, WorkerConfig)
    assert {f.name for f in dataclasses.fields(WorkerFields)} <= {
        f.name for f in dataclasses.fields(PPOConfig)
    }


def test_the_role_configs_are_validated_worker_configs(files: dict[str, str]) -> None:
    config = cpu_run(files)
    actor, critic = config.actor_config(), config.critic_config()
    assert type(actor) is WorkerConfig and type(critic) is WorkerConfig
    assert actor.lr_of("actor") == config.lr and critic.lr_of("critic") == config.critic_lr


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"lr": -1.0}, "lr"),
        ({"critic_lr": -1.0}, "critic_lr"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"tis_cap": 0.5}, "tis_cap"),
        ({"lr_warmup_steps": 5, "lr_decay_steps": 5}, "lr_decay_steps"),
        ({"use_dynamic_batch_size": True}, "max_tokens_per_gpu"),
        ({"advantage_estimator": "grpo", "kl_coef": 0.1}, "kl_coef"),  # mentions four other fields
    ],
)
def test_a_broken_worker_rule_is_the_worker_configs_error_naming_the_flag_at_validate(
    files: dict[str, str], values: dict[str, Any], field: str
) -> None:
    config = cpu_run(files, **values)
    with pytest.raises(ValueError) as built:
        config.actor_config()
    assert str(built.value).startswith(f"{field}: "), built.value
    with pytest.raises(ValueError) as validated:
        config.validate()
    assert str(validated.value).startswith(f"{flag(field)}: "), validated.value
    # The same refusal, its field and each field it mentions turned into their flags, from the
    # error's own parts (nothing parsed back out of its text): the check ran in WorkerConfig only.
    assert isinstance(built.value, FieldError) and built.value.field == field
    assert str(validated.value) == built.value.render(flag)
    for mentioned in built.value.mentions:
        assert f"`{mentioned}`" in str(built.value) and flag(mentioned) in str(validated.value)


def test_a_rule_of_the_critics_folders_is_refused_by_the_critics_config(files: dict[str, str]) -> None:
    shared = str(Path(files["run_dir"]) / "shared")
    config = cpu_run(files, save=shared, critic_save=shared)
    config.actor_config()  # the actor's config holds no critic folder
    # Both load from their save folders, so the loads are the first pair found shared.
    with pytest.raises(ValueError, match=r"^critic_load: .* is the actor's `load` folder"):
        config.critic_config()
    with pytest.raises(ValueError, match=r"^--critic-load: .* is the actor's --load folder"):
        config.validate()


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_a_critic_free_run_has_no_critic_config(files: dict[str, str], estimator: str) -> None:
    shared = str(Path(files["run_dir"]) / "shared")
    # Critic folders that a critic would refuse: no critic, so nothing reads them.
    config = cpu_run(files, advantage_estimator=estimator, save=shared, critic_save=shared)
    assert config.use_critic is False
    assert config.critic_config() is None
    actor = config.actor_config()
    assert actor.advantage_estimator == estimator and actor.critic_save is None and actor.critic_load is None
    config.validate()


def test_the_gae_run_has_a_critic_config_and_async_keeps_a_forward_for_the_old_log_probs(
    files: dict[str, str],
) -> None:
    config = cpu_run(files, async_mode=True, colocate=False, rollout_num_gpus=1)
    critic = config.critic_config()
    assert critic is not None and config.reuse_old_log_probs is None
    assert config.actor_config().reuse_old_log_probs is False and critic.reuse_old_log_probs is False
    assert cpu_run(files).actor_config().reuse_old_log_probs is None


def _one_of(*values: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


FREE: dict[str, st.SearchStrategy[Any]] = {
    "critic_hf_checkpoint": _one_of(None, "HF"),
    "ref_load": _one_of(None, "HF"),
    "load_rollout_id": _one_of(None, 0, 3),
    "critic_tensor_model_parallel_size": _one_of(None, 1, 2),
    "shuffle_minibatches": st.booleans(),
    "use_sequence_packing": st.booleans(),
    "packed_attention": _one_of("auto", "blocks"),  # varlen: CUDA only (tests/megatron/test_config.py)
    "log_probs_max_tokens_per_gpu": _one_of(None, 512),
    "log_probs_chunk_tokens": _one_of(0, 4096),
    "ppo_epochs": _one_of(1, 2),
    "lr": _one_of(1e-6, 3e-4),
    "critic_lr": _one_of(1e-5, 2e-6),
    "min_lr": _one_of(0.0, 1e-7),
    "lr_decay_style": _one_of("constant", "linear", "cosine", "inverse-square-root"),
    "lr_warmup_steps": _one_of(0, 5),
    "lr_decay_steps": _one_of(None, 10),
    "weight_decay": _one_of(0.0, 0.1),
    "adam_beta1": _one_of(0.9, 0.8),
    "adam_beta2": _one_of(0.98, 0.999),
    "adam_eps": _one_of(1e-8, 1e-6),
    "clip_grad": _one_of(1.0, 0.0, 0.5),
    "params_dtype": _one_of("float32"),
    "eps_clip": _one_of(0.2, 0.1),
    "eps_clip_high": _one_of(None, 0.28),
    "eps_clip_c": _one_of(None, 3.0),
    "value_clip": _one_of(0.5, None, 0.2),
    "gamma": _one_of(1.0, 0.99),
    "lambd": _one_of(1.0, 0.95),
    "kl_penalty_type": _one_of("k1", "k2", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+"),
    "kl_horizon": _one_of(10000, 1000),
    "reward_clip": _one_of(None, 10.0),
    "loss_norm_tokens": _one_of(None, 512),
    "use_kl_loss": st.booleans(),
    "kl_loss_coef": _one_of(0.001, 0.01),
    "kl_loss_type": _one_of("k1", "k2", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+"),
    "entropy_coef": _one_of(0.0, 0.01),
    "normalize_advantages": st.booleans(),
    "grpo_std_normalization": st.booleans(),
    "use_tis": st.booleans(),
    "tis_cap": _one_of(2.0, 1.5),
    "reuse_old_log_probs": _one_of(None, False),
    "reuse_old_values": _one_of(None, False),
    "temperature": _one_of(1.0, 0.7),
    "device": _one_of("cpu"),
    "fused_rope": _one_of(None, False),
    "cpu_threads": _one_of(None, 1, 2),
    "fused_log_probs": _one_of(None, False),
    "head_at_responses": st.booleans(),
    "jit_fusions": st.booleans(),
    "fused_swiglu": _one_of(None, False, True),
    "offload_backend": _one_of("pinned_host", "none"),
    "offload_grads": st.booleans(),
    "background_optimizer_wake": st.booleans(),
    "local_single_rank_groups": st.booleans(),
    "keep_single_rank_groups": st.booleans(),
    "make_vocab_size_divisible_by": _one_of(128, 64),
    "update_weights_chunk_bytes": _one_of(512 * 1024**2, 1024**2),
    "seed": st.integers(0, 2**31 - 1),
}
"""Worker fields whose valid values combine freely (on 2 CPU ranks of the small Llama); "HF": the model folder."""

DEPENDENT = (
    "hf_checkpoint",
    "rollout_batch_size",
    "global_batch_size",
    "n_samples_per_prompt",
    "micro_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "critic_pipeline_model_parallel_size",
    "use_dynamic_batch_size",
    "max_tokens_per_gpu",
    "log_probs_micro_batch_size",
    "advantage_estimator",
    "kl_coef",
    "loss_type",
    "loss_aggregation",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "critic_lora_rank",
    "critic_lora_alpha",
    "critic_lora_dropout",
    "critic_lora_target_modules",
    "lora_base_offload",
    "lora_base_share",
    "kl_target",
    "tis_cap_low",
    "tis_mode",
    "critic_lambd",
    "length_adaptive_gae_alpha",
    "critic_updates_per_step",
    "opd_coef",
    "opd_mode",
    "optimizer_pieces",
)
"""Worker fields drawn together in `worker_values`, since their rules tie them to each other."""


def test_every_worker_field_takes_part_in_the_round_trip() -> None:
    drawn = [*FREE, *DEPENDENT, *FOLDERS]
    assert sorted(drawn) == sorted(f.name for f in dataclasses.fields(WorkerFields))
    assert len(drawn) == len(set(drawn))


@st.composite
def worker_values(draw: Any, files: dict[str, str]) -> dict[str, Any]:
    """Values of every worker field (`FREE`, `DEPENDENT`, `FOLDERS`) that a CPU run on 2 ranks accepts."""
    values = {name: draw(strategy, label=name) for name, strategy in FREE.items()}
    for name in ("critic_hf_checkpoint", "ref_load"):
        values[name] = files["hf_checkpoint"] if values[name] == "HF" else values[name]
    layouts = [(1, 1), (2, 1), (1, 2)]  # TP x PP dividing the 2 ranks; 4 heads, 2 kv heads, 2 layers
    values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"] = draw(_one_of(*layouts))
    values["critic_pipeline_model_parallel_size"] = draw(_one_of(None, 1, 2))
    critic = (
        values["critic_tensor_model_parallel_size"] or values["tensor_model_parallel_size"],
        values["critic_pipeline_model_parallel_size"] or values["pipeline_model_parallel_size"],
    )
    if critic not in layouts:
        values["critic_pipeline_model_parallel_size"] = 1
        values["critic_tensor_model_parallel_size"] = 2
    values["hf_checkpoint"] = files["hf_checkpoint"]
    values["rollout_batch_size"] = draw(_one_of(4, 8))
    values["n_samples_per_prompt"] = draw(_one_of(2, 4))
    values["micro_batch_size"] = draw(_one_of(1, 2))
    values["global_batch_size"] = draw(_one_of(4, 8))  # a multiple of micro * DP (<= 2), divides 8..32
    values["use_dynamic_batch_size"] = draw(st.booleans())
    values["max_tokens_per_gpu"] = draw(_one_of(256, 1024)) if values["use_dynamic_batch_size"] else None
    # Samples of a forward-only pass: cut by count only (by tokens it is log_probs_max_tokens_per_gpu).
    values["log_probs_micro_batch_size"] = (
        None if values["use_dynamic_batch_size"] else draw(_one_of(None, 1, 8))
    )
    values["advantage_estimator"] = draw(_one_of("gae", *CRITIC_FREE))
    no_kl = values["advantage_estimator"] in ("grpo", "rloo")  # one reward per sample: no KL in it
    values["kl_coef"] = 0.0 if no_kl else draw(_one_of(0.0, 0.05))
    values["kl_target"] = draw(_one_of(None, 0.1)) if values["kl_coef"] else None  # steers a KL in the reward
    if values["advantage_estimator"] == "reinforce_plus_plus_baseline":
        values["gamma"] = 1.0  # its centred outcome reward is not discounted
    # CISPO's loss has no negative-advantage bound for dual clip to take.
    values["loss_type"] = draw(_one_of("ppo", "gspo", *(("cispo",) if values["eps_clip_c"] is None else ())))
    values["loss_aggregation"] = (
        "sample_mean"
        if values["loss_type"] == "gspo"
        else draw(_one_of("sample_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"))
    )
    for prefix in ("", "critic_"):  # LoRA's fields only with a rank (else refused, naming the flag)
        rank = values[f"{prefix}lora_rank"] = draw(_one_of(None, 4))
        values[f"{prefix}lora_alpha"] = draw(_one_of(None, 8.0)) if rank else None
        values[f"{prefix}lora_dropout"] = draw(_one_of(0.0, 0.1)) if rank else 0.0
        values[f"{prefix}lora_target_modules"] = (
            draw(_one_of(None, ("q_proj", "linear_fc2"))) if rank else None
        )
    values["lora_base_offload"] = draw(st.booleans())
    # Pieces of the optimizer's tags are the pinned-host backend's (else refused, naming the flag).
    pinned = values["offload_backend"] == "pinned_host"
    # One host copy of the two bases: both roles' LoRA, the bases asleep, pinned_host (else refused).
    both = values["lora_rank"] is not None and values["critic_lora_rank"] is not None
    values["lora_base_share"] = (
        draw(_one_of(None, True, False))
        if both and values["lora_base_offload"] and pinned
        else draw(_one_of(None, False))
    )
    values["optimizer_pieces"] = draw(_one_of(None, 1, 3)) if pinned else draw(_one_of(None, 1))
    values["tis_cap_low"] = draw(_one_of(0.0, 0.5)) if values["use_tis"] else 0.0
    values["tis_mode"] = draw(_one_of("token", "seq_mask")) if values["use_tis"] else "token"
    gae = values["advantage_estimator"] == "gae"  # the critic's own algorithms need one
    values["critic_lambd"] = draw(_one_of(None, 1.0)) if gae else None
    values["length_adaptive_gae_alpha"] = draw(_one_of(None, 0.05)) if gae else None
    values["critic_updates_per_step"] = draw(_one_of(1, 2)) if gae else 1
    # Distillation (its teacher, the model folder itself, is a run flag: `as_run_flags`); a per-sample
    # estimator takes one reward per sample, so the reverse KL goes into the loss there.
    values["opd_coef"] = draw(_one_of(0.0, 0.5))
    values["opd_mode"] = (
        "reward" if not values["opd_coef"] else "loss" if no_kl else draw(_one_of("reward", "loss"))
    )
    run_dir = Path(files["run_dir"])
    values["save"] = draw(_one_of(None, str(run_dir / "mine" / "actor")))
    values["load"] = draw(_one_of(None, values["save"]))  # a load folder that exists, or the save folder
    values["critic_save"] = draw(_one_of(None, str(run_dir / "mine" / "critic")))
    values["critic_load"] = draw(_one_of(None, values["critic_save"]))
    return values


def as_flags(values: dict[str, Any]) -> list[str]:
    """The command line that sets `values` (a `bool` field as `--x` / `--no-x`, a `bool | None` one as `--x False`)."""
    hints = get_type_hints(PPOConfig)
    argv: list[str] = []
    for name, value in values.items():
        if hints[name] is bool:
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, tuple):
            argv += [flag(name), *value]
        else:
            argv += [flag(name), str(value)]
    return argv


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_worker_field_reaches_both_roles_configs_from_its_flag(
    files: dict[str, str], data: st.DataObject, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The teacher's folder (tokenizer, architecture) is checked in tests/ppo/teacher/test_bad_input.py;
    # here the small Llama's config.json, which has no tokenizer, stands in for it.
    monkeypatch.setattr(checks, "check_teacher_config", lambda config: None)
    values = data.draw(worker_values(files))
    async_mode = data.draw(st.booleans(), label="async")
    run = [
        "--prompt-data",
        files["prompt_data"],
        "--run-dir",
        files["run_dir"],
        "--actor-num-gpus-per-node",
        "2",
    ]
    run += ["--async", "--no-colocate", "--rollout-num-gpus", "1"] if async_mode else []
    run += ["--teacher-hf-checkpoint", files["hf_checkpoint"]] if values["opd_coef"] else []
    config = parse_config([*run, *as_flags(values)])  # validated
    assert {name: getattr(config, name) for name in values} == values  # each flag reached its field

    run_dir = Path(files["run_dir"])
    actor_save = values["save"] or str(run_dir / "actor")
    critic_save = values["critic_save"] or str(run_dir / "critic")
    expected = dict(values, save=actor_save, load=values["load"] or actor_save)
    # Dr.GRPO's constant divisor defaults to the generation budget.
    expected["loss_norm_tokens"] = values["loss_norm_tokens"] or config.rollout_max_response_len
    if async_mode and values["reuse_old_log_probs"] is None:
        expected["reuse_old_log_probs"] = False  # a stale rollout: the old log-probs get a forward
    actor = config.actor_config()
    assert dataclasses.asdict(actor) == {**expected, "critic_save": None, "critic_load": None}
    critic = config.critic_config()
    if values["advantage_estimator"] != "gae":
        assert critic is None
        return
    assert critic is not None
    critic_folders = {"critic_save": critic_save, "critic_load": values["critic_load"] or critic_save}
    assert dataclasses.asdict(critic) == {**expected, **critic_folders}
    assert (critic.save_of("critic"), critic.load_of("critic")) == (
        critic_save,
        critic_folders["critic_load"],
    )
    assert (actor.save_of("actor"), actor.load_of("actor")) == (actor_save, expected["load"])
