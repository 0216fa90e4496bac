"""What the GPU benches share: model shapes, the random models, tokenizer and prompts they train on,
GPU and host memory samplers, the driver's phase timeline, and the JSON report.

Everything is built here, nothing comes from a hub: random Hugging Face folders of
the Qwen2.5 family's and SmolLM2-135M's shapes (bf16, tied embeddings) with a
byte-level BPE tokenizer of exactly the model's ids, reward models of those shapes
(one-label sequence classifiers on the same tokenizer), and JSONL prompts of an
exact token length; the actor's training-speed probe (`run_probe`). `bench/ppo_gpu_bench.py`
(and its modes, `bench/ppo_modes.py`), `bench/two_gpu_bench.py`, `bench/train_profile.py` and
`bench/estimators.py` import it (from the same folder).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.megatron.config import WorkerConfig
from tandem.megatron.group import create_train_group

H200_BF16_PEAK_FLOPS = 989e12
"""H200 (SXM) dense bf16 peak, FLOP/s."""

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

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": QWEN_05B,
    "qwen2.5-1.5b": {
        **QWEN_05B,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
    },
    "qwen2.5-3b": {
        **QWEN_05B,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
    },
    "qwen2.5-7b": {
        **QWEN_05B,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "qwen2.5-14b": {
        **QWEN_05B,
        "vocab_size": 152064,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "qwen2.5-32b": {
        **QWEN_05B,
        "vocab_size": 152064,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "family": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 2048,
        "rope_theta": 100000.0,
    },
}
"""The benches' model shapes: the Qwen2.5 family's (their config.json; 0.5B-3B tie the embeddings,
7B-32B do not) and SmolLM2-135M's (Llama, 9 / 3 heads, tied). `family` and `rope_theta` are ours."""

WORK: dict[str, dict[str, int]] = {
    "smollm2-135m": {
        "prompts": 512,
        "prompt_len": 32,
        "response_len": 48,
        "global_batch_size": 512,
        "micro_batch_size": 32,
    },
}
"""A shape's own default work where it is not the 0.5B bench's (256 x 128 + 512, global batch 256,
micro batch 16): the small model's step of 512 samples of about 80 tokens."""

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


