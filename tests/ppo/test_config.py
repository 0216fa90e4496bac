"""The run config: YAML plus flags, every field documented, and validation that names the flag.

The fuzz tests draw configs from two strategies: one that stays inside the
documented constraints (never refused), and single mutations that break one
constraint each (always refused, naming that flag). Unconstrained draws must
either pass or be refused with a message that starts with a real flag.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.ppo.config import PPOConfig, flag
from tandem.ppo.config.file import config_fields, parse_config, unvalidated

from ._config_files import LLAMA_CONFIG, write_config_files

FLAGS = {flag(name) for name in config_fields()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_config_files(tmp_path_factory.mktemp("config"))


def valid_values(files: dict[str, str]) -> st.SearchStrategy[dict[str, Any]]:
    """Configs inside every documented constraint: batch sizes that divide, shares that fit, ..."""

    @st.composite
    def draw(d: Any) -> dict[str, Any]:
        gpus = d(st.sampled_from([1, 2, 4]))
        tp = d(st.sampled_from([t for t in (1, 2) if gpus % t == 0]))
        dp = gpus // tp
        micro = d(st.sampled_from([1, 2, 4]))
        global_batch = micro * dp * d(st.integers(1, 4))
        n_samples = d(st.integers(1, 4))
        steps = d(st.integers(1, 3))
        samples = global_batch * steps
        # rollout_batch_size * n_samples must be a multiple of global_batch_size
        rollout_batch = samples if samples % n_samples else samples // n_samples
        if (rollout_batch * n_samples) % global_batch:
            n_samples = 1
            rollout_batch = samples
        num_rollout = d(st.integers(1, 20))
        use_critic = d(st.booleans())
        # A critic exactly with GAE; the group estimators compare at least 2 samples per prompt.
        critic_free = ["reinforce_plus_plus"] + (
            ["grpo", "rloo", "reinforce_plus_plus_baseline"] if n_samples >= 2 else []
        )
        estimator = "gae" if use_critic else d(st.sampled_from(critic_free))
        # The critic's own algorithms (VAPO's λs, SAO's updates) exactly with a critic.
        critic_fields = (
            {
                "critic_lambd": d(st.none() | st.floats(0, 1)),
                "length_adaptive_gae_alpha": d(st.none() | st.floats(0.001, 1)),
                "critic_updates_per_step": d(st.integers(1, 3)),
            }
            if use_critic
            else {}
        )
        loss_type = d(st.sampled_from(["ppo", "gspo", "cispo"]))
        return {
            **files,
            "actor_num_gpus_per_node": gpus,
            "tensor_model_parallel_size": tp,
            "micro_batch_size": micro,
            "global_batch_size": global_batch,
            "rollout_batch_size": rollout_batch,
            "n_samples_per_prompt": n_samples,
            "num_rollout": num_rollout,
            "num_critic_only_steps": d(st.integers(0, num_rollout)) if use_critic else 0,
            "lr": d(st.floats(0, 1e-2)),
            "eps_clip": d(st.floats(0.01, 0.5)),
            # REINFORCE++-baseline's centred outcome reward takes γ = 1.
            "gamma": 1.0 if estimator == "reinforce_plus_plus_baseline" else d(st.floats(0, 1)),
            "lambd": d(st.floats(0, 1)),
            "use_critic": use_critic,
            "advantage_estimator": estimator,
            "loss_type": loss_type,
            # GSPO's objective is a mean over sequences; the others take any aggregation.
            "loss_aggregation": "sample_mean"
            if loss_type == "gspo"
            else d(
                st.sampled_from(
                    ["sample_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
                )
            ),
            "reward_clip": d(st.none() | st.floats(0.1, 100)),
            **critic_fields,
            "overlong_buffer_len": d(st.none() | st.integers(1, 128)),
            "filter_truncated": d(st.booleans()),
            "offload_train": d(st.booleans()),
            "rollout_top_p": d(st.floats(0.05, 1)),
            "save_interval": d(st.none() | st.integers(1, 10)),
            "device": "cpu",
            "params_dtype": "float32",
        }

    return draw()


# Each breaks exactly one documented rule of a valid config; the flag the error must name.
BREAKERS: list[tuple[str, Any]] = [
    ("--global-batch-size", lambda v: {**v, "global_batch_size": v["global_batch_size"] * 1000 + 1}),
    ("--micro-batch-size", lambda v: {**v, "micro_batch_size": 0}),
    ("--kl-coef", lambda v: {**v, "kl_coef": -0.1}),
    ("--hf-checkpoint", lambda v: {**v, "hf_checkpoint": v["hf_checkpoint"] + "-missing"}),
    ("--prompt-data", lambda v: {**v, "prompt_data": v["prompt_data"] + ".missing"}),
    ("--num-critic-only-steps", lambda v: {**v, "num_critic_only_steps": v["num_rollout"] + 1}),
    ("--num-rollout", lambda v: {**v, "num_rollout": 0}),
    ("--rollout-top-p", lambda v: {**v, "rollout_top_p": 1.5}),
    ("--eps-clip", lambda v: {**v, "eps_clip": 1.5}),
    ("--gamma", lambda v: {**v, "gamma": 2.0}),
    ("--rm-type", lambda v: {**v, "rm_type": "no-such-reward"}),
    ("--custom-rm-path", lambda v: {**v, "custom_rm_path": "no_colon_here"}),
    ("--eval-interval", lambda v: {**v, "eval_interval": 2, "eval_prompt_data": None}),
    ("--rollout-num-gpus", lambda v: {**v, "rollout_num_gpus": v["actor_num_gpus_per_node"] + 1}),
    ("--engine-gpu-share", lambda v: {**v, "engine_gpu_share": 0.9, "actor_gpu_share": 0.9}),
    (
        "--use-critic",
        lambda v: {**v, "use_critic": True, "advantage_estimator": "gae", "train_backend": "fsdp"},
    ),
    (
        "--critic-",
        lambda v: {
            **v,
            "use_critic": True,
            "advantage_estimator": "gae",
            "critic_save": v["run_dir"] + "/a",
            "save": v["run_dir"] + "/a",
        },
    ),
    ("--tensor-model-parallel-size", lambda v: {**v, "tensor_model_parallel_size": 3}),
    ("--use-critic", lambda v: {**v, "use_critic": True, "advantage_estimator": "reinforce_plus_plus"}),
    (
        "--advantage-estimator",
        lambda v: {**v, "use_critic": False, "advantage_estimator": "gae", "num_critic_only_steps": 0},
    ),
    ("--overlong-buffer-len", lambda v: {**v, "overlong_buffer_len": 129}),  # > rollout_max_response_len
    ("--overlong-penalty-factor", lambda v: {**v, "overlong_penalty_factor": -1.0}),
    (
        "--filter-truncated",
        lambda v: {**v, "filter_truncated": True, "rollout_ignore_eos": True, "overlong_buffer_len": None},
    ),
    ("--loss-aggregation", lambda v: {**v, "loss_type": "gspo", "loss_aggregation": "token_mean"}),
    ("--critic-updates-per-step", lambda v: {**v, "critic_updates_per_step": 0}),
    ("--length-adaptive-gae-alpha", lambda v: {**v, "length_adaptive_gae_alpha": 0.0}),
    (
        "--eps-clip-c",
        lambda v: {**v, "loss_type": "cispo", "loss_aggregation": "sample_mean", "eps_clip_c": 3.0},
    ),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_valid_config_is_refused(files: dict[str, str], data: st.DataObject) -> None:
    values = data.draw(valid_values(files))
    unvalidated(values).validate()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), breaker=st.sampled_from(BREAKERS))
def test_every_broken_rule_is_refused_naming_its_flag(
    files: dict[str, str], data: st.DataObject, breaker: tuple[str, Any]
) -> None:
    name, breaks = breaker
    values = breaks(data.draw(valid_values(files)))
    with pytest.raises(ValueError) as info:
        unvalidated(values).validate()
    assert name in str(info.value), str(info.value)


SCALARS = {
    "rollout_batch_size": st.integers(-2, 64),
    "global_batch_size": st.integers(-2, 64),
    "micro_batch_size": st.integers(-2, 8),
    "n_samples_per_prompt": st.integers(-1, 8),
    "num_rollout": st.integers(-1, 5),
    "num_critic_only_steps": st.integers(-1, 6),
    "actor_num_gpus_per_node": st.integers(0, 4),
    "tensor_model_parallel_size": st.integers(0, 3),
    "rollout_num_gpus": st.none() | st.integers(0, 4),
    "lr": st.floats(-1, 1) | st.just(float("nan")),
    "eps_clip": st.floats(-1, 2) | st.just(float("nan")),
    "gamma": st.floats(-1, 2),
    "kl_coef": st.sampled_from([-0.1, 0.0, 0.1]),
    "rollout_top_p": st.floats(-1, 2),
    "rollout_top_k": st.integers(-3, 5),
    "eval_interval": st.none() | st.integers(-1, 3),
    "actor_gpu_share": st.floats(-0.5, 1.5),
    "colocate": st.booleans(),
    "use_critic": st.booleans(),
    "advantage_estimator": st.sampled_from(["gae", "grpo", "rloo", "reinforce_plus_plus", "ppo"]),
    "loss_type": st.sampled_from(["ppo", "gspo", "bad"]),
    "overlong_buffer_len": st.none() | st.integers(-1, 200),
    "filter_truncated": st.booleans(),
    "rollout_ignore_eos": st.booleans(),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_refusal_names_a_real_flag(files: dict[str, str], data: st.DataObject) -> None:
    values = {**files, "device": "cpu", "params_dtype": "float32"}
    for name, strategy in SCALARS.items():
        if data.draw(st.booleans(), label=f"set {name}"):
            values[name] = data.draw(strategy, label=name)
    try:
        unvalidated(values).validate()
    except ValueError as exc:
        first = str(exc).split(":", 1)[0].split(" ", 1)[0]
        assert first in FLAGS, f"refusal does not start with a flag: {exc}"


def test_yaml_then_flags(files: dict[str, str], tmp_path: Path) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                **files,
                "rollout-batch-size": 8,
                "global_batch_size": 8,
                "device": "cpu",
                "params_dtype": "float32",
            }
        )
    )
    config = parse_config(["--config", str(config_file), "--rollout-batch-size", "16", "--no-offload-train"])
    assert config.rollout_batch_size == 16  # the flag wins over the file
    assert config.global_batch_size == 8  # the file wins over the default
    assert config.offload_train is False


def test_unknown_yaml_key_is_refused(files: dict[str, str], tmp_path: Path) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({**files, "rollout_batch_sise": 8}))
    with pytest.raises(ValueError, match="rollout_batch_sise"):
        parse_config(["--config", str(config_file)])


def _documented_fields(cls: type) -> set[str]:
    """Names of the class's annotated fields that a string literal (a field docstring) follows."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    return {
        stmt.target.id
        for stmt, after in itertools.pairwise(body)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }


