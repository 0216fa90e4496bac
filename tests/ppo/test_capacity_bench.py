"""bench/capacity_bench.py: its parameter arithmetic is transformers' and PEFT's own, its memory arithmetic
adds up by hand, it names why a run failed, and each run gets its row, LoRA's with its flags (over a
stand-in for the PPO bench; the real runs are on an H200).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from capacity_arithmetic import GIB, Work, critic_params, estimate, lora_params, policy_params  # noqa: E402
from capacity_bench import why_it_failed  # noqa: E402
from ppo_harness import SHAPES  # noqa: E402

QWEN = [name for name in SHAPES if name.startswith("qwen2.5-")]


@pytest.mark.parametrize("name", QWEN)
def test_the_parameter_counts_are_transformers_and_peft_own(name: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(SHAPES[name])
    tied = bool(shape.pop("tie_word_embeddings", True))
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=tied))
    assert policy_params(SHAPES[name]) == sum(p.numel() for p in model.parameters())
    # The critic: the backbone and a scalar head with its bias.
    backbone = sum(p.numel() for p in model.model.parameters())
    assert critic_params(SHAPES[name]) == backbone + shape["hidden_size"] + 1
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_params(SHAPES[name], 8) == trainable


def test_the_memory_arithmetic_by_hand() -> None:
    """Qwen2.5-7B with LoRA, shared, the bases on the GPU: by hand from its parameter counts."""
    shape, work = SHAPES["qwen2.5-7b"], Work(micro_batch=4, seq_len=640, kv_fraction=0.1)
    p, c, a = policy_params(shape), critic_params(shape), lora_params(shape, 16)
    est = estimate("qwen2.5-7b", shape, "lora", "shared", rank=16, work=work)
    # Both bf16 bases stay on the GPU; the largest turn beside them: the engine's bf16 weights and its
    # KV cache (14 GiB of 140) against a model's adapter state (18 bytes a parameter) and one micro
    # batch's activations (34 bytes a layer a token a hidden unit, 12 a token a vocabulary entry).
    activations = (34 * 4 * 640 * 3584 * 28 + 12 * 4 * 640 * 152064) / GIB
    turns = [2 * p / GIB + 14.0, 18 * a / GIB + activations]
    assert est.gpu_peak_gib == pytest.approx(2 * p / GIB + 2 * c / GIB + max(turns))
    # The host: the engine's base (it merges each sync's adapters into it) and both adapter states, the
    # critic's with its value head (hidden -> 1, with bias), which trains in full.
    value_head = shape["hidden_size"] + 1
    assert est.host_gib == pytest.approx(2 * p / GIB + 18 * a / GIB + 18 * (a + value_head) / GIB, rel=1e-9)
    assert est.why_not == ""
    # Full fine-tuning of the same shape, shared: 18 bytes a parameter for the actor awake, and the
    # host holds both models' 14 (no gradients), the engine's and the reference's bf16 weights.
    full = estimate("qwen2.5-7b", shape, "full", "shared", work=work)
    assert full.gpu_peak_gib == pytest.approx(18 * p / GIB + activations)
    assert full.host_gib == pytest.approx((14 * p + 14 * c + 2 * p + 2 * p) / GIB)
    assert full.why_not.startswith("GPU: ") and "host: " in full.why_not


def test_resident_holds_each_train_roles_activations() -> None:
    """Qwen2.5-1.5B with LoRA, resident, the bases on the GPU: everything at once, and both train processes'
    activations, since a resident process keeps its allocator's cache at its largest micro batch (the
    actor's with the vocabulary's logits, the critic's without)."""
    shape, work = SHAPES["qwen2.5-1.5b"], Work(micro_batch=16, seq_len=640, kv_fraction=0.1)
    p, c, a = policy_params(shape), critic_params(shape), lora_params(shape, 16)
    est = estimate("qwen2.5-1.5b", shape, "lora", "resident", rank=16, work=work)
    layers, logits = 34 * 16 * 640 * 1536 * 28 / GIB, 12 * 16 * 640 * 151936 / GIB  # the critic has no logits
    bases, adapters, engine = (2 * p + 2 * c) / GIB, 2 * 18 * a / GIB, 2 * p / GIB
    assert est.gpu_peak_gib == pytest.approx(bases + adapters + engine + 14.0 + 2 * layers + logits)
    assert est.gpu_terms["actor activations"] == pytest.approx(layers + logits)
    assert est.gpu_terms["critic activations"] == pytest.approx(layers)


