"""Where the actor's update spends its time: tokens/s, MFU and a kernel profile of one `TrainWorker.train`.

One actor `TrainWorker`, built in this process (no Ray), trains on synthetic
rollouts of the 1.2 B Llama-like probe shape of `ppo_harness.py` (hidden 2048,
24 layers, seq 2048, bf16; 64 sequences a `train()`), or of one of the PPO bench's
shapes with `--shape` (e.g. `--shape smollm2-135m --seq-len 80 --samples 512
--micro-batch-size 32`, the small model's step). It measures:

1. `train()` (old-log-prob forward, then the update) and `compute_log_probs()`
   (that forward alone), each the median of `--iters` calls after a warm-up
   call; the update's seconds are the difference of their fastest calls (a
   one-off slow call, such as a recompilation, drops out), and its MFU
   6 * params * tokens / update seconds / 989 TFLOP/s (H200 dense bf16). Where
   that difference is not positive the update's figures are null and
   `update_unmeasured` says why.
2. One `train()` under `torch.profiler`: the GPU's kernel time by kind (matrix
   multiplies, attention, optimizer, copies and casts, reductions, other
   element-wise work, NCCL), the share of the wall time the GPU was busy, the
   top kernels, and the host's synchronisations (`cudaStreamSynchronize`,
   `.item()`) with their count.

GPU host, from the repo root (about 100 s for the default shape):

    source .gpu-kit/setup.sh && python3 bench/train_profile.py --out "$OUT/train_profile.json"

A/B of one lever: `--no-fused-rope` runs Megatron's unfused RoPE instead of ours
(`tandem.megatron.models.rope`); the JSON records `fused_rope` (what the model ran) and
`fused_rope_flag` (null: the default). `--rope-kernels compiled` runs our RoPE as the
`torch.compile`d functions instead of the Triton kernel (`rope.KERNELS`). `--no-fused-swiglu`
runs Megatron's eager SwiGLU instead of our kernels (`fused_swiglu`; the JSON's `fused_swiglu` is
whether the model's MLPs call them, `swiglu_min_elements` the smallest call they take, smaller ones
eager, `fused_swiglu_flag` the flag).
`--sdpa-cudnn` lets the attention use cuDNN's kernel, which `models/attention.py`
leaves out by default. `--no-head-at-responses` runs the actor's vocabulary head over every
position (prompts and padding too) instead of the response positions alone
(`models/head_rows.py`). `--varied-lengths` draws every response's length anew for
each call, as PPO's steps bring them, and `--packed` packs them: for example
`--shape qwen2.5-0.5b --seq-len 640 --prompt-len 128 --samples 256
--micro-batch-size 16 --varied-lengths --packed`, the PPO bench's realistic step;
`--packed-attention blocks` runs its attention as a call per sample instead of one varlen
flash call a layer (the default's choice on a GPU).

CPU smoke run (tiny model, fp32, gloo; the profile then lists CPU operators):

    ./uvw run python bench/train_profile.py --quick --out /tmp/train_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_harness as single  # the shapes, their model builders and the probe's batches

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("nccl", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    (
        "matmul",
        ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "::mm", "::addmm", "::bmm", "::linear"),
    ),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "convert", "fill", "::cat", "index")),
    ("reduction/softmax/norm", ("reduce", "softmax", "norm", "logsumexp", "sum", "max", "mean")),
    (
        "element-wise",
        (
            "elementwise",
            "vectorized",
            "unrolled",
            "pointwise",
            "mul",
            "add",
            "sub",
            "div",
            "where",
            "silu",
            "exp",
        ),
    ),
)
"""Kernel kinds, matched in this order against the lower-cased kernel (or CPU operator) name."""

SYNC_NAMES = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "aten::_local_scalar_dense",
)
"""Host-side events that wait for the GPU (`.item()` is `aten::_local_scalar_dense`)."""


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def self_device_us(event: Any) -> float:
    """An averaged profiler event's own device time in µs (the attribute's name moved across torch versions)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value)
    return 0.0


