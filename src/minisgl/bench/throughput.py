"""GPU benchmark: the offline workload (nano-vllm's and Mini-SGLang's) on a model of a given shape with dummy weights.

    minisgl bench throughput --out out/bench.json             # everything, a table at the end
    minisgl bench throughput --shape qwen3-30b-a3b --quick --skip-hf   # the mixture-of-experts shape
    minisgl bench throughput --shape qwen3-8b --quantization fp8       # bf16 and FP8 weights side by side
    minisgl bench throughput run --model-dir D [--disable-overlap] [--disable-cuda-graph] [--latency]
    minisgl bench throughput hf --model-dir D

Workload (the nano-vllm / Mini-SGLang benchmark): random.seed(0); 256 prompts of randint(0, 10000)
ids with lengths randint(100, 1024), then randint(100, 1024) max_tokens per request; temperature
0.6, ignore_eos; one warm-up request first; only the batch is timed. Every engine configuration
runs in its own process so that each sizes its KV pool from a clean GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import time
from operator import itemgetter
from pathlib import Path
from typing import Any

from minisgl import LLM, SamplingParams, env

QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    torch_dtype="bfloat16",
    bos_token_id=1,
    eos_token_id=2,
)
QWEN3_14B = dict(
    QWEN3_06B,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)
QWEN3_8B = dict(QWEN3_14B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)
QWEN3_30B_A3B = dict(
    QWEN3_06B,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
)
SHAPES = {"qwen3-0.6b": QWEN3_06B, "qwen3-8b": QWEN3_8B, "qwen3-14b": QWEN3_14B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def workload(num: int = 256) -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num)]
    max_tokens = [random.randint(100, 1024) for _ in range(num)]
    return prompts, max_tokens


def write_model_dir(tokenizer_dir: Path, shape: str = "qwen3-0.6b") -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"{shape}-dummy-"))
    (out / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


# ---------------------------------------------------------------------------- one engine config


def run_minisgl(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # lazy: `minisgl bench --help` loads every benchmark

    t0 = time.perf_counter()
    llm = LLM(
        str(args.model_dir),
        dtype="bfloat16",
        load_format="dummy",
        max_prefill_tokens=args.max_prefill_tokens,
        page_size=args.page_size,
        disable_overlap=args.disable_overlap,
        disable_cuda_graph=args.disable_cuda_graph,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        num_pages=args.num_pages,
        speculative=args.speculative,
    )
    init_s = time.perf_counter() - t0
    if args.repeat > 1:  # the median run, every run's figure beside it
        timed_workload(llm, llm.scheduler, workload(32))
        runs = [timed_workload(llm, llm.scheduler, workload()) for _ in range(args.repeat)]
        runs.sort(key=itemgetter("output_tok_s"))
        result = {**runs[len(runs) // 2], "output_tok_s_runs": [r["output_tok_s"] for r in runs]}
    else:
        result = timed_workload(llm, llm.scheduler, workload())
    engine = llm.scheduler.engine
    page_size = llm.scheduler.page_size
    result.update(
        init_s=round(init_s, 1),
        kv_pages=llm.scheduler.cache.num_pages,
        page_size=page_size,
        kv_slots=llm.scheduler.cache.num_pages * page_size,
        decode_attention=type(getattr(engine.attn_backend, "decode", engine.attn_backend)).__name__,
    )
    if args.latency:
        result.update(latency_runs(llm, args.latency_runs))
    result["peak_gpu_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 1)  # weights, KV pool, graphs, activations
    return result


def timed_workload(llm: Any, sched: Any, work: tuple[list[list[int]], list[int]]) -> dict[str, Any]:
    """One warm-up request, then the whole workload (prompts, max_tokens) timed as one generate call, its prompts
    computed in full: the prefix cache is emptied first (a run after another would find every prompt cached).

    sched: the scheduler whose steps are counted (rank 0's own with tensor parallelism).
    """
    import torch  # lazy: `minisgl bench --help` loads every benchmark

    prompts, max_tokens = work
    llm.generate([prompts[0]], SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in max_tokens]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps0 = sched.num_steps
    with GcTimer() as gc_timer:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    assert out_tokens == sum(max_tokens), "a request stopped early"
    llm.check_integrity()
    return {
        "seconds": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1),
        "total_tok_s": round((out_tokens + sum(map(len, prompts))) / elapsed, 1),
        "output_tokens": out_tokens,
        "input_tokens": sum(map(len, prompts)),
        "steps": sched.num_steps - steps0,
        "gc_s": round(gc_timer.seconds, 3),
        "gc_full": gc_timer.full,
    }


class GcTimer:
    """Seconds Python's garbage collector ran inside the block, its collections by generation, its full
    (oldest-generation) ones and every pause over 10 ms: a full collection walks every live object (~0.3 s each
    in an engine process on an H100 host), and the loop that feeds the GPU stops meanwhile."""

    def __init__(self) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        self.collections = {0: 0, 1: 0, 2: 0}
        self.pauses_ms: list[float] = []

    @property
    def full(self) -> int:
        return self.collections[2]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.seconds += took
        self.collections[info["generation"]] += 1
        if took > 0.01:
            self.pauses_ms.append(round(took * 1000, 1))

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def decode_latency(llm: Any, run: int = 0) -> dict[str, Any]:
    """Batch 1: ms per output token from the difference of a 513- and a 1-token request, and TTFT (the 1-token
    request's time); best of 3 each. Every request is a fresh 128-token prompt (none of its prefix cached), so TTFT
    is a 128-token prefill; `run` picks prompts no earlier run used."""
    rng = random.Random(1000 + run)

    def timed(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            prompt = [rng.randint(0, 10000) for _ in range(128)]
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        return best

    short, long_ = timed(1), timed(513)
    return {"decode_ms_per_token_bs1": round((long_ - short) / 512 * 1000, 3), "ttft_ms_bs1": round(short * 1000, 2)}


def latency_runs(llm: Any, runs: int) -> dict[str, Any]:
    """decode_latency `runs` times in a row: the median of each figure, and every run's beside it."""
    measured = [decode_latency(llm, run) for run in range(runs)]
    result: dict[str, Any] = {}
    for key in measured[0]:
        values = sorted(m[key] for m in measured)
        result[key] = values[len(values) // 2]
        if runs > 1:
            result[f"{key}_runs"] = [m[key] for m in measured]
    return result


def run_hf(args: argparse.Namespace) -> dict[str, Any]:
    """HF transformers generate (SDPA, bf16) in static left-padded batches over the first requests."""
    import torch  # lazy: `minisgl bench --help` loads every benchmark
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers' import takes seconds

    config = AutoConfig.from_pretrained(args.model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    prompts, max_tokens = workload()
    prompts, max_tokens = prompts[: args.hf_requests], max_tokens[: args.hf_requests]
    kw = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
    elapsed, useful = 0.0, 0
    with torch.inference_mode():
        warm = torch.tensor([prompts[0][:32]], device="cuda")
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=8, **kw)
        for start in range(0, len(prompts), args.hf_batch):
            batch, lens = prompts[start : start + args.hf_batch], max_tokens[start : start + args.hf_batch]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens), **kw)
            torch.cuda.synchronize()
            elapsed += time.perf_counter() - t0
            useful += sum(lens)  # a static batch computes max(lens) for everyone; only these are wanted
    return {
        "seconds": round(elapsed, 3),
        "output_tok_s": round(useful / elapsed, 1),
        "requests": len(prompts),
        "batch": args.hf_batch,
    }


# ---------------------------------------------------------------------------- the floor


def hbm_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), over a 4 GiB buffer."""
    import torch  # lazy: `minisgl bench --help` loads every benchmark

    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    torch.cuda.empty_cache()  # the engines run in child processes and size their KV pools from free memory
    return 2 * n * 20 / seconds


def bandwidth_floor(bandwidth: float, c: dict[str, Any] = QWEN3_06B, fp8: bool = False) -> dict[str, Any]:
    """Seconds the decode steps of the workload need at least: the bytes every step must read (the dense weights,
    the expert weights its batch routes to, the KV of every running request) over the HBM bandwidth. fp8: the
    layers' linears and the experts in one byte a weight (the LM head, norms and routers stay bf16)."""
    wb = 1 if fp8 else 2
    kv_per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    experts, top_k = c.get("num_experts", 0), c.get("num_experts_per_tok", 0)
    mlp = 0 if experts else 3 * h * c["intermediate_size"]
    linear = h * (q + 2 * kv) + q * h + mlp
    per_layer = 2 * h + 2 * c["head_dim"] + h * experts  # norms, router (h * experts)
    dense_bytes = wb * layers * linear + 2 * (layers * per_layer + c["vocab_size"] * h + h)  # LM head, final norm
    expert_bytes = wb * 3 * h * c.get("moe_intermediate_size", 0) * layers  # one expert of every layer
    prompts, max_tokens = workload()
    # decode step j (1..o-1) of a request reads the KV of its prompt and j generated tokens
    kv_tokens = sum((o - 1) * len(p) + (o - 1) * o // 2 for p, o in zip(prompts, max_tokens))
    decode_steps = max(max_tokens) - 1  # all 256 requests decode together
    # A step with b requests touches E (1 - (1 - k/E)^b) experts of a layer on average (uniform routing).
    running = [sum(o - 1 > j for o in max_tokens) for j in range(decode_steps)]
    touched = sum(experts * (1 - (1 - top_k / experts) ** b) for b in running) if experts else 0.0
    total = kv_tokens * kv_per_token + decode_steps * dense_bytes + touched * expert_bytes
    seconds = total / bandwidth
    floor = {
        "hbm_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "kv_bytes_read_tb": round(kv_tokens * kv_per_token / 1e12, 2),
        "weight_bytes_per_step_gb": round(dense_bytes / 1e9, 3),
        "decode_steps": decode_steps,
        "floor_seconds": round(seconds, 3),
        "floor_output_tok_s": round(sum(max_tokens) / seconds, 1),
    }
    if experts:
        at_full = experts * (1 - (1 - top_k / experts) ** len(max_tokens))
        floor.update(
            expert_bytes_per_step_gb_at_256=round(at_full * expert_bytes / 1e9, 3),
            expert_bytes_all_gb=round(experts * expert_bytes / 1e9, 3),
            expert_bytes_read_tb=round(touched * expert_bytes / 1e12, 2),
        )
    return floor


# ---------------------------------------------------------------------------- orchestration


def sub(model_dir: Path, *extra: str, timeout: int = 300) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "minisgl", "bench", "throughput", *extra, "--model-dir", str(model_dir)]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    sys.stdout.write(proc.stdout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"exit {proc.returncode}"}


