"""Rollout-engine benchmark: the embedded engine's decode speed next to plain `transformers` generate.

For each model shape (random weights, ~0.5 B Qwen2-shaped and ~1 B Llama-shaped) and
batch size, all from one run:

1. decode tokens/s of the embedded engine (`EmbeddedEngine.generate`, the second call
   of the same work: CUDA graphs captured, caches warm), and of plain
   `model.generate` on the same prompts;
2. the memory-bandwidth bound: weight bytes ÷ the measured device-copy bandwidth per
   decode step, and the same bound with the KV cache's average bytes per step added;
3. `release_memory()` / `resume_memory()` seconds and the GPU memory held asleep;
4. weight-sync seconds (`update_weights_from_tensors` of the whole model: CUDA tensors
   of this process, and CPU tensors) next to a device copy of the same bytes
   (goal, docs/design.md: ≤ 2× that copy + 0.1 s).

Prompts are `--prompt-len` random tokens, responses exactly `--new-tokens` tokens
(`ignore_eos`: random weights would stop anywhere). Decode tokens/s counts generated
tokens over the whole call, prefill included. Prints one JSON object.

GPU host, from the repo root:

    source .gpu-kit/setup.sh && python3 bench/engine_bench.py --out engine-bench.json

The engine decodes with the fused step where it applies (`--no-fused-decode`: transformers'
step); `--ab-decode` times the other path too, from a second engine on the same prompts and
seed (each row's `ab`: ms a step of each, whole call and decode only, and their greedy
tokens' agreement):

    python3 bench/engine_bench.py --shapes qwen2-0.5b --batches 256 --skip-hf --ab-decode

`--ab-sampler` times the fused step's sampler alone at each batch, on random logits of the
shape's vocabulary: one program a row against the vocabulary split over programs (the
default), with the tokens of the two compared (`sampler_ab` in each row); and its attention
alone at the generate's average position, for 1, 2, 4 and 8 splits of the keys (`attention_ab`).

CPU smoke run (tests/ppo/engines/test_bench_smoke.py runs it):

    python bench/engine_bench.py --quick --out /tmp/engine-bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's shape.
    "qwen2-0.5b": {
        "family": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # Llama-3.2-1B's shape.
    "llama-1b": {
        "family": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "family": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "tie_word_embeddings": False,
    },
}


def import_engines() -> types.ModuleType:
    """`tandem.ppo.engines`, also where the driver's other dependencies (tyro, ...) are missing."""
    for src in sorted((REPO / "packages").glob("*/src")):
        if str(src) not in sys.path:
            sys.path.append(str(src))
    try:
        return importlib.import_module("tandem.ppo.engines")
    except ImportError:
        # The GPU host lacks the CLI's packages: load the engines subpackage without tandem.ppo's __init__.
        pkg = types.ModuleType("tandem.ppo")
        pkg.__path__ = [str(REPO / "packages/ppo-driver/src/tandem/ppo")]
        sys.modules["tandem.ppo"] = pkg
        return importlib.import_module("tandem.ppo.engines")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: str, device: torch.device, dtype: torch.dtype, folder: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    spec.update(max_position_embeddings=4096, eos_token_id=1, bos_token_id=0, pad_token_id=0)
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config_cls(**spec)).to(dtype).eval()
    model.save_pretrained(str(folder))
    return model


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (best of 5)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * nbytes / best


def copy_seconds(device: torch.device, tensors: list[torch.Tensor]) -> float:
    """Seconds to copy `tensors` into fresh buffers on `device` (one copy each, best of 3)."""
    dsts = [torch.empty_like(t, device=device) for t in tensors]
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for d, s in zip(dsts, tensors, strict=True):
            d.copy_(s, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def used_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def time_engine(
    engines: types.ModuleType, engine: Any, prompts: list[list[int]], params: Any, device: torch.device
) -> dict[str, Any]:
    """One engine's decode timings: the first call (graph captures, compilations) and the second, whose
    prefill (a call of one new token) is subtracted for the decode-only ms a step."""
    sync(device)
    t0 = time.perf_counter()
    gens = engine.generate(prompts, params)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gens = engine.generate(prompts, params)
    engine_s = time.perf_counter() - t0
    assert all(len(x.token_ids) == params.max_new_tokens for x in gens)
    one = engines.SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True, seed=1)
    engine.generate(prompts, one)
    t0 = time.perf_counter()
    engine.generate(prompts, one)
    prefill_s = time.perf_counter() - t0
    steps = params.max_new_tokens
    return {
        "engine_first_call_s": first_s,
        "engine_s": engine_s,
        "engine_tokens_per_s": len(prompts) * steps / engine_s,
        "engine_ms_per_step": 1000 * engine_s / steps,
        "engine_prefill_s": prefill_s,
        "engine_decode_ms_per_step": 1000 * (engine_s - prefill_s) / max(1, steps - 1),
    }