def test_the_arithmetic_judges_on_the_gpu_it_is_given() -> None:
    """An 80 GB card (as the H100 rows ran on): its KV cache is a tenth of 80 GiB, and 3B with LoRA resident
    passes it (that run ran out of memory there) where 1.5B's resident arithmetic fits."""
    shape, h100 = SHAPES["qwen2.5-3b"], Work(gpu_gib=80.0)
    on_h200 = estimate("qwen2.5-3b", shape, "lora", "resident", work=Work())
    on_h100 = estimate("qwen2.5-3b", shape, "lora", "resident", work=h100)
    assert on_h100.gpu_terms["KV cache"] == pytest.approx(8.0) and on_h200.gpu_terms[
        "KV cache"
    ] == pytest.approx(14.0)
    assert on_h100.gpu_peak_gib == pytest.approx(on_h200.gpu_peak_gib - 6.0)
    assert on_h200.why_not == "" and on_h100.why_not.startswith("GPU: 91 GiB of 80 (")
    assert estimate("qwen2.5-1.5b", SHAPES["qwen2.5-1.5b"], "lora", "resident", work=h100).why_not == ""


@pytest.mark.parametrize("name", QWEN)
def test_lora_never_needs_more_than_full_nor_shared_more_gpu_than_resident(name: str) -> None:
    work = Work(micro_batch=4)
    for finetune in ("full", "lora"):
        shared = estimate(name, SHAPES[name], finetune, "shared", work=work)  # type: ignore[arg-type]
        resident = estimate(name, SHAPES[name], finetune, "resident", work=work)  # type: ignore[arg-type]
        assert shared.gpu_peak_gib < resident.gpu_peak_gib
    # LoRA's state is the bases' bf16 and the adapters': less than full fine-tuning's wherever the bases
    # move like the rest (resident, or shared with their sleep on the host; left on the GPU, two bases
    # beside the engine's turn outweigh a small model's full state there).
    for mode, offload in (("shared", True), ("resident", False)):
        lora = estimate(name, SHAPES[name], "lora", mode, base_offload=offload, work=work)  # type: ignore[arg-type]
        full = estimate(name, SHAPES[name], "full", mode, work=work)  # type: ignore[arg-type]
        assert lora.gpu_peak_gib <= full.gpu_peak_gib and lora.host_gib <= full.host_gib
    offloaded = estimate(name, SHAPES[name], "lora", "shared", base_offload=True, work=work)
    kept = estimate(name, SHAPES[name], "lora", "shared", work=work)
    assert offloaded.gpu_peak_gib < kept.gpu_peak_gib and offloaded.host_gib > kept.host_gib


def test_what_stands_in_the_way_of_32b_is_named() -> None:
    shape = SHAPES["qwen2.5-32b"]
    kept = estimate("qwen2.5-32b", shape, "lora", "shared", work=Work(micro_batch=4))
    assert kept.why_not.startswith("GPU: ") and "actor base 61" in kept.why_not
    offloaded = estimate("qwen2.5-32b", shape, "lora", "shared", base_offload=True, work=Work(micro_batch=4))
    assert "host: " in offloaded.why_not and "engine's base 61" in offloaded.why_not
    assert "disk: the 61 GiB bf16 folder" in offloaded.why_not