def build_policy(out: Path, shape: dict[str, Any], *, dtype: str, seed: int) -> int:
    """A random Qwen2 (rope theta 1e6) or Llama (`family: llama`) + tokenizer as a HF folder; its
    parameter count. Embeddings tied unless the shape says `tie_word_embeddings: False`.

    Models of more than a billion parameters are initialised on the GPU when there is one (minutes
    on the host's CPU otherwise); smaller ones on the CPU, so that a shape's weights stay those of
    every earlier run with the same seed.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    fields = dict(shape)
    family = fields.pop("family", "qwen2")
    rope_theta = float(fields.pop("rope_theta", 1e6))
    tied = bool(fields.pop("tie_word_embeddings", True))
    vocab = fields["vocab_size"]
    if (out / "config.json").is_file() and (out / "params.txt").is_file():
        return int((out / "params.txt").read_text())
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, words = build_tokenizer(vocab)
    tokenizer.save_pretrained(str(out))
    (out / "prompt_words.json").write_text(json.dumps(words))
    torch.manual_seed(seed)
    common = {
        **fields,
        "tie_word_embeddings": tied,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "bos_token_id": None,
        "eos_token_id": vocab - 1,
        "pad_token_id": vocab - 1,
    }
    if family == "llama":
        config: Any = LlamaConfig(**common, rms_norm_eps=1e-5)
        model_class: Any = LlamaForCausalLM
    else:
        config = Qwen2Config(**common, rms_norm_eps=1e-6, use_sliding_window=False)
        model_class = Qwen2ForCausalLM
    h, layers = fields["hidden_size"], fields["num_hidden_layers"]
    rough_params = layers * (4 * h * h + 3 * h * fields["intermediate_size"]) + vocab * h
    device = "cuda" if rough_params > 1e9 and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model: Any = model_class(config)
    model = model.to(getattr(torch, dtype)).to("cpu")
    if device == "cuda":
        # The float32 build's memory goes back to the GPU: kept in this process's allocator it stayed
        # reserved through the whole run (28 GiB for a 7B shape, 55 for 14B) and counted in its peaks.
        torch.cuda.empty_cache()
    model.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    (out / "params.txt").write_text(str(params))
    return params


def build_reward_model(out: Path, shape: dict[str, Any], *, policy_dir: Path, dtype: str, seed: int) -> int:
    """A random one-label sequence classifier of `shape` (Qwen2, or Llama with `family: llama`) on the
    policy's tokenizer, as a HF folder (`--rm-type model --reward-model OUT`); its parameter count.

    pad = EOS = the last id, as the policy's; the score head is scaled to a std of about 1 over
    random prompts, so that its score moves the reward as much as the rule's.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    if (out / "config.json").is_file() and (out / "params.txt").is_file():
        return int((out / "params.txt").read_text())
    fields = dict(shape)
    family = fields.pop("family", "qwen2")
    rope_theta = float(fields.pop("rope_theta", 1e6))
    fields.pop("tie_word_embeddings", None)  # a classifier has no LM head to tie
    vocab = fields["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(str(policy_dir)).save_pretrained(str(out))
    torch.manual_seed(seed + 1)
    common = {
        **fields,
        "num_labels": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "bos_token_id": None,
        "eos_token_id": vocab - 1,
        "pad_token_id": vocab - 1,
    }
    if family == "llama":
        model: Any = LlamaForSequenceClassification(LlamaConfig(**common, rms_norm_eps=1e-5))
    else:
        model = Qwen2ForSequenceClassification(
            Qwen2Config(**common, rms_norm_eps=1e-6, use_sliding_window=False)
        )
    with torch.no_grad():
        model.score.weight.mul_(1.0 / (model.score.weight.std() * fields["hidden_size"] ** 0.5))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    (out / "params.txt").write_text(str(params))
    return params


def stop_ids_for_median(vocab_size: int, median_len: int, *, seed: int = 0) -> tuple[int, ...]:
    """Token ids whose sampling ends a response after about `median_len` tokens, half the time.

    A random model samples nearly uniformly over its vocabulary (logits of std ~0.6), so
    stopping at any of `k` ids is a per-token hazard of about `k / vocab_size`, and the
    responses' lengths are geometric with median `ln 2 * vocab_size / k`: `k` is chosen for
    `median_len`. The 256 byte ids (prompt text) and the EOS id are left out. The bench
    reports the median it got.
    """
    k = max(1, round(math.log(2) * vocab_size / median_len))
    return tuple(sorted(random.Random(seed).sample(range(256, vocab_size - 1), k)))


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


class HostMemory:
    """The host's memory in use (MemTotal - MemAvailable, GiB), sampled every `interval_s` in the
    background with timestamps: what sleeping models keep in pinned host buffers shows up here."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def used_gib() -> float | None:
        try:
            fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            total = int(fields["MemTotal"].split()[0])
            available = int(fields["MemAvailable"].split()[0])
        except (OSError, KeyError, ValueError):
            return None
        return (total - available) / 1024**2

    def start(self) -> None:
        if self.used_gib() is not None:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            used = self.used_gib()
            if used is not None:
                with self._lock:
                    self.samples.append((time.time(), used))
            self._stop.wait(self.interval_s)

    def peak(self, t0: float, t1: float) -> float | None:
        """Highest sample in [t0, t1], GiB."""
        with self._lock:
            inside = [m for t, m in self.samples if t0 <= t <= t1]
        return max(inside) if inside else None

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


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
    """PPODriver whose phases (its clock's `on_phase`) also go into `timeline` as wall-clock intervals
    (for the memory peaks), and the rollout's draw as a `rollout` interval (not a phase of the driver's
    clock: `step()` draws it inside its own timer, or the async loop in the background)."""
    from tandem.ppo.loop.driver import PPODriver

    class TracedDriver(PPODriver):
        timeline: Timeline

        def setup(self) -> None:
            self.clock.on_phase = self.timeline.add
            super().setup()

        def draw(self, rollout_id: int, background: bool = False) -> Any:
            t0 = time.time()
            try:
                return super().draw(rollout_id, background)
            finally:
                self.timeline.add("rollout", t0, time.time())

    return TracedDriver


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


# --- the training-speed probe -------------------------------------------------------------------------
def make_probe_batch(
    n: int, seq_len: int, prompt_len: int, vocab: int, seed: int, *, varied: bool = False
) -> Any:
    """`n` random samples of `prompt_len` prompt tokens and `seq_len - prompt_len` response tokens;
    `varied`: each response's length drawn uniformly from 1 to that (a new draw per `seed`)."""
    import torch

    from tandem.megatron.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    longest = seq_len - prompt_len
    responses = torch.randint(1, longest + 1, (n,), generator=g).tolist() if varied else [longest] * n
    return RolloutBatch(
        tokens=[torch.randint(0, vocab, (prompt_len + r,), generator=g) for r in responses],
        response_lengths=responses,
        loss_masks=[torch.ones(r) for r in responses],
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
        # A cluster of its own, unless RAY_ADDRESS names one to join (as the driver's runs do): the tests join
        # the session's cluster instead of starting one each.
        address = os.environ.get("RAY_ADDRESS")
        own: dict[str, Any] = {
            "num_gpus": 1,
            "include_dashboard": False,
            **({"num_cpus": 2} if args.quick else {}),
        }
        ray.init(log_to_driver=False, **({"address": address} if address else own))
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


def fmt(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)
