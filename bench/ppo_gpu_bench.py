"""Shared PPO end to end on one GPU: per-phase seconds and peak memory, the cost of sharing, and MFU.

Issue 15's bench. Everything is built here, nothing comes from a hub: a random
Qwen2.5-0.5B-shaped model (bf16, tied embeddings) with a tokenizer of exactly its
151936 ids (byte-level BPE built the way Qwen2's is, since transformers rebuilds
a qwen2 folder's tokenizer as `Qwen2Tokenizer`; words "Ġabc" one token each;
any sampled id decodes), and a JSONL of prompts of exactly 128 tokens each. The
reward is dense (the fraction of response words starting with a..m), so the
curves move.

1. **PPO, two modes**, the same seed and data, each its own `PPODriver` in a
   fresh Ray: `shared` (actor, critic and the embedded engine time-share the GPU:
   sleep/wake, engine release/resume) and `resident` (`offload_train=False`:
   everything stays on the GPU; the engine's KV-cache budget lowered with
   `rollout_kv_cache_memory_fraction`). Shape: 256 prompts a step x 128 tokens,
   one response each of exactly 512 tokens (EOS ignored), KL loss on (so the
   reference log-probs are computed, as verl's example does). Per step: the
   driver's `time/<phase>` seconds, device-wide peak GPU memory per phase
   (NVML or `nvidia-smi -lms`, samples matched to the driver's phase intervals),
   tokens/s. Then: overhead of sharing = shared step / resident step - 1; what
   sharing adds (sleeps, wakes, engine release/resume, weight sync) as a share of
   the step; verl's anchor (66 s a step on one GPU) next to ours. The steps loop
   calls `PPODriver.step` (as `run()` does) but saves no checkpoint and exports
   no HF folder: those are not part of a step.
2. **Training-speed probe**: one actor `TrainWorker` trains on synthetic
   rollouts of the 1.2 B Llama-like probe shape (hidden 2048, 24 layers, seq
   2048, bf16); tokens/s of `train()` and MFU = 6 * params * tokens/s / 989e12
   (H200 dense bf16). `train()` also runs the old-log-prob forward, so the MFU
   counting it (8 * params) is given too.

Results go to `OUT/ppo_gpu_bench.json` (rewritten after every step, so a run
cut short keeps what it measured) and `OUT/ppo_gpu_bench_reward.png` (both
modes' reward curves; the other metric groups under `OUT/ppo_gpu_bench_plots/`),
plus each run's metrics.jsonl and events.jsonl under `OUT/ppo_gpu_bench_runs/<mode>/` (where the
host lacks matplotlib: `ppo-driver plot OUT/ppo_gpu_bench_runs/shared OUT/ppo_gpu_bench_runs/resident
--out DIR` redraws the curves anywhere). A markdown summary is printed.

GPU host, from the repo root (one device call; `--time-budget-s`, 500 by default, ends a
mode's steps early, after at least 2, so that the whole bench fits in about that):

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --out "$OUT"

CPU smoke run (tiny model, 2 steps a mode, a tiny probe):

    ./uvw run python bench/ppo_gpu_bench.py --quick --out /tmp/ppo-bench
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

H200_BF16_PEAK_FLOPS = 989e12
"""H200 (SXM) dense bf16 peak, FLOP/s."""

VERL_ANCHOR_S = {
    "generate": 17.5,
    "reference": 5.3,
    "values": 5.6,
    "critic_update": 16.5,
    "actor_update": 20.8,
    "step": 66.0,
}
"""verl's PPO example (Qwen2.5-0.5B, GSM8K) on one GPU: seconds per phase of a step (issue 15)."""

SHARING_PHASES = (
    "engine_release",
    "critic_wake",
    "critic_sleep",
    "actor_wake",
    "actor_sleep",
    "engine_resume_weights",
    "weight_sync",
    "engine_resume_kv_cache",
    "engine_resume",
)
"""Phases that sharing adds (weight sync included, as issue 15 counts it; it runs in both modes)."""

PHASES = (
    "rollout",
    "generate",
    "reward",
    *SHARING_PHASES,
    "critic_train",
    "actor_train",
    "step",
)
"""The driver's `time/<phase>` keys, in step order."""

QWEN_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
"""Qwen2.5-0.5B's architecture (max_position_embeddings cut from 32768: prompts + responses are 640)."""

QUICK_MODEL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

PROBE_MODEL = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5504,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}
"""The 1.2 B Llama-like probe shape (gpu/README.md's megatron-core figure)."""

QUICK_PROBE_MODEL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

