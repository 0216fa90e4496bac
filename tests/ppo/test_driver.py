"""The PPO driver end to end on CPU: the demo task learns, resume is exact, the plan is followed.

Each run is the real thing: a local Ray with one logical GPU shared by an actor
rank, a critic rank and the embedded engine (Megatron on gloo), sleeping and
waking between phases.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.ppo.app.memory_report import MemoryPlanArgs, memory_report
from tandem.ppo.loop.driver import PPODriver, RunSummary

from ._runs import demo_config, last_state, read_jsonl, run_driver
from .conftest import KlFirstRun

pytestmark = pytest.mark.slow


def test_demo_task_learns(tmp_path: Path, ray_cluster: str) -> None:
    config = demo_config(tmp_path / "run", num_rollout=40, eval_interval=None, save_interval=None)
    summary = run_driver(config, ray_cluster)
    rewards = [m["reward/mean"] for m in summary.metrics]
    assert len(rewards) == 40
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first <= 0.2, rewards
    # Learning, not noise: a random model scores ~0.05; 40 steps lift it by far more than the
    # step-to-step spread (about 0.1).
    assert last >= first + 0.3, rewards
    run_dir = tmp_path / "run"
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 40
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert (run_dir / "hf" / "config.json").is_file()
    # A run that learns gets no hint (tests/ppo/test_hints_e2e.py trips them), and its figures say why
    # it can: the sampling weights move (fp32 on the CPU: nearly all of them at lr 3e-3), the engine's
    # log-probs are the trainer's to rounding, and the critic comes to explain the returns.
    assert [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "hint"] == []
    assert "hint:" not in (run_dir / "logs" / "driver.log").read_text()
    since_start = [m["policy/changed_fraction_since_start"] for m in summary.metrics]
    assert since_start == sorted(since_start) and 0.5 < since_start[-1] <= 1.0
    for m in summary.metrics:
        assert 0.5 < m["policy/changed_fraction"] <= m["policy/changed_fraction_since_start"]
        assert 0 <= m["actor/sampler_log_prob_gap"] < 1e-4
        assert 0 <= m["reward/tied_groups"] <= 1
    assert summary.metrics[-1]["critic/explained_variance_window"] > 0.3
    # Where each train's seconds went, inside the step's phase of that train: the parts sum to the train's
    # own wall on the worker. The demo's models take four optimizer steps a rollout, so the actor's old
    # log-probs and the critic's old values are forwards of their own; no KL, so no reference's.
    expected = {"actor": "old_log_probs", "critic": "old_values"}
    for m in summary.metrics:
        for role, forward in expected.items():
            parts = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith(f"train_time/{role}/")}
            assert parts.keys() == {forward, "passes", "optimizer_step", "other", "total", "call"}, parts
            assert sum(v for k, v in parts.items() if k not in ("total", "call")) == pytest.approx(
                parts["total"]
            )
            # The worker's whole method holds its train, and the driver's phase holds the call.
            assert 0 < parts["total"] <= parts["call"] <= m[f"time/{role}_train"]


def test_event_order_follows_the_plan(kl_first_run: KlFirstRun) -> None:
    events = kl_first_run.events
    awake: set[str] = {"actor", "critic"}  # both start awake, then sleep before the first rollout
    training: set[str] = set()
    order: list[str] = []
    engine_holds_memory = True
    for e in events:
        role = e.get("role")
        if e["event"] in ("engine_release", "engine_resume", "weight_sync"):
            engine_holds_memory = e["event"] != "engine_release"
        if e["event"] == "wake":
            assert role not in awake, f"{role} woken twice"
            # On the shared GPUs a model wakes only once the engine has made room, for a save too.
            assert not engine_holds_memory, f"{role} woke while the engine held its memory"
            awake.add(role)
        elif e["event"] == "sleep":
            awake.discard(role)
        elif e["event"] in ("train_begin", "log_probs_begin"):
            assert awake == {role}, f"{role} computes while {awake} are awake"
            if e["event"] == "train_begin":
                training.add(role)
                order.append(f"{role}@{e['rollout_id']}")
        elif e["event"] == "train_end":
            training.discard(role)
        elif e["event"] == "save":
            assert awake == {role}, f"{role} saves while {awake} are awake"
        assert len(training) <= 1
    # Critic-only warm-up at rollout 0; then the critic always trains before the actor.
    assert order == ["critic@0", "critic@1", "actor@1", "critic@2", "actor@2"]
    kinds = [e["event"] for e in events]
    # One a step but the warm-up's, and one after each save (rollouts 1 and 2), with the release before it.
    assert kinds.count("weight_sync") == 2 + 2 and kinds.count("save") == 2 * 2
    assert kinds.count("engine_release") >= 2
    assert awake == set() and engine_holds_memory


def step_spans(events: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """Each step's (begin, end) wall-clock times from the event log's own timestamps."""
    begins = {e["rollout_id"]: e["t"] for e in events if e["event"] == "step_begin"}
    ends = {e["rollout_id"]: e["t"] for e in events if e["event"] == "step_end"}
    assert begins.keys() == ends.keys()
    return {k: (begins[k], ends[k]) for k in begins}


def event_time(events: list[dict[str, Any]], event: str, rollout_id: int) -> float:
    (t,) = [e["t"] for e in events if e["event"] == event and e.get("rollout_id") == rollout_id]
    return float(t)


def test_step_clock_is_the_wall_clock_however_step_is_called(tmp_path: Path, ray_cluster: str) -> None:
    """`time/step` is the span of the step's events, whether the step draws its rollout or is given it."""
    config = demo_config(tmp_path / "run", num_rollout=2, eval_interval=None, export_hf=False)
    direct: dict[int, dict[str, Any]] = {}

    def call_step_directly(driver: PPODriver) -> None:
        direct[2] = driver.step(2)  # draws its rollout inside (as bench/ppo_gpu_bench.py calls it)
        sampled = driver.draw(3)
        time.sleep(0.5)  # idle time between the draw and the step is not the step's
        direct[3] = driver.step(3, sampled)

    summary = run_driver(config, ray_cluster, after=call_step_directly)
    metrics = {0: summary.metrics[0], 1: summary.metrics[1], **direct}
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    spans = step_spans(events)
    assert sorted(spans) == [0, 1, 2, 3]

    def parts(k: int) -> float:
        return sum(metrics[k][f"time/{p}"] for p in ("critic_train", "actor_train", "weight_sync"))

    for k, (begin, end) in spans.items():
        # One timer, read once: the event log's timestamps agree with it to within a few ms (the
        # old clock added the rollout a second time when the step drew it).
        assert metrics[k]["time/step"] == pytest.approx(end - begin, abs=0.005), k
        assert metrics[k]["time/step"] > parts(k), k
    for k in (0, 1, 2):  # drawn by the step itself: the rollout lies inside the step's span
        begin, end = spans[k]
        assert begin <= event_time(events, "generate_begin", k) < event_time(events, "generate_end", k) <= end
        assert metrics[k]["time/step"] > metrics[k]["time/rollout"] + parts(k)
    # Drawn before the call: neither the draw nor the idle half second is in the step.
    assert event_time(events, "generate_end", 3) <= spans[3][0] - 0.5