def main_all(args: argparse.Namespace) -> None:
    import torch  # lazy: `minisgl bench --help` loads every benchmark

    model_dir = write_model_dir(Path(args.tokenizer_dir), args.shape)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "shape": args.shape,
        "max_prefill_tokens": args.max_prefill_tokens,
    }
    bandwidth = hbm_bandwidth()
    results["floor"] = bandwidth_floor(bandwidth, SHAPES[args.shape])
    common = ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    common += ["--num-pages", str(args.num_pages)] if args.num_pages else []
    common += ["--latency-runs", str(args.latency_runs), "--repeat", str(args.repeat)]
    if not args.fp8_only:
        results["minisgl"] = sub(model_dir, "run", "--latency", *common)
    if not args.quick:
        results["no_overlap"] = sub(model_dir, "run", "--disable-overlap", *common)
        results["no_cuda_graph"] = sub(model_dir, "run", "--disable-cuda-graph", *common)
    if args.with_fp8_kv:  # its own row: an fp8 KV cache changes the numerics (tests/test_gpu.py scores them)
        # pages of 16 tokens: on Hopper the decode runs XQA's fp8 kernel (attention/xqa.py), FlashInfer's elsewhere
        results["fp8_kv"] = sub(
            model_dir, "run", "--latency", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "16", *common
        )
    if (
        args.with_fp8 or args.fp8_only or args.quantization == "fp8"
    ):  # FP8 weights: their own floor (half the linears' bytes)
        results["fp8"] = sub(model_dir, "run", "--latency", "--quantization", "fp8", *common)
        results["fp8"]["floor"] = bandwidth_floor(bandwidth, SHAPES[args.shape], fp8=True)
    if not args.skip_hf:
        results["hf"] = sub(model_dir, "hf", "--hf-batch", str(args.hf_batch), "--hf-requests", str(args.hf_requests))
    if args.report and Path(args.report).exists():
        results["tests"] = json.loads(Path(args.report).read_text())
    Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(r: dict[str, Any]) -> None:
    floor = r["floor"]["floor_output_tok_s"]
    main = r.get("minisgl", {})
    shape = r.get("shape", "qwen3-0.6b")
    print(f"\n## {r['gpu']}, {r['date']}, {shape}-shaped dummy bf16, 256 requests (the offline workload)")
    print(f"{'configuration':40s} {'output tok/s':>14s} {'seconds':>9s} {'of floor':>9s}")
    for key, name in (
        ("minisgl", "minisgl (overlap + CUDA graphs)"),
        ("no_overlap", "  --disable-overlap"),
        ("no_cuda_graph", "  --disable-cuda-graph"),
        ("fp8_kv", "  --kv-cache-dtype fp8_e4m3 --page-size 16"),
        ("fp8", "  --quantization fp8 (FP8 weights)"),
        ("hf", "HF generate (SDPA, static batches)"),
    ):
        if key in r and "output_tok_s" in r[key]:
            tps = r[key]["output_tok_s"]
            print(f"{name:40s} {tps:14.1f} {r[key]['seconds']:9.2f} {tps / floor:9.1%}")
            if "output_tok_s_runs" in r[key]:
                print(f"  runs (the median above): {r[key]['output_tok_s_runs']} tok/s")
        elif key in r:
            print(f"{name:40s} {r[key]}")
    print(f"{'bandwidth floor (decode KV + weights)':40s} {floor:14.1f} {r['floor']['floor_seconds']:9.2f}")
    if "expert_bytes_all_gb" in r["floor"]:
        f = r["floor"]
        print(
            f"MoE floor: experts touched per decode step {f['expert_bytes_per_step_gb_at_256']} GB at batch 256 "
            f"(all experts {f['expert_bytes_all_gb']} GB; {f['expert_bytes_read_tb']} TB over the decode), dense "
            f"weights {f['weight_bytes_per_step_gb']} GB per step, KV {f['kv_bytes_read_tb']} TB"
        )
    if "decode_ms_per_token_bs1" in r.get("fp8_kv", {}):
        print(
            f"fp8 KV cache: batch-1 decode {r['fp8_kv']['decode_ms_per_token_bs1']} ms/token, "
            f"{r['fp8_kv'].get('kv_slots')} KV slots (bf16: {main.get('kv_slots')}), decode attention "
            f"{r['fp8_kv'].get('decode_attention')}"
        )
    if "decode_ms_per_token_bs1" in r.get("fp8", {}):
        f8, floor8 = r["fp8"], r["fp8"]["floor"]["floor_output_tok_s"]
        print(
            f"FP8 weights: {f8['output_tok_s'] / floor8:.1%} of their own floor ({floor8} tok/s); batch-1 decode "
            f"{f8['decode_ms_per_token_bs1']} ms/token; peak GPU memory {f8.get('peak_gpu_gb')} GB"
        )
        if "decode_ms_per_token_bs1" in main:
            speed, bs1 = (
                f8["output_tok_s"] / main["output_tok_s"],
                main["decode_ms_per_token_bs1"] / f8["decode_ms_per_token_bs1"],
            )
            print(f"FP8 weights against bf16: throughput {speed:.2f}x, batch-1 decode {bs1:.2f}x")
    if "decode_ms_per_token_bs1" in main:
        print(f"decode latency, batch 1: {main['decode_ms_per_token_bs1']} ms/token (TTFT {main['ttft_ms_bs1']} ms)")
        if "decode_ms_per_token_bs1_runs" in main:
            print(f"  runs: {main['decode_ms_per_token_bs1_runs']} ms/token, TTFT {main['ttft_ms_bs1_runs']} ms")
    if "hf" in r and "output_tok_s" in r["hf"] and "output_tok_s" in main:
        print(
            f"speed-up vs HF generate: {main['output_tok_s'] / r['hf']['output_tok_s']:.1f}x "
            f"(HF: {r['hf']['requests']} requests in batches of {r['hf']['batch']})"
        )
    print(
        f"HBM copy bandwidth {r['floor']['hbm_bandwidth_gb_s']} GB/s; KV read {r['floor']['kv_bytes_read_tb']} TB "
        f"over {r['floor']['decode_steps']} decode steps"
    )
    for k, v in r.get("tests", {}).items():
        print(f"test: {k} = {v}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", nargs="?", default="all", choices=["all", "run", "hf"])
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES), help="all: the dummy model's shape")
    p.add_argument("--tokenizer-dir", default=str(env.TOKENIZER_DIR.get() or "tok"))
    p.add_argument("--out", default="bench.json")
    p.add_argument("--report", default=env.GPU_REPORT.get())
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=None, help="default: 16 with FlashInfer on a GPU, else 1")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", help="run: auto (bf16) or fp8_e4m3 / fp8_e5m2")
    p.add_argument("--with-fp8-kv", action="store_true", help="all: one more row with an fp8_e4m3 KV cache")
    p.add_argument("--with-fp8", action="store_true", help="all: one more row with FP8 weights (--quantization fp8)")
    p.add_argument("--fp8-only", action="store_true", help="all: the FP8-weights row alone")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized from free GPU memory)")
    p.add_argument(
        "--quantization", default=None, help="run: fp8 (FP8 weights, FP8 GEMMs on Hopper); all: as --with-fp8"
    )
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--speculative", choices=["ngram"], default=None, help="run: n-gram speculative decoding")
    p.add_argument(
        "--repeat", type=int, default=1, help="after a 32-request warm-up, time the workload this many times"
    )
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--latency", action="store_true")
    p.add_argument("--latency-runs", type=int, default=1, help="batch-1 latency measured this many times (median)")
    p.add_argument("--quick", action="store_true", help="skip the ablations")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--hf-requests", type=int, default=64)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    if args.mode == "all":
        main_all(args)
        return

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.model_dir is None:
        args.model_dir = write_model_dir(Path(args.tokenizer_dir), args.shape)
    result = run_minisgl(args) if args.mode == "run" else run_hf(args)
    print("RESULT " + json.dumps(result), flush=True)