QWEN_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX)."""

REWARD_SOURCE = '''"""Bench reward: the fraction of response words that start with a..m (dense, ~0.5 at random)."""


def first_half_letters(inputs):
    out = []
    for inp in inputs:
        words = inp.response.split()
        hits = sum(1 for w in words if "a" <= w[0] <= "m")
        out.append(hits / len(words) if words else 0.0)
    return out
'''


# --- the model, the tokenizer, the data -------------------------------------------------------------
def build_tokenizer(vocab_size: int) -> tuple[Any, list[str]]:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids, and the words a prompt may use.

    Built the way Qwen2's tokenizer is (Qwen's split regex, ByteLevel, NFC), so that transformers'
    `AutoTokenizer`, which rebuilds a qwen2 folder's tokenizer as `Qwen2Tokenizer` from the saved
    vocab and merges, gets this very tokenizer back. Ids: the 256 byte symbols, then words
    "Ġ" + letters ("Ġa".."Ġz", "Ġaa".., "Ġaaa"..) each merged from its prefix and its last
    letter, until id V-2; `<|endoftext|>` (EOS, pad, unk) is V-1. Every id decodes. A prompt
    " abc abd ..." of the longest complete level's words is one token per word.
    """
    import itertools
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    vocab: dict[str, int] = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    words: list[str] = []
    level = 0
    while len(vocab) < vocab_size - 1:
        level += 1
        complete = True
        for letters in itertools.product(string.ascii_lowercase, repeat=level):
            if len(vocab) >= vocab_size - 1:
                complete = False
                break
            token = "\u0120" + "".join(letters)
            vocab[token] = len(vocab)
            merges.append((token[:-1], token[-1]))
        if complete:
            words = ["".join(w) for w in itertools.product(string.ascii_lowercase, repeat=level)]
    vocab[eos] = vocab_size - 1
    if not words:
        raise ValueError(f"vocab_size {vocab_size} is too small for one level of words (needs >= 283)")
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos,
        pad_token=eos,
        unk_token=eos,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    return tokenizer, words


def build_policy(out: Path, shape: dict[str, int], *, dtype: str, seed: int) -> int:
    """A random Qwen2 (tied embeddings, rope theta 1e6) + tokenizer as a HF folder; its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = shape["vocab_size"]
    if (out / "config.json").is_file() and (out / "params.txt").is_file():
        return int((out / "params.txt").read_text())
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, words = build_tokenizer(vocab)
    tokenizer.save_pretrained(str(out))
    (out / "prompt_words.json").write_text(json.dumps(words))
    torch.manual_seed(seed)
    config = Qwen2Config(
        **shape,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )
    model: Any = Qwen2ForCausalLM(config)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    (out / "params.txt").write_text(str(params))
    return params


def build_probe_model(out: Path, shape: dict[str, int], *, seq_len: int) -> int:
    """A random Llama (untied) in bf16 for the training-speed probe; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file() and (out / "params.txt").is_file():
        return int((out / "params.txt").read_text())
    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=max(4096, seq_len), tie_word_embeddings=False)
    model: Any = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    (out / "params.txt").write_text(str(params))
    return params


def write_prompts(path: Path, hf_dir: Path, *, n: int, prompt_len: int, seed: int) -> None:
    """`n` JSONL prompts " w1 w2 ..." of exactly `prompt_len` one-token words (the tokenizer's)."""
    words = json.loads((hf_dir / "prompt_words.json").read_text())
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(" " + rng.choice(words) for _ in range(prompt_len))
            f.write(json.dumps({"prompt": prompt, "label": ""}) + "\n")


def check_prompts(hf_dir: Path, path: Path, prompt_len: int) -> None:
    """Every prompt is exactly `prompt_len` tokens, and a sampled id round-trips through decode."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    lines = path.read_text().splitlines()[:8]
    for line in lines:
        ids = tokenizer(json.loads(line)["prompt"])["input_ids"]
        if len(ids) != prompt_len:
            raise RuntimeError(f"a prompt tokenizes to {len(ids)} tokens, not {prompt_len}")
    vocab_size = int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])
    if len(tokenizer) != vocab_size or tokenizer.eos_token_id != vocab_size - 1:
        raise RuntimeError(
            f"tokenizer: {len(tokenizer)} ids, EOS {tokenizer.eos_token_id}; the model has {vocab_size} ids"
        )
    for ids in ([0, 5, 255], list(range(256, vocab_size, max(1, vocab_size // 97)))):
        tokenizer.decode(ids)  # every id decodes


# --- GPU memory ------------------------------------------------------------------------------------
def _visible_device() -> str | None:
    """The first CUDA_VISIBLE_DEVICES entry (index or UUID), for NVML / nvidia-smi; None: GPU 0."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return value or None