def summarize_profile(prof: Any, wall_s: float, *, on_gpu: bool) -> dict[str, Any]:
    """Kernel time by kind, GPU busy share, top kernels and host syncs of one profiled call."""
    from torch.autograd import DeviceType

    averages = prof.key_averages()
    if on_gpu:
        kernels = [(e.key, self_device_us(e), e.count) for e in averages if e.device_type == DeviceType.CUDA]
    else:  # CPU: the operators' own time stands in for kernels
        kernels = [
            (e.key, float(e.self_cpu_time_total), e.count) for e in averages if e.key.startswith("aten::")
        ]
    kernels = [k for k in kernels if k[1] > 0]
    total_us = sum(us for _, us, _ in kernels)
    by_kind: dict[str, float] = defaultdict(float)
    for name, us, _ in kernels:
        by_kind[kind_of(name)] += us
    syncs = Counter()
    sync_us: dict[str, float] = defaultdict(float)
    for e in averages:
        if e.key in SYNC_NAMES:
            syncs[e.key] += e.count
            sync_us[e.key] += float(e.cpu_time_total)
    top = sorted(kernels, key=lambda k: -k[1])[:25]
    # The host's own time by operator (self CPU time): where a host-bound call spends its seconds.
    host = sorted(
        ((e.key, float(e.self_cpu_time_total), e.count) for e in averages if e.device_type == DeviceType.CPU),
        key=lambda k: -k[1],
    )[:25]
    return {
        "wall_s": wall_s,
        "kernel_s": total_us / 1e6,
        "busy_share": total_us / 1e6 / wall_s if wall_s else None,
        "by_kind_s": {k: v / 1e6 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n[:160], "s": us / 1e6, "count": c, "kind": kind_of(n)} for n, us, c in top],
        "host_syncs": {k: {"count": syncs[k], "s": sync_us[k] / 1e6} for k in syncs},
        "host_top": [{"name": n[:160], "s": us / 1e6, "count": c} for n, us, c in host],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tandem.megatron.config import WorkerConfig
    from tandem.megatron.models import rope, swiglu, unwrap_model
    from tandem.megatron.worker import TrainWorker
    from tandem.megatron.worker.parallel import free_port

    work = args.workdir or Path(tempfile.mkdtemp(prefix="train-profile-"))
    if args.shape is not None and not (args.quick or args.tiny):
        shape = single.SHAPES[args.shape]
        hf = work / f"policy-{args.shape}"
        params = single.build_policy(hf, shape, dtype="bfloat16", seed=args.seed)
    else:
        shape = single.QUICK_PROBE_MODEL if args.quick or args.tiny else single.PROBE_MODEL
        hf = work / "probe-hf"
        params = single.build_probe_model(hf, shape, seq_len=args.seq_len)
    on_gpu = not args.quick
    config = WorkerConfig(
        hf_checkpoint=str(hf),
        rollout_batch_size=args.samples,
        n_samples_per_prompt=1,
        global_batch_size=args.samples,
        micro_batch_size=args.micro_batch_size,
        log_probs_micro_batch_size=args.log_probs_micro_batch_size,
        device="cuda" if on_gpu else "cpu",
        params_dtype="bfloat16" if on_gpu else "float32",
        offload_backend="pinned_host",
        lr=1e-6,
        seed=args.seed,
        use_sequence_packing=args.packed,
        packed_attention=args.packed_attention,
        fused_rope=args.fused_rope,
        log_probs_chunk_tokens=args.log_probs_chunk_tokens,
        fused_log_probs=args.fused_log_probs,
        head_at_responses=args.head_at_responses,
        jit_fusions=args.jit_fusions,
        fused_swiglu=args.fused_swiglu,
    )
    report: dict[str, Any] = {
        "bench": "train_profile",
        "command": "python3 bench/train_profile.py " + " ".join(sys.argv[1:]),
        "gpu": single.gpu_name() if on_gpu else None,
        "torch": torch.__version__,
        "shape": {**shape, "seq_len": args.seq_len},
        "params": params,
        "samples_per_train": args.samples,
        "micro_batch_size": args.micro_batch_size,
        "log_probs_micro_batch_size": config.forward_micro_batch_size,
        "packed": args.packed,
        "packed_attention": args.packed_attention,
        "varied_lengths": args.varied_lengths,
        "log_probs_chunk_tokens": args.log_probs_chunk_tokens,
        "fused_log_probs_flag": args.fused_log_probs,
        "head_at_responses": args.head_at_responses,
        "jit_fusions": args.jit_fusions,
        "fused_swiglu_flag": args.fused_swiglu,
        "fused_rope_flag": args.fused_rope,
        "rope_kernels": args.rope_kernels,
    }
    if args.sdpa_cudnn:
        from tandem.megatron.models.attention import allow_cudnn_attention

        allow_cudnn_attention(True)
    report["sdpa_cudnn"] = args.sdpa_cudnn
    report["role"] = args.role
    rope.KERNELS = args.rope_kernels
    worker = TrainWorker(0, 1)
    t0 = time.time()
    worker.init(config, args.role, "127.0.0.1", free_port())
    report["init_s"] = time.time() - t0
    # What the built model runs (the flag's None means auto: on with CUDA).
    assert worker._trainee is not None
    model_config = unwrap_model(worker._trainee.chunks).config
    report["fused_rope"] = model_config.apply_rope_fusion
    report["fused_swiglu"] = model_config.bias_activation_fusion and swiglu.installed()
    # The smallest MLP input the kernels took (smaller calls ran eager): `swiglu.MIN_ELEMENTS` under None.
    report["swiglu_min_elements"] = swiglu._min_elements if report["fused_swiglu"] else None

    def batch_of(seed: int) -> Any:
        return single.make_probe_batch(
            args.samples, args.seq_len, args.prompt_len, shape["vocab_size"], seed, varied=args.varied_lengths
        )

    # Fixed lengths: one batch throughout. Varied: a new draw of lengths for every call (as every
    # PPO step brings), each call's tokens counted.
    calls = 2 * args.iters + 2
    batches = [batch_of(i) for i in range(calls)] if args.varied_lengths else [batch_of(0)] * calls
    tokens_of = [sum(int(t.numel()) for t in b.tokens) for b in batches]
    batch = batches[0]
    tokens = statistics.median(tokens_of)

    def timed(call: Any, what: str = "") -> float:
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        if on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        if what:
            print(f"[train_profile] {what}: {seconds:.2f} s", flush=True)
        return seconds

    def role_forward(rollout_id: int, data: Any) -> Any:
        """The role's forward pass alone: the actor's old log-probs, the critic's old values."""
        if args.role == "actor":
            return worker.compute_log_probs(rollout_id, data)
        from tandem.megatron.worker.forward import forward_only

        cfg = worker._trainee.config
        return forward_only(
            worker._trainee.chunks,
            data,
            role="critic",
            micro_batch_size=cfg.forward_micro_batch_size,
            packed=cfg.use_sequence_packing,
            max_tokens=cfg.micro_batch_tokens(forward_only=True),
        )

    report["warmup_train_s"] = timed(lambda: worker.train(0, batch), "warm-up train()")
    timed(lambda: role_forward(0, batch), "warm-up forward")
    train_s = [timed(lambda i=i: worker.train(i + 1, batches[1 + i]), "train()") for i in range(args.iters)]
    forward_s = [
        timed(lambda i=i: role_forward(i + 1, batches[1 + args.iters + i]), f"{args.role} forward")
        for i in range(args.iters)
    ]
    report["tokens_per_call"] = tokens_of
    train, forward = statistics.median(train_s), statistics.median(forward_s)
    peak = single.H200_BF16_PEAK_FLOPS
    report.update(
        {
            "tokens_per_train": tokens,
            "train_s": train_s,
            "log_prob_forward_s": forward_s,
            "tokens_per_s_train": tokens / train,
            "mfu_train_6n": 6 * params * tokens / train / peak,
            "mfu_train_8n": 8 * params * tokens / train / peak,
            "mfu_forward_2n": 2 * params * tokens / forward / peak,
            "peak_flops": peak,
            **update_figures(train_s, forward_s, tokens=tokens, params=params, peak=peak),
        }
    )
    if on_gpu:
        report["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 1024**3
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            wall = timed(lambda: worker.train(args.iters + 1, batches[-1]))
        report["profile"] = summarize_profile(prof, wall, on_gpu=on_gpu)
        if args.profile_forward:
            with profile(activities=activities) as prof:
                wall = timed(lambda: role_forward(args.iters + 2, batches[-1]))
            report["profile_forward"] = summarize_profile(prof, wall, on_gpu=on_gpu)
    if args.cprofile:
        report["cprofile"] = python_profile(lambda: worker.train(args.iters + 3, batches[-1]))
    worker.shutdown()
    return report


def python_profile(call: Any, top: int = 30) -> dict[str, Any]:
    """One call under cProfile: the Python functions with the most own time, and the most time below them."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.runcall(call)
    wall = time.perf_counter() - t
    stats = pstats.Stats(profiler)
    rows = [
        {"function": f"{Path(file).name}:{line}({name})", "calls": nc, "own_s": tt, "total_s": ct}
        for (file, line, name), (_, nc, tt, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    return {
        "wall_s": wall,
        "by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
        "by_total": sorted(rows, key=lambda r: -r["total_s"])[:top],
    }


def update_figures(
    train_s: list[float], forward_s: list[float], *, tokens: float, params: int, peak: float
) -> dict[str, Any]:
    """The update's seconds (fastest `train()` less fastest forward), tokens/s and MFU; null where not positive."""
    update = min(train_s) - min(forward_s)
    if update <= 0:
        return {
            "update_s": None,
            "tokens_per_s_update": None,
            "mfu_update_6n": None,
            "update_unmeasured": (
                f"the fastest train() ({min(train_s):.3f} s) was not slower than the fastest forward "
                f"({min(forward_s):.3f} s); run more --iters"
            ),
        }
    return {
        "update_s": update,
        "tokens_per_s_update": tokens / update,
        "mfu_update_6n": 6 * params * tokens / update / peak,
    }


def print_summary(r: dict[str, Any]) -> None:
    print(
        f"\n{r['params'] / 1e9:.2f} B params, {r['samples_per_train']} x {r['shape']['seq_len']} tokens a train(), "
        f"micro batch {r['micro_batch_size']}{', packed' if r['packed'] else ''}, "
        f"fused RoPE {'on' if r['fused_rope'] else 'off'}, SwiGLU kernels {'on' if r['fused_swiglu'] else 'off'}; {r.get('gpu')}, torch {r['torch']}"
    )
    print(
        f"train() {statistics.median(r['train_s']):.2f} s ({r['tokens_per_s_train']:.0f} tokens/s, "
        f"MFU {r['mfu_train_6n']:.1%} 6N, {r['mfu_train_8n']:.1%} 8N); log-prob forward "
        f"{statistics.median(r['log_prob_forward_s']):.2f} s (MFU {r['mfu_forward_2n']:.1%} 2N); "
        + (
            f"update {r['update_s']:.2f} s ({r['tokens_per_s_update']:.0f} tokens/s, MFU {r['mfu_update_6n']:.1%} 6N)"
            if r["update_s"] is not None
            else f"update not measured: {r['update_unmeasured']}"
        )
    )
    for what, prof in (("train()", r.get("profile")), ("forward", r.get("profile_forward"))):
        if prof:
            print_profile(what, prof)
    if r.get("cprofile"):
        c = r["cprofile"]
        print(
            f"\ntrain() under cProfile: {c['wall_s']:.2f} s\n\n| function | calls | own s | total s |\n|---|---:|---:|---:|"
        )
        for row in c["by_own"][:20]:
            print(
                f"| `{row['function'][:80]}` | {row['calls']} | {row['own_s']:.3f} | {row['total_s']:.3f} |"
            )
    print(f"\ncommand: {r['command']}")


def print_profile(what: str, prof: dict[str, Any]) -> None:
    """One profiled call: kernel time by kind, the top kernels, host syncs and host operators."""
    print(
        f"\nprofiled {what}: wall {prof['wall_s']:.2f} s, kernels {prof['kernel_s']:.2f} s "
        f"(busy {prof['busy_share']:.0%})\n\n| kind | s | share of kernel time |\n|---|---:|---:|"
    )
    for kind, s in prof["by_kind_s"].items():
        print(f"| {kind} | {s:.3f} | {s / prof['kernel_s']:.1%} |")
    print("\n| top kernel | kind | s | calls |\n|---|---|---:|---:|")
    for k in prof["top"][:15]:
        print(f"| `{k['name'][:90]}` | {k['kind']} | {k['s']:.3f} | {k['count']} |")
    print(f"\nhost syncs: {prof['host_syncs']}")
    print("\n| top host operator | self s | calls |\n|---|---:|---:|")
    for k in prof["host_top"][:12]:
        print(f"| `{k['name'][:90]}` | {k['s']:.3f} | {k['count']} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, fp32, gloo")
    p.add_argument("--tiny", action="store_true", help="the tiny model on the GPU (the host-sync test)")
    p.add_argument(
        "--shape",
        choices=sorted(single.SHAPES),
        default=None,
        help="one of the PPO bench's shapes (random weights) instead of the 1.2 B probe",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (2048; --quick 64)")
    p.add_argument("--prompt-len", type=int, default=None, help="of which prompt (128; --quick 16)")
    p.add_argument("--samples", type=int, default=None, help="sequences a train() (64; --quick 8)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument(
        "--log-probs-micro-batch-size",
        type=int,
        default=None,
        help="WorkerConfig.log_probs_micro_batch_size: samples a forward-only pass (default: twice the micro batch)",
    )
    p.add_argument("--packed", action="store_true", help="use_sequence_packing")
    p.add_argument(
        "--packed-attention",
        choices=["auto", "blocks", "varlen"],
        default="auto",
        help="WorkerConfig.packed_attention with --packed: a call per sample, one varlen flash call a layer, or "
        "auto (varlen where it runs: CUDA, bf16/fp16)",
    )
    p.add_argument(
        "--log-probs-chunk-tokens",
        type=int,
        default=0,
        help="WorkerConfig.log_probs_chunk_tokens (0: the whole micro-batch's logits at once)",
    )
    p.add_argument(
        "--fused-log-probs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="WorkerConfig.fused_log_probs (the Triton log-prob kernels); default: on with CUDA",
    )
    p.add_argument(
        "--head-at-responses",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="WorkerConfig.head_at_responses: the actor's vocabulary head at the response positions "
        "alone (--no-head-at-responses: over every position, the A/B's reference)",
    )
    p.add_argument(
        "--jit-fusions",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="WorkerConfig.jit_fusions: Megatron's torch.compile'd SwiGLU and residual add",
    )
    p.add_argument(
        "--fused-swiglu",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="WorkerConfig.fused_swiglu: the MLP's SwiGLU as one Triton kernel forward and one backward "
        "or Megatron's eager one; default: on with CUDA, for calls of at least swiglu.MIN_ELEMENTS (smaller eager)",
    )
    p.add_argument(
        "--sdpa-cudnn",
        action="store_true",
        help="let attention use cuDNN's kernel (models/attention.py leaves it out by default)",
    )
    p.add_argument(
        "--varied-lengths",
        action="store_true",
        help="responses of uniformly drawn lengths, a new draw for every call (as PPO steps bring)",
    )
    p.add_argument(
        "--fused-rope",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RoPE through our compiled kernels (rope.py) or Megatron's unfused one; default: on with CUDA",
    )
    p.add_argument(
        "--rope-kernels",
        choices=("auto", "triton", "compiled"),
        default="auto",
        help="rope.KERNELS: our RoPE's kernels where it is on (auto: Triton on CUDA)",
    )
    p.add_argument("--iters", type=int, default=3, help="timed calls of each (after one warm-up train())")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled train()")
    p.add_argument(
        "--profile-forward", action="store_true", help="also profile one forward pass (the role's, below)"
    )
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="one more train() under cProfile (the host's Python functions)",
    )
    p.add_argument(
        "--role",
        choices=("actor", "critic"),
        default="actor",
        help="the worker's role; its forward is the actor's old log-probs or the critic's old values",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None, help="the probe model's folder's parent (reused)")
    args = p.parse_args(argv)
    for name, full, small in (("seq_len", 2048, 64), ("prompt_len", 128, 16), ("samples", 64, 8)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick or args.tiny else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