def test_a_failure_is_named() -> None:
    cuda = {"modes": {"shared": {"error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}}}
    assert why_it_failed(cuda, "") == "CUDA out of memory"
    ray_oom = "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory."
    assert why_it_failed(None, ray_oom) == "host memory (a process killed)"
    other = {"modes": {"shared": {"error": "Traceback ...\nValueError: something else"}}}
    assert why_it_failed(other, "") == "ValueError: something else"


STAND_IN = """
import argparse, json, sys
p = argparse.ArgumentParser()
p.add_argument("--out"); p.add_argument("--workdir"); p.add_argument("--shape"); p.add_argument("--steps", type=int)
p.add_argument("--time-budget-s"); p.add_argument("--quick", action="store_true")
p.add_argument("--skip-probe", action="store_true"); p.add_argument("--skip-shared", action="store_true")
p.add_argument("--skip-resident", action="store_true"); p.add_argument("--micro-batch-size")
p.add_argument("--set", dest="sets", action="append", default=[])
p.add_argument("--ab-memory-plan", action="store_true")
a = p.parse_args()
mode = "shared_fit" if a.ab_memory_plan else "resident" if a.skip_shared else "shared"
steps = [{"step": i, "time/step": 2.0 + i} for i in range(a.steps)]
lora = "lora_rank=8" in a.sets
sync = 0.5 if "lora_sync=adapters" in a.sets else 2.5
result = {"steps": steps, "error": None, "step_s_mean": 3.0, "gpu_peak_gib": {"overall": 40.0},
          "host_used_peak_gib": 20.0, "host_buffer_gib": {"actor": 6.0, "critic": 6.5},
          "phase_s_mean": {"weight_sync": sync}, "engine_weight_update_s": sync / 2, "sets": a.sets,
          "micro_batch_size": a.micro_batch_size}
if mode == "shared_fit":
    result["moved_gib"] = [None, 12.0, 3.5]
if mode == "resident" and not lora:  # out of GPU memory in its first step, as the bench records it
    result = {"steps": [], "error": "Traceback ...\\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}
json.dump({"model": {"params": 1543714304}, "modes": {mode: result}}, open(a.out, "w"))
sys.exit(1 if result["error"] else 0)
"""


def test_each_run_gets_its_row_and_a_failure_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The capacity bench's own logic, over a stand-in for ppo_gpu_bench.py that writes the bench's
    JSON fields (tests/ppo/test_ppo_gpu_bench.py checks the real bench writes them)."""
    import capacity_bench

    stand_in = tmp_path / "bench.py"
    stand_in.write_text(STAND_IN)
    monkeypatch.setattr(capacity_bench, "BENCH", stand_in)
    out = tmp_path / "capacity.json"
    argv = ["--shapes", "qwen2.5-1.5b", "--modes", "shared,resident", "--out", str(out)]
    argv += ["--workdir", str(tmp_path / "work"), "--estimate", "qwen2.5-1.5b,qwen2.5-32b"]
    argv += ["--finetune", "full,lora", "--lora-rank", "8", "--lora-sync", "adapters,merged"]
    argv += ["--micro-batch-size", "4"]
    assert capacity_bench.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["finetune"], r["lora_sync"], r["mode"]): r for r in report["runs"]}
    assert list(rows) == [
        ("full", None, "shared"),
        ("full", None, "resident"),
        ("lora", "adapters", "shared"),
        ("lora", "adapters", "resident"),
        ("lora", "merged", "shared"),
        ("lora", "merged", "resident"),
    ]
    shared, resident = rows["full", None, "shared"], rows["full", None, "resident"]
    assert (shared["trained"], shared["why_not"]) == (True, None)
    assert shared["step_s"] == 3.0 and shared["gpu_peak_gib"] == 40.0 and shared["params"] == 1543714304
    assert shared["host_buffer_gib"] == {"actor": 6.0, "critic": 6.5}
    assert (resident["trained"], resident["why_not"], resident["step_s"]) == (
        False,
        "CUDA out of memory",
        None,
    )
    # Each LoRA row got both roles' adapters and its own sync; the A/B's seconds come from its phases.
    for (finetune, sync, mode), row in rows.items():
        bench = json.loads(Path(row["bench_json"]).read_text())["modes"][mode]
        if finetune == "lora":
            assert bench["sets"] == [
                "lora_rank=8",
                "critic_lora_rank=8",
                f"lora_sync={sync}",
                "lora_base_offload=true",
            ]
            assert row["weight_sync_s"] == (0.5 if sync == "adapters" else 2.5)
        assert bench.get("micro_batch_size", "4") == "4"
    # The arithmetic of every (shape, fine-tuning, mode), run or not; the table has them all.
    estimated = {(e["shape"], e["finetune"], e["mode"]) for e in report["estimates"]}
    assert ("qwen2.5-32b", "lora", "shared") in estimated and (
        "qwen2.5-1.5b",
        "full",
        "resident",
    ) in estimated
    table = capsys.readouterr().out
    assert "| qwen2.5-1.5b | 1.54 B | lora (merged sync) | shared | yes | 3.00 | 2.500 |" in table
    assert "| qwen2.5-1.5b | 1.54 B | full | resident | no |" in table and "CUDA out of memory" in table
    assert "| qwen2.5-32b | 32.76 B | lora | shared | no (est.) |" in table and "host: " in table


def test_the_fit_mode_is_the_benchs_shared_fit_run_with_what_its_plan_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import capacity_bench

    stand_in = tmp_path / "bench.py"
    stand_in.write_text(STAND_IN)
    monkeypatch.setattr(capacity_bench, "BENCH", stand_in)
    out = tmp_path / "capacity.json"
    argv = [
        "--shapes",
        "qwen2.5-3b",
        "--modes",
        "fit",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "work"),
    ]
    assert capacity_bench.main(argv) == 0
    (row,) = json.loads(out.read_text())["runs"]
    assert (row["mode"], row["trained"], row["step_s"]) == ("fit", True, 3.0)
    assert row["moved_gib"] == [None, 12.0, 3.5]
    assert "| qwen2.5-3b |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        capacity_bench.main(["--modes", "planned", "--out", str(out)])


def test_a_lora_row_with_one_host_copy_of_the_bases_asks_the_driver_for_it_and_counts_it() -> None:
    import argparse

    from capacity_bench import lora_flags

    args = argparse.Namespace(lora_rank=16, lora_base_offload=True, lora_base_share=True)
    assert lora_flags(args, "adapters")[-2:] == ["--set", "lora_base_share=true"]
    assert lora_flags(argparse.Namespace(**{**vars(args), "lora_base_share": False}), "merged")[-2:] == [
        "--set",
        "lora_base_share=false",
    ]
    unset = lora_flags(argparse.Namespace(**{**vars(args), "lora_base_share": None}), "merged")
    assert not any(flag.startswith("lora_base_share") for flag in unset), "unset: the driver's default"
    shape = SHAPES["qwen2.5-14b"]
    apart = estimate("qwen2.5-14b", shape, "lora", "shared", base_offload=True, work=Work(micro_batch=4))
    one = estimate(
        "qwen2.5-14b", shape, "lora", "shared", base_offload=True, base_share=True, work=Work(micro_batch=4)
    )
    assert one.host_gib == pytest.approx(apart.host_gib - 2 * critic_params(shape) / GIB)