class GpuMemory:
    """Device-wide used GPU memory (MiB), sampled every `interval_s` in the background with timestamps."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start sampling: NVML when pynvml imports, else `nvidia-smi -lms`; nothing without either."""
        device = _visible_device()
        try:
            import pynvml

            pynvml.nvmlInit()
            if device is not None and device.startswith(("GPU-", "MIG-")):
                handle = pynvml.nvmlDeviceGetHandleByUUID(device)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(device) if device else 0)
            self.source = "nvml"
            self._thread = threading.Thread(target=self._nvml_loop, args=(pynvml, handle), daemon=True)
        except Exception:
            if shutil.which("nvidia-smi") is None:
                return
            cmd = [
                "nvidia-smi",
                "--query-gpu=timestamp,memory.used",
                "--format=csv,noheader,nounits",
                "-lms",
                str(max(1, int(self.interval_s * 1000))),
            ]
            if device is not None:
                cmd += ["-i", device]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.source = "nvidia-smi"
            self._thread = threading.Thread(target=self._smi_loop, daemon=True)
        self._thread.start()

    def _nvml_loop(self, pynvml: Any, handle: Any) -> None:
        while not self._stop.is_set():
            used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            with self._lock:
                self.samples.append((time.time(), used))
            self._stop.wait(self.interval_s)

    def _smi_loop(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            received = time.time()
            try:
                stamp, used = (part.strip() for part in line.split(","))
                mib = float(used)
            except ValueError:
                continue
            try:
                t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                t = received  # an unexpected timestamp format: the time the line arrived
            sample = (t, mib)
            with self._lock:
                self.samples.append(sample)

    @property
    def available(self) -> bool:
        return self.source is not None

    def now(self) -> float | None:
        """The latest sample, MiB."""
        with self._lock:
            return self.samples[-1][1] if self.samples else None

    def peak(self, t0: float, t1: float) -> float | None:
        """Highest sample in [t0, t1], MiB; None when none fell there."""
        with self._lock:
            inside = [m for t, m in self.samples if t0 <= t <= t1]
        return max(inside) if inside else None

    def low(self, t0: float, t1: float) -> float | None:
        """Lowest sample in [t0, t1], MiB; None when none fell there."""
        with self._lock:
            inside = [m for t, m in self.samples if t0 <= t <= t1]
        return min(inside) if inside else None

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait_settled(self, below_mib: float, timeout_s: float = 30.0) -> None:
        """Wait until used memory drops to `below_mib` (the last run's processes are gone), or timeout."""
        if not self.available:
            return
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            now = self.now()
            if now is not None and now <= below_mib:
                return
            time.sleep(0.2)


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    device = _visible_device()
    if device is not None:
        cmd += ["-i", device]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except Exception:
        return None


# --- one PPO mode -------------------------------------------------------------------------------------
class Timeline:
    """Phase intervals (wall clock) of the driver, tagged with the step they belong to."""

    def __init__(self) -> None:
        self.intervals: list[tuple[str, float, float, int | None]] = []
        self.step: int | None = None

    def add(self, name: str, t0: float, t1: float) -> None:
        self.intervals.append((name, t0, t1, self.step))

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.add(name, t0, time.time())


def traced_driver_class() -> type:
    """PPODriver whose `_phase` also records each phase's wall-clock interval (for the memory peaks)."""
    from tandem.ppo.driver import PPODriver

    class TracedDriver(PPODriver):
        timeline: Timeline

        @contextlib.contextmanager
        def _phase(self, name: str) -> Iterator[None]:
            t0 = time.time()
            try:
                with super()._phase(name):
                    yield
            finally:
                self.timeline.add(name, t0, time.time())

    return TracedDriver


def ppo_values(
    args: argparse.Namespace, mode: str, hf_dir: Path, data: Path, reward: Path, run_dir: Path
) -> dict:
    """The PPOConfig fields of one mode."""
    values: dict[str, Any] = {
        "hf_checkpoint": str(hf_dir),
        "prompt_data": str(data),
        "input_key": "prompt",
        "apply_chat_template": False,
        "max_prompt_len": args.prompt_len,
        "run_dir": str(run_dir),
        "num_rollout": args.steps,
        "rollout_batch_size": args.prompts,
        "n_samples_per_prompt": 1,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "rollout_max_response_len": args.response_len,
        "rollout_ignore_eos": True,
        "custom_rm_path": f"{reward}:first_half_letters",
        "lr": args.lr,
        "critic_lr": args.critic_lr,
        "use_kl_loss": not args.no_kl,
        "kl_loss_coef": 0.0 if args.no_kl else 0.001,
        "seed": args.seed,
        "device": "cpu" if args.quick else "cuda",
        "params_dtype": "float32" if args.quick else "bfloat16",
        "offload_backend": "pinned_host",
        "local_gpus": 1 if args.quick else None,
        "offload_train": mode == "shared",
        "local_single_rank_groups": args.local_single_rank_groups,
        "keep_single_rank_groups": args.keep_single_rank_groups,
        "export_hf": False,
        "tensorboard": False,
        "progress": False,
        "save_interval": None,
        "eval_interval": None,
    }
    if mode == "resident":
        values["rollout_kv_cache_memory_fraction"] = args.resident_kv_fraction
    return values


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize_mode(result: dict[str, Any], sampler: GpuMemory, timeline: Timeline) -> None:
    """Steady-state means, sharing share, tokens/s and per-phase GPU peaks, into `result`."""
    steps = result["steps"]
    steady = steps[1:] if len(steps) > 1 else steps
    result["steady_steps"] = [s["step"] for s in steady]
    keys = sorted({k for s in steady for k in s if k.startswith("time/")})
    phase_s = {k[5:]: mean([float(s.get(k, 0.0)) for s in steady]) for k in keys}
    result["phase_s_mean"] = phase_s
    step_s = phase_s.get("step")
    result["step_s_mean"] = step_s
    adds = sum(phase_s.get(p) or 0.0 for p in SHARING_PHASES)
    result["sharing_adds_s"] = adds
    result["sharing_adds_share"] = adds / step_s if step_s else None
    result["sharing_adds_excl_weight_sync_s"] = adds - (phase_s.get("weight_sync") or 0.0)
    result["tokens_per_s"] = mean([float(s["throughput/tokens_per_s"]) for s in steady])
    result["all_tokens_per_s"] = (
        result["tokens_per_s"] * (result["prompt_len"] + result["response_len"]) / result["response_len"]
        if result["tokens_per_s"]
        else None
    )
    result["reward_mean"] = [s.get("reward/mean") for s in steps]
    if not sampler.available:
        result["gpu_peak_gib"] = None
        return
    per_phase: dict[str, float] = {}
    per_step: dict[int, dict[str, float | None]] = {}
    for name, t0, t1, step in _with_rollout_parts(timeline, steps):
        mib = sampler.peak(t0, t1)
        if mib is None:
            continue
        gib = mib / 1024
        per_phase[name] = max(per_phase.get(name, 0.0), gib)
        if step is not None:
            per_step.setdefault(step, {})[name] = max(per_step.get(step, {}).get(name) or 0.0, gib)
    # The floor: the least the GPU held during the steps (CUDA contexts, whatever stays when asleep).
    # Were the phases' memory not shared, the peak would be the floor plus each big phase's own rise.
    lows = [sampler.low(t0, t1) for name, t0, t1, _ in timeline.intervals if name == "step_total"]
    known = [x for x in lows if x is not None]
    floor = min(known) / 1024 if known else None
    overall = max(per_phase.values()) if per_phase else None
    big = [per_phase[p] for p in ("generate", "critic_train", "actor_train") if p in per_phase]
    unshared = floor + sum(x - floor for x in big) if floor is not None and big else None
    result["gpu_peak_gib"] = {
        "per_phase": per_phase,
        "per_step": {str(k): v for k, v in sorted(per_step.items())},
        "overall": overall,
        "floor_during_steps": floor,
        "largest_big_phase": max(big) if big else None,
        "floor_plus_big_phase_rises": unshared,
        "overall_over_floor_plus_rises": overall / unshared if overall and unshared else None,
    }


def _with_rollout_parts(
    timeline: Timeline, steps: list[dict[str, Any]]
) -> list[tuple[str, float, float, int | None]]:
    """The timeline plus `generate` and `reward` windows cut from each `rollout` by their seconds."""
    by_step = {s["step"]: s for s in steps}
    out = list(timeline.intervals)
    for name, t0, t1, step in timeline.intervals:
        if name != "rollout" or step not in by_step:
            continue
        gen = float(by_step[step].get("time/generate", 0.0))
        rew = float(by_step[step].get("time/reward", 0.0))
        out.append(("generate", t0, min(t1, t0 + gen), step))
        out.append(("reward", min(t1, t0 + gen), min(t1, t0 + gen + rew), step))
    return out


def run_mode(
    mode: str,
    args: argparse.Namespace,
    paths: dict[str, Path],
    sampler: GpuMemory,
    report: dict[str, Any],
    deadline: float,
    reserve_s: float,
) -> None:
    """One PPO run in a fresh Ray; its figures (or its error) go into `report["modes"][mode]`."""
    import ray

    from tandem.ppo.config_file import unvalidated

    run_dir = paths["work"] / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    values = ppo_values(args, mode, paths["hf"], paths["data"], paths["reward"], run_dir)
    result: dict[str, Any] = {
        "mode": mode,
        "run_dir": str(run_dir),
        "config": {k: v for k, v in values.items() if k not in ("hf_checkpoint", "prompt_data", "run_dir")},
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "steps": [],
        "error": None,
    }
    report["modes"][mode] = result
    timeline = Timeline()
    driver = None
    started = time.time()
    baseline = sampler.now()
    result["gpu_used_before_gib"] = baseline / 1024 if baseline is not None else None
    try:
        config = unvalidated(values)
        driver = traced_driver_class()(config)
        driver.timeline = timeline
        with timeline.span("setup"):
            driver.setup()
        result["setup_s"] = time.time() - started
        for rollout_id in range(driver.start_rollout_id, config.num_rollout):
            last = result["steps"][-1]["time/step"] if result["steps"] else None
            if (
                len(result["steps"]) >= 2
                and last is not None
                and time.time() + 1.3 * last > deadline - reserve_s
            ):
                result["stopped_early"] = f"time budget: {len(result['steps'])} of {config.num_rollout} steps"
                print(f"[{mode}] {result['stopped_early']}", flush=True)
                break
            timeline.step = rollout_id
            with timeline.span("step_total"):
                metrics = driver.step(rollout_id)
            timeline.step = None
            driver.metrics_so_far.append(metrics)
            driver.logger.log(rollout_id, metrics)
            row = {"step": rollout_id}
            row.update(
                {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            )
            result["steps"].append(row)
            print(
                f"[{mode}] step {rollout_id}: {row['time/step']:.2f} s, generate {row.get('time/generate', 0):.2f} s, "
                f"critic {row.get('time/critic_train', 0):.2f} s, actor {row.get('time/actor_train', 0):.2f} s, "
                f"reward {row.get('reward/mean', float('nan')):.4f}",
                flush=True,
            )
            summarize_mode(result, sampler, timeline)
            write_report(report, paths["json"])
    except Exception:
        result["error"] = traceback.format_exc()[-6000:]
        print(f"[{mode}] FAILED:\n{result['error']}", file=sys.stderr, flush=True)
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.close()
        with contextlib.suppress(Exception):
            ray.shutdown()
    result["wall_s"] = time.time() - started
    if result["steps"]:
        with contextlib.suppress(Exception):
            summarize_mode(result, sampler, timeline)
    result["phase_intervals"] = [
        {"phase": n, "t0": t0 - started, "t1": t1 - started, "step": s} for n, t0, t1, s in timeline.intervals
    ]
    # OUT/ppo_gpu_bench_runs/<mode>/ is a run dir for `ppo-driver plot` (where the host has no matplotlib).
    copy = paths["out"] / "ppo_gpu_bench_runs" / mode
    copy.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "events.jsonl"):
        with contextlib.suppress(Exception):
            shutil.copy(run_dir / name, copy / name)
    write_report(report, paths["json"])
    if baseline is not None:
        sampler.wait_settled(baseline + 1024)


# --- the training-speed probe -------------------------------------------------------------------------
def make_probe_batch(n: int, seq_len: int, prompt_len: int, vocab: int, seed: int) -> Any:
    import torch

    from tandem.megatron.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    response = seq_len - prompt_len
    return RolloutBatch(
        tokens=[torch.randint(0, vocab, (seq_len,), generator=g) for _ in range(n)],
        response_lengths=[response] * n,
        loss_masks=[torch.ones(response) for _ in range(n)],
        rewards=torch.randn(n, generator=g),
    )


def run_probe(
    args: argparse.Namespace, paths: dict[str, Path], sampler: GpuMemory, report: dict[str, Any]
) -> None:
    """tokens/s and MFU of the actor's `train()` on the probe shape; figures (or error) into report["probe"]."""
    import ray

    shape = QUICK_PROBE_MODEL if args.quick else PROBE_MODEL
    seq_len = args.probe_seq_len
    result: dict[str, Any] = {
        "shape": {**shape, "seq_len": seq_len},
        "samples_per_train": args.probe_samples,
        "micro_batch_size": args.probe_micro_batch_size,
        "error": None,
    }
    report["probe"] = result
    started = time.time()
    group = None
    try:
        from ray.util.placement_group import placement_group

        from tandem.megatron.config import WorkerConfig
        from tandem.megatron.group import create_train_group

        hf = paths["work"] / "probe-hf"
        params = build_probe_model(hf, shape, seq_len=seq_len)
        embedding = shape["vocab_size"] * shape["hidden_size"]
        result["params"] = params
        result["params_without_input_embedding"] = params - embedding
        config = WorkerConfig(
            hf_checkpoint=str(hf),
            rollout_batch_size=args.probe_samples,
            n_samples_per_prompt=1,
            global_batch_size=args.probe_samples,
            micro_batch_size=args.probe_micro_batch_size,
            device="cpu" if args.quick else "cuda",
            params_dtype="float32" if args.quick else "bfloat16",
            offload_backend="pinned_host",
            lr=1e-6,
            seed=args.seed,
            save=str(paths["work"] / "probe-save"),
        )
        ray.init(
            num_gpus=1,
            include_dashboard=False,
            log_to_driver=False,
            **({"num_cpus": 2} if args.quick else {}),
        )
        pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
        ray.get(pg.ready())
        t0 = time.time()
        group = create_train_group(config, "actor", pg, [0], num_gpus_per_worker=0.4, num_cpus_per_worker=0.4)
        result["setup_s"] = time.time() - t0
        batch_ref = ray.put(
            make_probe_batch(args.probe_samples, seq_len, args.probe_prompt_len, shape["vocab_size"], 0)
        )
        tokens = args.probe_samples * seq_len
        seconds: list[float] = []
        windows: list[tuple[float, float]] = []
        for i in range(args.probe_iters):
            t0 = time.time()
            ray.get(group.train(i, [batch_ref]))
            t1 = time.time()
            seconds.append(t1 - t0)
            windows.append((t0, t1))
            print(f"[probe] train {i}: {t1 - t0:.2f} s, {tokens / (t1 - t0):.0f} tokens/s", flush=True)
        timed = seconds[1:] if len(seconds) > 1 else seconds
        train_s = statistics.median(timed)
        tps = tokens / train_s
        result.update(
            {
                "tokens_per_train": tokens,
                "train_s": seconds,
                "train_s_median_after_first": train_s,
                "tokens_per_s": tps,
                "mfu_6n": 6 * params * tps / H200_BF16_PEAK_FLOPS,
                "mfu_8n_with_logprob_forward": 8 * params * tps / H200_BF16_PEAK_FLOPS,
                "peak_flops": H200_BF16_PEAK_FLOPS,
            }
        )
        if sampler.available:
            peaks = [sampler.peak(a, b) for a, b in windows]
            known = [p for p in peaks if p is not None]
            result["gpu_peak_gib"] = max(known) / 1024 if known else None
    except Exception:
        result["error"] = traceback.format_exc()[-6000:]
        print(f"[probe] FAILED:\n{result['error']}", file=sys.stderr, flush=True)
    finally:
        if group is not None:
            with contextlib.suppress(Exception):
                group.kill()
        with contextlib.suppress(Exception):
            ray.shutdown()
    result["wall_s"] = time.time() - started
    write_report(report, paths["json"])


# --- the report ----------------------------------------------------------------------------------
def write_report(report: dict[str, Any], path: Path) -> None:
    report["elapsed_s"] = time.time() - report["_started"]
    data = {k: v for k, v in report.items() if not k.startswith("_")}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def compare(report: dict[str, Any]) -> None:
    """Overhead of sharing, vs verl, and the issue's goals."""
    shared = report["modes"].get("shared") or {}
    resident = report["modes"].get("resident") or {}
    s_step, r_step = shared.get("step_s_mean"), resident.get("step_s_mean")
    report["overhead_of_sharing"] = s_step / r_step - 1 if s_step and r_step else None
    phase = shared.get("phase_s_mean") or {}
    ours = {
        "generate": phase.get("generate"),
        "reference + actor update (ours: actor_train: old + ref log-probs, update)": phase.get("actor_train"),
        "values + critic update (ours: critic_train)": phase.get("critic_train"),
        "what sharing adds (ours)": shared.get("sharing_adds_s"),
        "step": s_step,
    }
    verl = {
        "generate": VERL_ANCHOR_S["generate"],
        "reference + actor update (ours: actor_train: old + ref log-probs, update)": VERL_ANCHOR_S[
            "reference"
        ]
        + VERL_ANCHOR_S["actor_update"],
        "values + critic update (ours: critic_train)": VERL_ANCHOR_S["values"]
        + VERL_ANCHOR_S["critic_update"],
        "what sharing adds (ours)": None,
        "step": VERL_ANCHOR_S["step"],
    }
    report["vs_verl"] = {k: {"verl_s": verl[k], "shared_s": ours[k]} for k in ours}
    probe = report.get("probe") or {}
    peaks = shared.get("gpu_peak_gib") or {}
    report["goals"] = {
        "shared_step_le_33s": None if s_step is None else s_step <= 33.0,
        "sharing_adds_le_10pct": None
        if shared.get("sharing_adds_share") is None
        else shared["sharing_adds_share"] <= 0.10,
        "probe_mfu_ge_40pct": None if probe.get("mfu_6n") is None else probe["mfu_6n"] >= 0.40,
        # ~1 / (number of big phases) when the phases share the memory; ~1 when they add up.
        "shared_peak_over_floor_plus_phase_rises": peaks.get("overall_over_floor_plus_rises"),
        "shared_peak_over_resident_peak": (
            peaks["overall"] / (resident.get("gpu_peak_gib") or {})["overall"]
            if peaks.get("overall") and (resident.get("gpu_peak_gib") or {}).get("overall")
            else None
        ),
    }


def plot(report: dict[str, Any], paths: dict[str, Path]) -> None:
    runs = [(m, Path(r["run_dir"])) for m, r in report["modes"].items() if r.get("steps")]
    if not runs:
        return
    try:
        from tandem.ppo.plot import plot_run

        plots = paths["out"] / "ppo_gpu_bench_plots"
        written = plot_run([d for _, d in runs], plots, labels=[m for m, _ in runs])
        report["plots"] = [str(p) for p in written]
        reward = plots / "reward.png"
        if reward.is_file():
            shutil.copy(reward, paths["out"] / "ppo_gpu_bench_reward.png")
            report["reward_png"] = str(paths["out"] / "ppo_gpu_bench_reward.png")
    except Exception:
        report["plot_error"] = traceback.format_exc()[-3000:]


def fmt(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def print_summary(report: dict[str, Any]) -> None:
    modes = report["modes"]
    names = list(modes)
    print(f"\n## PPO on {report.get('gpu') or 'CPU'} ({report['shape']})\n")
    print("| phase (s, mean of steady steps) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for p in PHASES:
        cells = [(modes[m].get("phase_s_mean") or {}).get(p) for m in names]
        if any(c is not None for c in cells):
            print(f"| {p} | " + " | ".join(fmt(c) for c in cells) + " |")
    rows = {
        "sharing adds (s)": [modes[m].get("sharing_adds_s") for m in names],
        "sharing adds (% of step)": [
            None if modes[m].get("sharing_adds_share") is None else 100 * modes[m]["sharing_adds_share"]
            for m in names
        ],
        "response tokens/s": [modes[m].get("tokens_per_s") for m in names],
        "peak GPU GiB": [(modes[m].get("gpu_peak_gib") or {}).get("overall") for m in names],
        "setup (s)": [modes[m].get("setup_s") for m in names],
    }
    for label, cells in rows.items():
        print(f"| {label} | " + " | ".join(fmt(c, ".1f") for c in cells) + " |")
    for m in names:
        peaks = (modes[m].get("gpu_peak_gib") or {}).get("per_phase") or {}
        if peaks:
            text = ", ".join(f"{p} {v:.1f}" for p, v in sorted(peaks.items(), key=lambda kv: -kv[1]))
            print(f"\npeak GPU GiB by phase, {m}: {text}")
        if modes[m].get("error"):
            print(f"\n{m} FAILED: {modes[m]['error'].strip().splitlines()[-1]}")
    print(
        f"\noverhead of sharing (shared step / resident step - 1): {fmt(report.get('overhead_of_sharing'), '.1%')}"
    )
    print("\n| vs verl (one GPU) | verl s | ours (shared) s |\n|---|---|---|")
    for k, v in (report.get("vs_verl") or {}).items():
        print(f"| {k} | {fmt(v['verl_s'], '.1f')} | {fmt(v['shared_s'], '.1f')} |")
    probe = report.get("probe")
    if probe:
        if probe.get("error"):
            print(f"\nprobe FAILED: {probe['error'].strip().splitlines()[-1]}")
        else:
            print(
                f"\nprobe ({probe['params'] / 1e9:.2f} B params, seq {probe['shape']['seq_len']}): "
                f"{fmt(probe.get('tokens_per_s'), '.0f')} tokens/s, MFU {fmt(probe.get('mfu_6n'), '.1%')} "
                f"(6N; {fmt(probe.get('mfu_8n_with_logprob_forward'), '.1%')} counting the log-prob forward), "
                f"peak {fmt(probe.get('gpu_peak_gib'), '.1f')} GiB"
            )
    print(f"\ngoals: {report.get('goals')}")
    print(f"command: {report['command']}")


# --- main --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder (or a .json path) for the results")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 2 steps a mode")
    parser.add_argument("--steps", type=int, default=None, help="PPO steps per mode (default 5; --quick 2)")
    parser.add_argument("--skip-resident", action="store_true", help="run only the shared mode")
    parser.add_argument("--skip-shared", action="store_true", help="run only the resident mode")
    parser.add_argument("--skip-probe", action="store_true", help="no training-speed probe")
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step (default 256)")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens a prompt (default 128)")
    parser.add_argument("--response-len", type=int, default=None, help="tokens a response (default 512)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="default 256")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default 16")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--critic-lr", type=float, default=1e-5)
    parser.add_argument("--no-kl", action="store_true", help="no KL loss (so no reference log-probs)")
    parser.add_argument(
        "--no-local-single-rank-groups",
        dest="local_single_rank_groups",
        action="store_false",
        help="one-rank groups get NCCL communicators (torn down at each sleep) instead of answering in the process",
    )
    parser.add_argument(
        "--keep-single-rank-groups",
        action="store_true",
        help="with --no-local-single-rank-groups: the one-rank communicators stay alive while asleep",
    )
    parser.add_argument(
        "--resident-kv-fraction",
        type=float,
        default=0.1,
        help="engine KV-cache memory fraction, resident mode",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--probe-seq-len", type=int, default=None, help="default 2048")
    parser.add_argument("--probe-prompt-len", type=int, default=None, help="default 128")
    parser.add_argument("--probe-samples", type=int, default=None, help="sequences per train() (default 64)")
    parser.add_argument("--probe-micro-batch-size", type=int, default=None, help="default 4")
    parser.add_argument(
        "--probe-iters", type=int, default=None, help="train() calls, the first not timed (3)"
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=500.0,
        help="stop a mode's steps early (after 2) so that the whole bench ends within this many seconds",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="models, data and run dirs (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "steps": (2, 5),
        "prompts": (8, 256),
        "prompt_len": (16, 128),
        "response_len": (8, 512),
        "global_batch_size": (8, 256),
        "micro_batch_size": (4, 16),
        "probe_seq_len": (64, 2048),
        "probe_prompt_len": (16, 128),
        "probe_samples": (8, 64),
        "probe_micro_batch_size": (4, 4),
        "probe_iters": (2, 3),
    }
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    started = time.time()
    deadline = started + args.time_budget_s
    out = args.out
    json_path = out if out.suffix == ".json" else out / "ppo_gpu_bench.json"
    out_dir = json_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ppo-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    paths = {"out": out_dir, "json": json_path, "work": work}

    import torch
    import transformers

    shape = QUICK_MODEL if args.quick else QWEN_05B
    report: dict[str, Any] = {
        "_started": started,
        "bench": "ppo_gpu_bench",
        "command": "python3 bench/ppo_gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "quick": args.quick,
        "gpu": gpu_name(),
        "host": platform.node(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version,
        },
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "shape": (
            f"{args.prompts} prompts x {args.prompt_len} tokens, 1 response of {args.response_len} tokens, "
            f"global batch {args.global_batch_size}, micro {args.micro_batch_size}, "
            f"KL loss {'off' if args.no_kl else 'on'}"
        ),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "verl_anchor_s": VERL_ANCHOR_S,
        "modes": {},
    }
    sampler = GpuMemory()
    sampler.start()
    report["gpu_memory_source"] = sampler.source
    write_report(report, json_path)
    try:
        t0 = time.time()
        paths["hf"] = work / "policy-hf"
        params = build_policy(
            paths["hf"], shape, dtype="float32" if args.quick else "bfloat16", seed=args.seed
        )
        paths["data"] = work / "prompts.jsonl"
        n_prompts = args.prompts * max(args.steps, 1)
        write_prompts(paths["data"], paths["hf"], n=n_prompts, prompt_len=args.prompt_len, seed=0)
        check_prompts(paths["hf"], paths["data"], args.prompt_len)
        paths["reward"] = work / "bench_reward.py"
        paths["reward"].write_text(REWARD_SOURCE)
        report["model"] = {"family": "qwen2", **shape, "tie_word_embeddings": True, "params": params}
        report["build_s"] = time.time() - t0
        write_report(report, json_path)

        modes = [
            m for m, skip in (("shared", args.skip_shared), ("resident", args.skip_resident)) if not skip
        ]
        for i, mode in enumerate(modes):
            # Keep time for what follows: another mode (about this one's wall time) and the probe.
            reserve = 0.0 if args.skip_probe else 120.0
            if i + 1 < len(modes):
                reserve += 0.5 * (deadline - time.time() - reserve)
            run_mode(mode, args, paths, sampler, report, deadline, reserve)
        compare(report)
        plot(report, paths)
        write_report(report, json_path)
        if not args.skip_probe:
            run_probe(args, paths, sampler, report)
        compare(report)
    except Exception:
        report["error"] = traceback.format_exc()[-6000:]
        print(report["error"], file=sys.stderr)
    finally:
        sampler.stop()
        write_report(report, json_path)
    print_summary(report)
    print(f"\nJSON: {json_path}")
    failed = [m for m, r in report["modes"].items() if r.get("error")]
    probe_failed = bool((report.get("probe") or {}).get("error"))
    return 1 if report.get("error") or failed or probe_failed else 0


if __name__ == "__main__":
    sys.exit(main())