def test_every_field_is_documented_and_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    documented = set().union(
        *(_documented_fields(c) for c in PPOConfig.__mro__ if dataclasses.is_dataclass(c))
    )
    missing = [f.name for f in dataclasses.fields(PPOConfig) if f.name not in documented]
    assert not missing, f"fields without a docstring: {missing}"
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = capsys.readouterr().out
    assert [f.name for f in dataclasses.fields(PPOConfig) if flag(f.name) not in text] == []


def test_the_role_configs_resume_from_the_run_dir(files: dict[str, str]) -> None:
    config = unvalidated(
        {**files, "device": "cpu", "params_dtype": "float32", "rollout_batch_size": 4, "global_batch_size": 4}
    )
    actor, critic = config.actor_config(), config.critic_config()
    assert critic is not None
    actor_dir, critic_dir = str(Path(files["run_dir"]) / "actor"), str(Path(files["run_dir"]) / "critic")
    assert actor.save_of("actor") == actor.load_of("actor") == actor_dir
    assert actor.critic_save is None and actor.critic_load is None  # the actor never reads them
    assert critic.save_of("critic") == critic.load_of("critic") == critic_dir
    assert critic.save == critic.load == actor_dir  # what the critic's own folders are checked against


@pytest.mark.parametrize(
    ("values", "flags"),
    [
        ({"advantage_estimator": "grpo", "use_critic": True}, ("--use-critic", "--advantage-estimator")),
        ({"advantage_estimator": "gae", "use_critic": False}, ("--advantage-estimator", "--no-use-critic")),
        (
            {"advantage_estimator": "rloo", "num_critic_only_steps": 1},
            ("--num-critic-only-steps", "--advantage-estimator"),
        ),
        (
            {"advantage_estimator": "grpo", "n_samples_per_prompt": 1},
            ("--advantage-estimator", "--n-samples-per-prompt"),
        ),
        ({"advantage_estimator": "grpo", "kl_coef": 0.1}, ("--kl-coef", "--advantage-estimator")),
        ({"loss_type": "gspo", "loss_aggregation": "token_mean"}, ("--loss-aggregation", "--loss-type")),
        (
            {"filter_truncated": True, "rollout_ignore_eos": True},
            ("--filter-truncated", "--rollout-ignore-eos"),
        ),
        (
            {"overlong_buffer_len": 8, "rollout_ignore_eos": True},
            ("--overlong-buffer-len", "--rollout-ignore-eos"),
        ),
    ],
)
def test_bad_estimator_combinations_name_both_flags(
    files: dict[str, str], values: dict[str, Any], flags: tuple[str, str]
) -> None:
    base = {**files, "device": "cpu", "params_dtype": "float32", "rollout_batch_size": 4}
    base |= {"global_batch_size": 4, "n_samples_per_prompt": 2}
    with pytest.raises(ValueError) as info:
        unvalidated({**base, **values}).validate()
    message = str(info.value)
    assert message.startswith(flags[0] + ":"), message
    assert flags[1] in message, message


