"""The run's memory by arithmetic (`tandem.ppo.app.capacity`, `run_memory`), as `ppo-driver train --dry-run` prints it.

Parameter counts against the models' published ones; a run's config read into the bench's terms (its
micro-batches, layout, LoRA targets, KV cache); the verdict against a GPU's and a host's memory, and the
flags that make a run fit where it does not, each checked by estimating the run with them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tandem.ppo.app.capacity import (
    GIB,
    Work,
    estimate,
    kv_bytes_per_token,
    lora_params,
    policy_params,
    shape_of,
)
from tandem.ppo.app.dry_run import dry_run_report
from tandem.ppo.app.run_memory import memory_lines, run_estimate
from tandem.ppo.config.ppo_config import PPOConfig

QWEN_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
QWEN_05B = {
    **QWEN_7B,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
SMOLLM2_135M = {  # a Llama: no attention biases
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    ("config", "published"),
    [(QWEN_05B, 494_032_768), (QWEN_7B, 7_615_616_512), (SMOLLM2_135M, 134_515_008)],
    ids=["qwen2.5-0.5b", "qwen2.5-7b", "smollm2-135m"],
)
def test_parameter_counts_are_the_published_ones(config: dict[str, object], published: int) -> None:
    assert policy_params(shape_of(config)) == published


def test_a_config_json_that_cannot_be_counted_is_named() -> None:
    with pytest.raises(ValueError, match="mixture of experts"):
        shape_of({**QWEN_7B, "num_experts": 64})
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        shape_of({k: v for k, v in QWEN_7B.items() if k != "intermediate_size"})


def _folder(tmp_path: Path, config: dict[str, object]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _run(folder: Path, **fields: object) -> PPOConfig:
    base: dict[str, object] = {
        "hf_checkpoint": str(folder),
        "rollout_batch_size": 64,
        "global_batch_size": 64,
        "micro_batch_size": 16,
        "max_prompt_len": 128,
        "rollout_max_response_len": 512,
    }
    return PPOConfig(**{**base, **fields})  # type: ignore[arg-type]


def test_a_runs_config_is_the_benchs_terms(tmp_path: Path) -> None:
    shape = shape_of(QWEN_7B)
    # The bench's work: micro batches of 16 x 640 tokens, a KV cache of a tenth of an H200, LoRA rank 16 on
    # both models, the bases asleep on the host in one copy (the default). A rollout of 512 samples needs
    # more KV cache than that tenth.
    config = _run(
        _folder(tmp_path, QWEN_7B),
        rollout_batch_size=512,
        global_batch_size=512,
        lora_rank=16,
        critic_lora_rank=16,
        rollout_kv_cache_memory_fraction=0.1,
    )
    assert 512 * 640 * kv_bytes_per_token(shape) / GIB > 14
    ours = run_estimate(config, shape, gpu_gib=140)
    bench = estimate("7b", shape, "lora", "shared", rank=16, base_offload=True, base_share=True, work=Work())
    assert (ours.gpu_peak_gib, ours.host_gib) == pytest.approx((bench.gpu_peak_gib, bench.host_gib))
    # 64 samples need less KV cache than the tenth: the engine takes what the rollout needs.
    small = run_estimate(
        dataclasses.replace(config, rollout_batch_size=64, global_batch_size=64, offload_train=False),
        shape,
        gpu_gib=140,
    )
    assert small.gpu_terms["KV cache"] == pytest.approx(64 * 640 * kv_bytes_per_token(shape) / GIB)


def test_tensor_parallelism_splits_the_states_and_the_activations(tmp_path: Path) -> None:
    shape = shape_of(QWEN_7B)
    one = run_estimate(_run(_folder(tmp_path, QWEN_7B), offload_train=False), shape, gpu_gib=1000)
    two = run_estimate(
        _run(_folder(tmp_path, QWEN_7B), offload_train=False, tensor_model_parallel_size=2),
        shape,
        gpu_gib=1000,
    )
    for term in ("actor", "critic", "actor activations", "critic activations"):
        assert two.gpu_terms[term] == pytest.approx(one.gpu_terms[term] / 2), term
    assert two.gpu_terms["engine weights"] == one.gpu_terms["engine weights"], (
        "each engine holds the model whole"
    )


def test_lora_targets_by_either_name_count_only_their_layers(tmp_path: Path) -> None:
    shape = shape_of(QWEN_7B)
    h, n, kv = 3584, 28, 4 * 128
    assert lora_params(shape, 8, ("q_proj", "k_proj", "v_proj")) == 8 * n * (2 * h + 2 * (h + kv))
    fused = run_estimate(
        _run(_folder(tmp_path, QWEN_7B), lora_rank=8, lora_target_modules=("linear_qkv",)), shape, gpu_gib=140
    )
    named = run_estimate(
        _run(_folder(tmp_path, QWEN_7B), lora_rank=8, lora_target_modules=("q_proj", "k_proj", "v_proj")),
        shape,
        gpu_gib=140,
    )
    assert (
        fused.trained_params
        == named.trained_params
        == 8 * n * (2 * h + 2 * (h + kv)) + (critic_state := 7_615_616_512 - 152064 * h + h + 1)
    ), "the actor's adapters; the critic trains in full (no --critic-lora-rank)"
    assert critic_state > 7e9


def test_the_verdict_and_each_flag_that_makes_the_run_fit(tmp_path: Path) -> None:
    folder = _folder(tmp_path, QWEN_7B)
    full = _run(folder)
    lines = memory_lines(full, gpu_gib=140, host_gib=128)
    assert (
        lines[0].startswith("memory, by arithmetic")
        and "shared, full fine-tuning of 7.62 B parameters" in lines[0]
    )
    assert lines[1].startswith("  does not fit: GPU: 178 GiB of 140") and "host: 206 GiB of 120" in lines[1]
    assert lines[2:] == [
        "  fits with --lora-rank 16 --critic-lora-rank 16 (LoRA adapters on a frozen base): 65 GiB "
        "of GPU, 30 of host"
    ], "the two bases asleep in one host copy (the default)"
    # Resident LoRA on 80 GB: sleeping in turn fits, and of the smaller micro-batches the largest that fits.
    resident = _run(folder, lora_rank=16, critic_lora_rank=16, offload_train=False)
    lines = memory_lines(resident, gpu_gib=80, host_gib=128)
    levers = [line.removeprefix("  fits with ").split(":")[0] for line in lines[2:]]
    assert levers == ["--offload-train (the models sleep in turn)", "--micro-batch-size 4"]
    for lever, changes in zip(levers, [{"offload_train": True}, {"micro_batch_size": 4}], strict=True):
        assert not run_estimate(
            dataclasses.replace(resident, **changes), shape_of(QWEN_7B), 80, 128
        ).why_not, lever
    assert run_estimate(dataclasses.replace(resident, micro_batch_size=8), shape_of(QWEN_7B), 80, 128).why_not
    fits = memory_lines(dataclasses.replace(resident, micro_batch_size=4), gpu_gib=80, host_gib=128)
    assert fits[1].startswith("  fits: 66 of 80 GiB of GPU")


def test_the_dry_run_prints_the_estimate_or_why_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "tandem.ppo.app.run_memory.gpu_memory_gib", lambda: None
    )  # as on a machine without a GPU
    report = dry_run_report(_run(_folder(tmp_path / "m", QWEN_05B), gpu_memory_gib=40))
    assert (
        "# memory, by arithmetic" in report
        and "#   fits: " in report
        and "#   fits: 33 of 40 GiB of GPU" in report
    )
    unjudged = dry_run_report(_run(_folder(tmp_path / "m", QWEN_05B)))
    assert "#   no GPU here to judge it by: give --gpu-memory-gib for a verdict" in unjudged
    missing = dry_run_report(_run(tmp_path / "not-built"))
    assert f"# memory: no estimate: no {tmp_path / 'not-built' / 'config.json'} yet" in missing


def test_a_start_on_gpus_warns_before_ray_where_the_run_cannot_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tandem.ppo.app import cli
    from tandem.ppo.app.run_memory import start_warning

    monkeypatch.setattr("tandem.ppo.app.run_memory.host_memory_gib", lambda: 128.0)  # the lent H200 host's
    folder = _folder(tmp_path, QWEN_7B)
    too_big = _run(folder, device="cuda", gpu_memory_gib=80)
    lines = start_warning(too_big)
    assert lines[1].startswith("  does not fit: GPU: 178 GiB of 80") and "--lora-rank 16" in lines[2]
    assert start_warning(dataclasses.replace(too_big, device="cpu")) == [], "a CPU run's GPUs are logical"
    assert start_warning(dataclasses.replace(too_big, lora_rank=16, critic_lora_rank=16)) == [], (
        "nothing: it fits"
    )
    # The command says it before the run starts (the run itself stands in here: no Ray, no workers).
    started: list[PPOConfig] = []

    class Summary:
        def describe(self) -> str:
            return "run dir: -"

    monkeypatch.setattr(PPOConfig, "validate", lambda self: None)
    monkeypatch.setattr("tandem.ppo.loop.training.train", lambda config: started.append(config) or Summary())
    with caplog.at_level("WARNING", logger="tandem.ppo.capacity"):
        assert cli._start(too_big, dry_run=False) == 0
    assert started and "does not fit: GPU: 178 GiB of 80" in caplog.text
    assert "lora-rank 16 --critic-lora-rank 16 (LoRA adapters on a frozen base)" in caplog.text


def test_one_host_copy_of_the_two_bases_leaves_the_critics_off_the_host(tmp_path: Path) -> None:
    shape = shape_of(QWEN_7B)
    folder = _folder(tmp_path, QWEN_7B)
    apart = run_estimate(
        _run(folder, lora_rank=16, critic_lora_rank=16, lora_base_share=False), shape, gpu_gib=140
    )
    shared = run_estimate(_run(folder, lora_rank=16, critic_lora_rank=16), shape, gpu_gib=140)  # the default
    critic_base = 2 * (7_615_616_512 - 152064 * 3584 + 3584 + 1) / GIB
    assert apart.host_terms["critic base"] == pytest.approx(critic_base)
    assert "critic base" not in shared.host_terms and shared.host_gib == pytest.approx(
        apart.host_gib - critic_base
    )
    assert shared.gpu_peak_gib == apart.gpu_peak_gib, "the GPU holds a base at a time either way"
    # 14B on a host of 64 GiB: the bases apart do not fit it, one copy of them does, and the dry run says so.
    qwen_14b = {
        **QWEN_7B,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
    }
    big = _run(
        _folder(tmp_path / "14b", qwen_14b),
        lora_rank=16,
        critic_lora_rank=16,
        micro_batch_size=4,
        lora_base_share=False,
    )
    lines = memory_lines(big, gpu_gib=140, host_gib=72)
    assert lines[1].startswith("  does not fit: host:") and any(
        "--lora-base-share True" in line for line in lines[2:]
    )
    assert memory_lines(dataclasses.replace(big, lora_base_share=None), gpu_gib=140, host_gib=72)[
        1
    ].startswith("  fits")


def test_the_kv_cache_default_is_the_engines() -> None:
    from tandem.ppo.app.run_memory import ENGINE_KV_FRACTION
    from tandem.ppo.engines._options import EngineOptions

    assert EngineOptions().kv_cache_memory_fraction == ENGINE_KV_FRACTION