RESUME_COMMON = {"eval_interval": None, "export_hf": False, "save_interval": 2}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory, ray_cluster: str) -> tuple[Path, RunSummary]:
    """Four demo steps in one go, each model's final state saved: what a resumed run must equal, and
    the padded run that the packed one must equal (one run for both tests)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    summary = run_driver(demo_config(run_dir, num_rollout=4, **RESUME_COMMON), ray_cluster, snapshot=True)
    return run_dir, summary


def test_resume_continues_exactly(
    tmp_path: Path, ray_cluster: str, straight_run: tuple[Path, RunSummary]
) -> None:
    straight_dir, straight = straight_run
    # The resumed run also takes the memory plan (the straight run sleeps whole roles): each start's first
    # step runs whole, its later ones sleep only the tags each turn needs room for, which this capacity
    # makes some and not all (the demo's figures: the engines' KV cache 8 MiB, each model's state about
    # 1.4 MiB). Sleeping by tag must change nothing of what the run learns. The first start asks for the
    # plan (`--memory-plan fit`); the second takes the default, `auto`, on a device left to the workers
    # (`--device auto`, the CPU here), which plans wherever it has the GPU's memory: here the capacity given.
    planned = {"gpu_memory_gib": 0.0095, "memory_margin_gib": 0.0}
    first = run_driver(
        demo_config(tmp_path / "resumed", num_rollout=2, **RESUME_COMMON, **planned, memory_plan="fit"),
        ray_cluster,
    )
    assert first.last_rollout_id == 1
    resumed = run_driver(
        demo_config(tmp_path / "resumed", num_rollout=4, **RESUME_COMMON, **planned, device="auto"),
        ray_cluster,
        snapshot=True,
    )
    assert resumed.last_rollout_id == 3
    log = (tmp_path / "resumed" / "logs" / "driver.log").read_text()
    assert log.count("memory plan (--memory-plan auto): planned from the first step's figures") == 1, log
    assert "memory/moved_gib" not in resumed.metrics[0] and "memory/moved_gib" not in resumed.metrics[2]
    assert resumed.metrics[1]["memory/moved_gib"] > 0 and resumed.metrics[3]["memory/moved_gib"] > 0
    plan = json.loads((tmp_path / "resumed" / "memory_plan.json").read_text())
    (turns,) = plan["plans"].values()
    moved = {tag for turn in turns for tag in turn["asleep"] if not tag.startswith("engine/")}
    every = {f"{r}/{t}" for r in ("actor", "critic") for t in plan["model"]["roles"][r]["tags"]}
    assert moved and moved < every, f"the plan moves some train tags, not all: {sorted(moved)}"
    # The optimizer's tags in quarters (`optimizer_pieces` 4 under fit): a turn sleeps a part of the moments.
    moments = {f"actor/optimizer_moments.{i}" for i in range(4)}
    assert any(0 < len(moments & set(t["asleep"])) < len(moments) for t in turns), turns
    # On shared GPUs the plan chooses the engines' tags too: for the trains they drop their KV cache (8 MiB,
    # nothing to copy) and keep their weights, where the whole-role steps release both.
    engine_asleep = {tag for turn in turns for tag in turn["asleep"] if tag.startswith("engine/")}
    assert engine_asleep == {"engine/kv_cache"}, turns
    # The actor's moments wake in the background of the critic's train (`--prefetch-wakes`): its workers'
    # copy beside the critic's work; the actor's train waits for what is left of it.
    critic_train = next(t for t in turns if t["turn"] == "critic: wake, train, sleep")
    assert critic_train["prefetch"] and all(tag.startswith("actor/") for tag in critic_train["prefetch"])
    events = read_jsonl(tmp_path / "resumed" / "events.jsonl")
    assert [e["role"] for e in events if e.get("prefetch")] == ["actor", "actor"], "steps 1 and 3"
    releases = [e for e in events if e["event"] == "engine_release"]
    assert {tuple(e.get("tags", ("weights", "kv_cache"))) for e in releases} == {
        ("weights", "kv_cache"),  # each start's first step, whole
        ("kv_cache",),  # the planned steps
    }, releases
    # `ppo-driver memory-plan` reads the run's file back: the same plan at the run's own capacity.
    report = memory_report(MemoryPlanArgs(str(tmp_path / "resumed")))
    assert "planned for 9.7 MiB less a margin of 0.0 MiB" in report
    assert all(f"{t['turn']} | asleep {', '.join(t['asleep']) or 'nothing'}" in report for t in turns), report
    keys = ("reward/mean", "loss/policy", "loss/value", "actor/lr", "critic/lr")
    assert len(straight.metrics) == len(resumed.metrics) == 4
    for a, b in zip(straight.metrics, resumed.metrics, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a, b)
        # The resume's own weight sync (the checkpoint's weights into engines that start from the HF
        # folder) is not counted in the first resumed step's: each step counts its own sync.
        assert a["policy/changed_fraction"] == pytest.approx(b["policy/changed_fraction"], abs=1e-3)
    for role in ("actor", "critic"):
        a = torch.load(last_state(straight_dir, role), weights_only=False)
        b = torch.load(last_state(tmp_path / "resumed", role), weights_only=False)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=f"{role} {k}")
    straight_data = json.loads((straight_dir / "driver" / "iter_0000003.json").read_text())["data"]
    resumed_data = json.loads((tmp_path / "resumed" / "driver" / "iter_0000003.json").read_text())["data"]
    assert straight_data == resumed_data
    lines = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [m["step"] for m in lines] == [0, 1, 2, 3]


def test_no_offload_keeps_both_models_resident_with_a_user_reward_module_from_a_file(
    tmp_path: Path, ray_cluster: str
) -> None:
    reward_file = tmp_path / "elsewhere" / "my_reward.py"
    reward_file.parent.mkdir()
    reward_file.write_text(
        "async def reward(samples):\n"
        "    return [1.0 if s.response.strip() == s.label and s.metadata.get('k') is None else 0.0 for s in samples]\n"
    )
    config = demo_config(
        tmp_path / "run",
        num_rollout=2,
        offload_train=False,
        custom_rm_path=f"{reward_file}:reward",
        eval_interval=None,
        export_hf=False,
    )
    summary = run_driver(config, ray_cluster)
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in summary.metrics)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert not [e for e in events if e["event"] in ("wake", "sleep")]
    assert "time/engine_release" not in summary.metrics[-1]


def test_ctrl_c_stops_cleanly_with_a_loadable_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "tandem.ppo.app.cli", "demo", "--run-dir", str(run_dir), "--num-rollout", "200",
        "--save-interval", "1000", "--no-progress", "--eval-interval", "1000", "--no-eval-before-train",
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(1)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, output[-3000:]
    from tandem.megatron.worker.checkpoint import read_latest

    saved = read_latest(run_dir / "actor")
    assert saved is not None and saved >= 1, output[-3000:]
    assert read_latest(run_dir / "critic") == saved
    assert (run_dir / "driver" / f"iter_{saved:07d}.json").is_file()
    assert len(read_jsonl(metrics)) == saved + 1


def test_config_of_the_demo_is_valid(tmp_path: Path) -> None:
    config = demo_config(tmp_path / "run")
    config.validate()
    assert dataclasses.asdict(config)["rollout_max_response_len"] == 1


def test_async_overlaps_generation_with_training(tmp_path: Path, ray_cluster: str) -> None:
    separate = {
        "colocate": False,
        "rollout_num_gpus": 1,
        "local_gpus": 2,
        "eval_interval": None,
        "export_hf": False,
    }
    config = demo_config(tmp_path / "async", num_rollout=3, async_mode=True, **separate)
    summary = run_driver(config, ray_cluster)
    events = read_jsonl(tmp_path / "async" / "events.jsonl")

    def when(event: str, rollout_id: int, role: str | None = None) -> float:
        (t,) = [
            e["t"]
            for e in events
            if e["event"] == event and e.get("rollout_id") == rollout_id and e.get("role") == role
        ]
        return float(t)

    for k in (0, 1):
        # Rollout k+1 is under way before the actor has finished training on rollout k.
        assert when("generate_begin", k + 1) < when("train_end", k, "actor")
    spans = step_spans(events)
    for k in (1, 2):
        # Generated in the background: the step's clock starts after that rollout had begun.
        begin, end = spans[k]
        assert when("generate_begin", k) < begin
        assert summary.metrics[k]["time/step"] == pytest.approx(end - begin, abs=0.005)
    assert [m["async/staleness"] for m in summary.metrics] == [0.0, 1.0, 1.0]

    # The same seed and data without --async: the first step is the same step.
    sync = run_driver(demo_config(tmp_path / "sync", num_rollout=1, **separate), ray_cluster)
    for key in ("reward/mean", "loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
        assert sync.metrics[0][key] == pytest.approx(summary.metrics[0][key], rel=1e-6, abs=1e-9), key


def test_async_is_refused_with_colocate(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--async: .*--no-colocate"):
        demo_config(tmp_path / "run", async_mode=True).validate()


def test_critic_with_its_own_layout(tmp_path: Path, ray_cluster: str) -> None:
    config = demo_config(
        tmp_path / "run",
        num_rollout=1,
        local_gpus=2,
        actor_num_gpus_per_node=2,
        tensor_model_parallel_size=2,  # actor: TP 2, DP 1
        critic_tensor_model_parallel_size=1,  # critic: TP 1, DP 2
        micro_batch_size=16,
        eval_interval=None,
        export_hf=False,
    )
    summary = run_driver(config, ray_cluster)
    assert summary.metrics[0]["critic/values_mean"] == pytest.approx(summary.metrics[0]["actor/values_mean"])
    # The weights reached both engines (one per GPU): equal fingerprints after the sync.
    received = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "weights_received"]
    assert received and all(e["agree"] and len(e["digests"]) == 2 for e in received), received


def test_kl_first_plan_and_the_exported_folder_matches_the_actor(kl_first_run: KlFirstRun) -> None:
    """With KL in the rewards the actor's log-probs come before the critic trains (the KL-first plan),
    in the critic-only warm-up step too; the run's HF folder, loaded by transformers, gives the
    actor's own log-probs on a fresh rollout. The same run steers the KL coefficient
    (`--kl-target`) and trains the critic twice a step (`--critic-updates-per-step 2`) within its
    one turn."""
    from transformers import AutoModelForCausalLM

    summary, events, config = kl_first_run.summary, kl_first_run.events, kl_first_run.config
    for k in (0, 1, 2):
        (logp,) = [e["t"] for e in events if e["event"] == "log_probs_end" and e["rollout_id"] == k]
        (critic,) = [
            e["t"]
            for e in events
            if e["event"] == "train_begin" and e["role"] == "critic" and e["rollout_id"] == k
        ]
        assert logp < critic  # the actor's log-probs exist before the critic trains
    for m in summary.metrics:
        assert m["time/kl_first"] > 0  # the extra wake of the actor, measured
    warmup = config.num_critic_only_steps
    for m in summary.metrics[warmup:]:
        assert m["critic/reward_kl"] == pytest.approx(m["actor/reward_kl"])
    # After the actor's first update (step 1) the policy has moved from the reference.
    assert summary.metrics[warmup + 1]["critic/reward_kl"] != 0
    for m in summary.metrics:
        # 128 samples, 32 an optimizer step: the critic's two passes are 8 steps, the actor's one 4.
        assert m["critic/optimizer_steps"] == 8.0
    assert all(m["actor/optimizer_steps"] == 4.0 for m in summary.metrics[warmup:])
    # The controller: step 0 uses kl_coef; step 1 kl_coef · (1 + clip(KL_0 / 0.01 − 1, ±0.2) · 128 / 10000),
    # with KL_0 the warm-up step's (the critic's: the actor did not train then).
    kl_0 = summary.metrics[0]["critic/reward_kl"]
    assert summary.metrics[0]["kl/reward_coef"] == 0.05
    error = min(max(kl_0 / 0.01 - 1, -0.2), 0.2)
    assert summary.metrics[1]["kl/reward_coef"] == pytest.approx(0.05 * (1 + error * 128 / 10000))
    # One critic turn a step, whatever its passes.
    assert sum(e["event"] == "train_begin" and e["role"] == "critic" for e in events) == len(summary.metrics)

    assert summary.hf_dir is not None
    model: Any = AutoModelForCausalLM.from_pretrained(summary.hf_dir, dtype=torch.float32)
    base: Any = AutoModelForCausalLM.from_pretrained(config.hf_checkpoint, dtype=torch.float32)
    batch = kl_first_run.fresh_batch
    moved = 0.0
    for tokens, length, actor_lp in zip(
        batch.tokens, batch.response_lengths, kl_first_run.fresh_log_probs, strict=True
    ):
        with torch.no_grad():
            logits = model(tokens.unsqueeze(0)).logits[0, -length - 1 : -1].float()
            base_logits = base(tokens.unsqueeze(0)).logits[0, -length - 1 : -1].float()
        response = tokens[-length:]
        hf_lp = torch.log_softmax(logits, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        base_lp = torch.log_softmax(base_logits, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(hf_lp, actor_lp.float(), rtol=1e-4, atol=1e-4)
        moved = max(moved, float((hf_lp - base_lp).abs().max()))
    assert moved > 1e-3  # the export holds the trained weights, not the base model's

    # `ppo-driver export` writes the same folder from the run's last checkpoint.
    from safetensors.torch import load_file

    from tandem.ppo.app.evaluate import export_run

    out = kl_first_run.run_dir.parent / "exported"
    again = Path(export_run(str(kl_first_run.run_dir), str(out)))
    written = {k: v for f in sorted(again.glob("*.safetensors")) for k, v in load_file(f).items()}
    at_end = {k: v for f in sorted(summary.hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert written.keys() == at_end.keys() and all(torch.equal(written[k], at_end[k]) for k in written)


def test_eval_command_on_a_saved_actor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ppo-driver eval` scores a model and says how far its weights are from its base (`--base`)."""
    from safetensors.torch import load_file, save_file

    from tandem.ppo.app.cli import run as cli

    config = demo_config(tmp_path / "run")  # builds the base model and the task
    trained = tmp_path / "trained"
    shutil.copytree(config.hf_checkpoint, trained)
    (weights,) = trained.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"].view(-1)[:1000] += 0.5  # 1000 elements moved, counted by hand
    save_file(tensors, str(weights), metadata={"format": "pt"})
    elements = sum(t.numel() for t in tensors.values())
    status = cli(
        ["eval", str(trained), "--base", config.hf_checkpoint, "--data", str(config.eval_prompt_data),
         "--max-response-len", "1", "--n-samples-per-prompt", "2", "--temperature", "1.0",
         "--local-gpus", "1", "--custom-rm-path", "tandem.ppo._demo:digit_reward"]
    )  # fmt: skip
    assert status == 0
    out = capsys.readouterr().out
    assert "eval/mean:" in out and "eval/accuracy:" in out and "eval/tied_groups:" in out
    assert f"policy/changed_fraction_since_start: {1000 / elements:.4f}" in out


def test_sequence_packing_trains_as_the_padded_run(
    tmp_path: Path, ray_cluster: str, straight_run: tuple[Path, RunSummary]
) -> None:
    """`--use-sequence-packing` through the driver: the first step (same rollout) trains as the padded
    run's first step (the straight run's: the same seed, data and settings but the packing)."""
    _, padded = straight_run
    packed = run_driver(
        demo_config(tmp_path / "packed", use_sequence_packing=True, **{**RESUME_COMMON, "num_rollout": 1}),
        ray_cluster,
    )
    a, b = padded.metrics[0], packed.metrics[0]
    assert b["reward/mean"] == a["reward/mean"]  # the same rollout
    for key in ("critic/value_loss", "critic/values_mean", "actor/pg_loss", "actor/values_mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