def greedy_agreement(engines: types.ModuleType, a: Any, b: Any, prompts: list[list[int]]) -> float:
    """The share of equal tokens between two engines' greedy responses (32 tokens) to `prompts`."""
    params = engines.SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    pairs = [
        (x, y)
        for ga, gb in zip(a.generate(prompts, params), b.generate(prompts, params), strict=True)
        for x, y in zip(ga.token_ids, gb.token_ids, strict=True)
    ]
    return sum(x == y for x, y in pairs) / len(pairs)


def bench_decode(
    engines: types.ModuleType,
    engine: Any,
    model: Any,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    other_engine: Any = None,
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    prompts = torch.randint(2, vocab, (batch, args.prompt_len), generator=g).tolist()
    params = engines.SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=1)
    row: dict[str, Any] = {"batch": batch, **time_engine(engines, engine, prompts, params, device)}
    if other_engine is not None:
        # The A/B: the same prompts and seed through the other decode path, timed the same way.
        other = time_engine(engines, other_engine, prompts, params, device)
        fused, plain = (row, other) if engine._fused is not None else (other, row)
        row["ab"] = {
            "paths_differ": (engine._fused is None) != (other_engine._fused is None),  # False on CPU
            "fused_ms_per_step": fused["engine_ms_per_step"],
            "transformers_ms_per_step": plain["engine_ms_per_step"],
            "fused_decode_ms_per_step": fused["engine_decode_ms_per_step"],
            "transformers_decode_ms_per_step": plain["engine_decode_ms_per_step"],
            "decode_speedup": plain["engine_decode_ms_per_step"] / fused["engine_decode_ms_per_step"],
            "fused_first_call_s": fused["engine_first_call_s"],
            "transformers_first_call_s": plain["engine_first_call_s"],
            "greedy_token_agreement": greedy_agreement(engines, engine, other_engine, prompts[:64]),
        }
        print(json.dumps({"batch": batch, "ab": row["ab"]}), flush=True)
    if args.profile:
        # One more call of the same work under torch.profiler: the GPU's kernel time by kind.
        from torch.profiler import ProfilerActivity, profile
        from train_profile import print_profile, summarize_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            sync(device)
            wall = time.perf_counter() - t0
        row["profile"] = summarize_profile(prof, wall, on_gpu=device.type == "cuda")
        print_profile(f"generate (batch {batch})", row["profile"])
    if not args.skip_hf:
        hf_new = args.hf_new_tokens or args.new_tokens
        ids = torch.tensor(prompts, device=device)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=2, do_sample=True, pad_token_id=0
            )  # warm-up
            sync(device)
            t0 = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=hf_new,
                min_new_tokens=hf_new,
                do_sample=True,
                top_k=0,
                pad_token_id=0,
            )
            sync(device)
            hf_s = time.perf_counter() - t0
        assert out.shape[1] == args.prompt_len + hf_new
        row.update(
            hf_new_tokens=hf_new,
            hf_s=hf_s,
            hf_tokens_per_s=batch * hf_new / hf_s,
            hf_ms_per_step=1000 * hf_s / hf_new,
        )
        row["speedup_vs_hf"] = row["engine_tokens_per_s"] / row["hf_tokens_per_s"]
    return row


SPLIT_SAMPLER_PROGRAMS = 8
"""`--ab-sampler`'s split sampler (the default, `SAMPLE_PROGRAMS_PER_PROCESSOR`): about this many
programs a multiprocessor."""