def test_a_critic_free_estimator_implies_no_critic(files: dict[str, str], tmp_path: Path) -> None:
    common = [
        "--hf-checkpoint", files["hf_checkpoint"], "--prompt-data", files["prompt_data"],
        "--run-dir", files["run_dir"], "--device", "cpu", "--params-dtype", "float32",
        "--rollout-batch-size", "4", "--global-batch-size", "8", "--n-samples-per-prompt", "2",
    ]  # fmt: skip
    assert parse_config(common).use_critic is True  # GAE: a critic
    for estimator in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        config = parse_config([*common, "--advantage-estimator", estimator])
        assert config.use_critic is False, estimator
        assert config.critic_config() is None
        assert config.actor_config().critic_save is None
        assert config.placement_spec().use_critic is False
    assert parse_config([*common, "--advantage-estimator", "grpo", "--no-use-critic"]).use_critic is False
    with pytest.raises(ValueError, match=r"^--use-critic: --advantage-estimator grpo needs no critic"):
        parse_config([*common, "--advantage-estimator", "grpo", "--use-critic"])
    with pytest.raises(ValueError, match=r"^--advantage-estimator: gae .*--no-use-critic"):
        parse_config([*common, "--no-use-critic"])
    # From a YAML file too, and a flag then overrides the file's estimator.
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(yaml.safe_dump({"advantage-estimator": "grpo"}))
    assert parse_config([*common, "--config", str(config_file)]).use_critic is False
    assert (
        parse_config([*common, "--config", str(config_file), "--advantage-estimator", "gae"]).use_critic
        is True
    )
    config_file.write_text(yaml.safe_dump({"advantage-estimator": "grpo", "use_critic": True}))
    with pytest.raises(ValueError, match=r"^--use-critic: "):
        parse_config([*common, "--config", str(config_file)])
    # Programmatic configs follow the same rule.
    assert unvalidated({**files, "advantage_estimator": "rloo"}).use_critic is False
    assert unvalidated({**files, "advantage_estimator": "rloo", "use_critic": True}).use_critic is True