def sampler_ab(device: torch.device, rows: int, vocab: int, iters: int = 200) -> dict[str, Any]:
    """The fused step's sampler alone, one program a row against the vocabulary split over
    programs (`TritonOps(sample_programs_per_processor=8)`, the default): ms a call (CUDA events around `iters` calls, after a warm-up), the share of the logits' read bandwidth, and
    whether both draw the same tokens (they must: the split changes where a key is compared, not
    the key)."""
    from tandem.ppo.engines._decode_kernels import TritonOps

    logits = (3 * torch.randn(rows, vocab, device=device)).to(torch.bfloat16)
    args = {
        "temperature": torch.ones(1, device=device),
        "seed": torch.tensor([7], device=device),
    }
    out: dict[str, Any] = {"rows": rows, "vocab": vocab}
    drawn = {}
    for name, programs in (("one_program_a_row", None), ("split", SPLIT_SAMPLER_PROGRAMS)):
        ops = TritonOps(device, sample_programs_per_processor=programs)
        drawn[name] = ops.sample(logits, **args)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            ops.sample(logits, **args)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
        out[name] = {
            "splits": 1 if programs is None else ops.sample_splits(rows, vocab)[0],
            "ms": ms,
            "logits_read_gbps": logits.numel() * logits.element_size() / (ms / 1e3) / 1e9,
        }
    (a_tokens, a_lp), (b_tokens, b_lp) = drawn["one_program_a_row"], drawn["split"]
    out["same_tokens"] = bool(torch.equal(a_tokens, b_tokens))
    out["max_log_prob_diff"] = float((a_lp - b_lp).abs().max())
    out["speedup"] = out["one_program_a_row"]["ms"] / out["split"]["ms"]
    print(f"sampler, {rows} x {vocab}: {json.dumps(out)}", flush=True)
    return out


def attention_ab(
    device: torch.device, rows: int, cfg: Any, length: int, pos: int, iters: int = 200
) -> dict[str, Any]:
    """The fused step's attention alone over a bf16 KV cache of `length` positions, every row at
    position `pos` (the average of a generate): ms a call for 1, 2, 4 and 8 splits of the keys
    (the default takes `TritonOps.attention_splits`), and the outputs' largest difference from 1."""
    from tandem.ppo.engines._decode_kernels import TritonOps

    ops = TritonOps(device)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    q = torch.randn(rows, heads, head_dim, device=device, dtype=torch.bfloat16)
    keys = torch.randn(rows, kv_heads, length, head_dim, device=device, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    kw = {
        "start": torch.zeros(rows, dtype=torch.int64, device=device),
        "pos": torch.tensor([pos], device=device),
        "scale": head_dim**-0.5,
    }
    out: dict[str, Any] = {"rows": rows, "pos": pos, "default_splits": ops.attention_splits(rows, kv_heads)}
    first = ops.attention(q, keys, values, splits=1, **kw)
    kv_bytes = 2 * rows * kv_heads * (pos + 1) * head_dim * 2
    for splits in (1, 2, 4, 8):
        got = ops.attention(q, keys, values, splits=splits, **kw)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            ops.attention(q, keys, values, splits=splits, **kw)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
        out[f"splits_{splits}"] = {
            "ms": ms,
            "kv_read_gbps": kv_bytes / (ms / 1e3) / 1e9,
            "max_diff_from_1": float((got.float() - first.float()).abs().max()),
        }
    print(f"attention, {rows} rows at {pos}: {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU, a few tokens (smoke run)")
    parser.add_argument("--shapes", default="qwen2-0.5b,llama-1b")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument(
        "--hf-new-tokens", type=int, default=0, help="new tokens of the HF baseline (0: same)"
    )
    parser.add_argument("--skip-hf", action="store_true", help="no plain transformers generate")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EngineOptions.fused_decode of the engine measured (default on)",
    )
    parser.add_argument(
        "--ab-decode",
        action="store_true",
        help="also time the other decode path (--no-fused-decode's, or the fused one) on the same prompts "
        "and seed, from a second engine: `ab` in each row (ms a step of each, the decode speedup, greedy "
        "token agreement)",
    )
    parser.add_argument(
        "--ab-sampler",
        action="store_true",
        help="also time the fused step's sampler alone (CUDA): one program a row against "
        "the vocabulary split over programs (the default), on random logits of each batch (`sampler_ab` in each row)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="EngineOptions.compile (torch.compile the decode step)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile one more generate a row (kernel time by kind)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.batches, args.prompt_len, args.new_tokens = "tiny", "4,8", 8, 6

    engines = import_engines()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "copy_bandwidth_gbps": copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
        / 1e9,
        "models": [],
    }
    bandwidth = report["copy_bandwidth_gbps"] * 1e9
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model = build_model(shape, device, dtype, Path(tmp))
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            options = engines.EngineOptions(
                device=device.type,
                cuda_graph=not args.no_cuda_graph,
                compile=args.compile,
                max_context_len=4096,
                fused_decode=args.fused_decode,
            )
            other_engine = None
            if args.ab_decode:
                other_options = dataclasses.replace(options, fused_decode=not args.fused_decode)
                other_engine = engines.EmbeddedEngine(tmp, other_options)
            allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            t0 = time.perf_counter()
            engine = engines.EmbeddedEngine(tmp, options)
            load_s = time.perf_counter() - t0
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize
        entry: dict[str, Any] = {
            "shape": shape,
            "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
            "weight_gib": weight_bytes / 2**30,
            "load_s": load_s,
            "fused_decode": engine._fused is not None,
            "rows": [],
        }
        for batch in [int(b) for b in args.batches.split(",")]:
            row = bench_decode(engines, engine, model, batch, args, device, other_engine)
            avg_pos = args.prompt_len + args.new_tokens // 2
            if args.ab_sampler and device.type == "cuda":
                row["sampler_ab"] = sampler_ab(device, batch, model.config.vocab_size)
                row["attention_ab"] = attention_ab(
                    device, batch, model.config, args.prompt_len + args.new_tokens, avg_pos
                )
            avg_len = args.prompt_len + args.new_tokens / 2
            step_weights = weight_bytes / bandwidth
            step_kv = step_weights + batch * avg_len * kv_bytes_per_token / bandwidth
            row["bound_weights_tokens_per_s"] = batch / step_weights
            row["bound_weights_kv_tokens_per_s"] = batch / step_kv
            row["engine_vs_bound_weights_kv"] = (
                row["engine_tokens_per_s"] / row["bound_weights_kv_tokens_per_s"]
            )
            entry["rows"].append(row)
            print(json.dumps({"shape": shape, **row}), flush=True)

        if other_engine is not None:
            # Its KV cache and graphs would count as this engine's memory asleep below.
            other_engine.shutdown()
            other_engine = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # Release / resume.
        sync(device)
        t0 = time.perf_counter()
        engine.release_memory()
        entry["release_s"] = time.perf_counter() - t0
        if device.type == "cuda":
            # What the engine still holds in torch's allocator (this process also holds the reference model).
            entry["engine_allocated_gib_asleep"] = (
                torch.cuda.memory_allocated(device) - allocated_before
            ) / 2**30
            entry["reserved_gib_asleep"] = torch.cuda.memory_reserved(device) / 2**30
            entry["device_used_gib_asleep"] = used_gib(device)
        t0 = time.perf_counter()
        engine.resume_memory()
        sync(device)
        entry["resume_s"] = time.perf_counter() - t0

        # Weight sync: the whole model, HF-named, as device tensors and as CPU tensors.
        named = [(n, t.detach()) for n, t in model.state_dict().items()]
        device_tensors = [t for _, t in named]
        cpu_named = [(n, t.to("cpu")) for n, t in named]
        if device.type == "cuda":
            cpu_named = [(n, t.pin_memory()) for n, t in cpu_named]
        sync_bytes = sum(t.numel() * t.element_size() for t in device_tensors)
        entry["sync_gib"] = sync_bytes / 2**30
        entry["device_copy_s"] = copy_seconds(device, device_tensors)
        for label, payload in (("device_tensors", named), ("cpu_tensors", cpu_named)):
            engine.update_weights_from_tensors(payload)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            engine.update_weights_from_tensors(payload)
            sync(device)
            entry[f"sync_{label}_s"] = time.perf_counter() - t0
        entry["sync_goal_s"] = 2 * entry["device_copy_s"] + 0.1
        entry["sync_goal_met"] = entry["sync_device_tensors_s"] <= entry["sync_goal_s"]
        report["models"].append(entry)
        engine.shutdown()
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