@pytest.mark.parametrize(
    ("sizes", "flag_name", "count"),
    [
        ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size", "9 attention heads"),
        (
            {"critic_tensor_model_parallel_size": 2},
            "--critic-tensor-model-parallel-size",
            "9 attention heads",
        ),
        ({"pipeline_model_parallel_size": 4}, "--pipeline-model-parallel-size", "30 layers"),
    ],
)
def test_a_layout_the_model_cannot_take_is_refused_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sizes: dict[str, int], flag_name: str, count: str
) -> None:
    # SmolLM2-135M's shape: 9 query heads and 3 key/value heads, 30 layers. Megatron itself would
    # stop on an assertion inside a worker; validation reads config.json and names the flag.
    hf = tmp_path / "hf"
    hf.mkdir()
    shape = {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "hidden_size": 576}
    (hf / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **shape, "intermediate_size": 1536}))
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    argv = [
        "train",
        "--hf-checkpoint",
        str(hf),
        "--prompt-data",
        str(prompts),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    argv += ["--actor-num-gpus-per-node", "4", "--rollout-batch-size", "8", "--global-batch-size", "8"]
    argv += [x for name, value in sizes.items() for x in (flag(name), str(value))]
    from tandem.ppo.app.cli import run

    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ppo-driver train: error: {flag_name}: ") and count in err, err
    assert "\n" not in err and not (tmp_path / "run").exists()


def test_advantage_whitening_is_on_by_default_and_can_be_turned_off(files: dict[str, str]) -> None:
    argv = ["--hf-checkpoint", files["hf_checkpoint"], "--prompt-data", files["prompt_data"]]
    argv += ["--run-dir", files["run_dir"]]
    assert parse_config(argv).normalize_advantages is True  # as verl's GAE and cleanrl's norm_adv
    assert parse_config([*argv, "--no-normalize-advantages"]).normalize_advantages is False
    assert parse_config(argv).actor_config().normalize_advantages is True  # what the workers get


def test_the_fit_plan_splits_the_optimizer_tags_in_quarters_unless_told(files: dict[str, str]) -> None:
    argv = ["--hf-checkpoint", files["hf_checkpoint"], "--prompt-data", files["prompt_data"]]
    argv += [
        "--run-dir",
        files["run_dir"],
        "--device",
        "cpu",
        "--params-dtype",
        "float32",
        "--gpu-memory-gib",
        "8",
    ]
    assert parse_config(argv).actor_config().optimizer_pieces is None  # whole roles: one tag each
    fit = parse_config([*argv, "--memory-plan", "fit"])
    critic = fit.critic_config()
    assert fit.actor_config().optimizer_pieces == 4 and critic is not None and critic.optimizer_pieces == 4
    told = parse_config([*argv, "--memory-plan", "fit", "--optimizer-pieces", "2"])
    assert told.actor_config().optimizer_pieces == 2
    # The default, auto, may plan wherever the device is not the CPU: quarters there, whole tags on the CPU.
    gpu = [a if a != "cpu" else "auto" for a in argv]
    assert parse_config(gpu).memory_plan == "auto" and parse_config(gpu).may_plan_memory
    assert parse_config(gpu).actor_config().optimizer_pieces == 4
    assert not parse_config(argv).may_plan_memory


@pytest.mark.parametrize("plan", ["auto", "whole", "fit"])
@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
@pytest.mark.parametrize("offload", [True, False])
def test_the_run_takes_a_memory_plan_where_asked_or_where_auto_can(
    plan: str, device: str, offload: bool
) -> None:
    """`may_plan_memory`: `fit` always (its checks refuse what it cannot plan), `whole` never, `auto` with the
    models sleeping (`--offload-train`) on a device that is not the CPU."""
    from tandem.ppo.config.file import unvalidated

    config = unvalidated({"memory_plan": plan, "device": device, "offload_train": offload})
    expected = plan == "fit" or (plan == "auto" and offload and device != "cpu")
    assert config.may_plan_memory is expected


@pytest.mark.parametrize("fused", [True, False])
def test_the_rollout_flags_reach_the_engines_options(fused: bool) -> None:
    """`--rollout-fused-decode` / `--no-rollout-fused-decode` and the other rollout fields become the
    embedded engines' `EngineOptions` (`cluster.engine_options_of`)."""
    from tandem.ppo.config import PPOConfig
    from tandem.ppo.loop.cluster import engine_options_of

    config = PPOConfig(
        hf_checkpoint="",
        rollout_batch_size=32,
        global_batch_size=32,
        rollout_fused_decode=fused,
        rollout_dtype="bfloat16",
        rollout_kv_cache_memory_fraction=0.2,
    )
    options = engine_options_of(config)
    assert options.fused_decode is fused
    assert (options.dtype, options.kv_cache_memory_fraction) == ("bfloat16", 0.2)
    assert engine_options_of(
        PPOConfig(hf_checkpoint="", rollout_batch_size=32, global_batch_size=32)
    ).fused_decode


@pytest.mark.parametrize(
    ("values", "adapters"),
    [
        ({}, False),  # a full fine-tune sends its weights
        ({"lora_rank": 8}, True),  # auto: adapters to the embedded engine
        ({"lora_rank": 8, "lora_sync": "merged"}, False),
        ({"lora_rank": 8, "rollout_engine": "sglang"}, False),  # auto: SGLang gets merged weights
        ({"critic_lora_rank": 8}, False),  # only the actor's LoRA reaches the engines
    ],
)
def test_lora_sync_picks_adapters_where_the_engine_merges_them(
    values: dict[str, Any], adapters: bool
) -> None:
    from tandem.ppo.config import PPOConfig
    from tandem.ppo.loop.cluster import engine_options_of

    config = PPOConfig(hf_checkpoint="", rollout_batch_size=32, global_batch_size=32, **values)
    assert config.syncs_adapters is adapters
    assert engine_options_of(config).adapter_sync is adapters


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hidden=st.sampled_from([64, 511, 512, 576, 4096]),
    critic_hidden=st.sampled_from([None, 64, 576]),
    device=st.sampled_from(["cpu", "cuda"]),
    async_mode=st.booleans(),
    asked=st.sampled_from([None, 1, 3]),
)
def test_cpu_threads_are_the_machines_cores_only_where_models_take_turns_on_a_large_enough_cpu_model(
    tmp_path_factory: pytest.TempPathFactory,
    hidden: int,
    critic_hidden: int | None,
    device: str,
    async_mode: bool,
    asked: int | None,
) -> None:
    """None picks the cores for a CPU sync run of hidden size >= 512 (actor and critic), else leaves
    Ray's one thread; a number given is passed through as it is. Both roles' configs and the
    engines' options carry the same choice."""
    import os

    from tandem.ppo.config.fields import CPU_THREADS_MIN_HIDDEN_SIZE
    from tandem.ppo.loop.cluster import engine_options_of

    root = tmp_path_factory.mktemp("threads")
    folders = {}
    for name, size in (("actor", hidden), ("critic", critic_hidden)):
        if size is not None:
            (root / name).mkdir()
            (root / name / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "hidden_size": size}))
            folders[name] = str(root / name)
    config = unvalidated(
        {
            "hf_checkpoint": folders["actor"],
            "critic_hf_checkpoint": folders.get("critic"),
            "prompt_data": "unused.jsonl",
            "run_dir": str(root / "run"),
            "device": device,
            "params_dtype": "float32" if device == "cpu" else "bfloat16",
            "async_mode": async_mode,
            "cpu_threads": asked,
        }
    )
    sizes = [hidden] + ([critic_hidden] if critic_hidden is not None else [])
    if asked is not None:
        expected: int | None = asked
    elif device == "cpu" and not async_mode and min(sizes) >= CPU_THREADS_MIN_HIDDEN_SIZE:
        expected = len(os.sched_getaffinity(0))
    else:
        expected = None
    assert config.resolved_cpu_threads() == expected
    assert engine_options_of(config).cpu_threads == expected
    assert config._worker_config().cpu_threads == expected
