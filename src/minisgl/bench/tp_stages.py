"""The stages of `minisgl bench tp all` (see minisgl.bench.tp) and the table they print."""

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from minisgl.bench.throughput import QWEN3_06B, SHAPES
from minisgl.bench.tp_report import print_table
from minisgl.bench.tp_support import (
    PARITY_ENGINE,
    VOCAB,
    agreement,
    free_port,
    kill_group,
    kill_rank_check,
    parity_prompts,
    run_child,
    teacher_forced_hf,
    write_config_dir,
    write_hf_checkpoint,
)
from minisgl.lifetime import parent_env


def stage_parity(args: argparse.Namespace, out_dir: Path, res: dict[str, Any], log: Path) -> None:
    py = sys.executable
    bench_tp = [py, "-m", "minisgl", "bench", "tp"]
    tok = Path(args.tokenizer_dir)
    t0 = time.perf_counter()
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    if args.tiny:  # CPU smoke test of this script
        shape.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    ckpt = write_hf_checkpoint(tok, "qwen3-tp-parity-", "cpu", **shape)
    common = [
        "--model-dir",
        str(ckpt),
        "--num-prompts",
        str(args.parity_prompts),
        "--max-new",
        str(args.parity_new),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    work = Path(tempfile.mkdtemp(prefix="tp-parity-"))
    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"} if args.device == "cuda" else {}
    p = res.setdefault("parity", {})
    code, _ = run_child([*bench_tp, "gen", "--tp", "2", "--out", str(work / "tp2.json"), *common], 150, log=log)
    p["tp2_gen_exit"] = code
    if not (work / "tp2.json").exists():
        p["error"] = f"tp2 gen exit {code}"
        return
    if "nodes" in args.stages:
        _stage_nodes(args, ckpt, common, work, res, log)
    code, _ = run_child(
        [
            *bench_tp,
            "gen",
            "--tp",
            "1",
            "--out",
            str(work / "tp1.json"),
            "--teacher-force",
            str(work / "tp2.json"),
            *common,
        ],
        150,
        env=one_gpu,
        log=log,
    )
    if not (work / "tp1.json").exists():
        p["error"] = f"tp1 gen exit {code}"
        return
    _score_parity(args, ckpt, work, p)
    p["seconds"] = round(time.perf_counter() - t0, 1)
    print("parity:", json.dumps(p))


def _score_parity(args: argparse.Namespace, ckpt: Path, work: Path, p: dict[str, Any]) -> None:
    """TP=2's greedy tokens scored by TP=1 teacher-forced and by HF fp32 (and TP=1's by HF fp32)."""
    tp1 = json.loads((work / "tp1.json").read_text())
    tp2 = json.loads((work / "tp2.json").read_text())["tokens"]
    prompts = parity_prompts(args.parity_prompts)
    ref2 = teacher_forced_hf(ckpt, prompts, tp2, args.device)
    ref1 = teacher_forced_hf(ckpt, prompts, tp1["tokens"], args.device)
    p["tp2_vs_tp1_teacher_forced"] = agreement(ref2, tp2, tp1["forced_top1"])
    p["tp2_vs_hf_fp32"] = agreement(ref2, tp2)
    p["tp1_vs_hf_fp32"] = agreement(ref1, tp1["tokens"])
    first_div = []
    for a, b in zip(tp1["tokens"], tp2):
        first_div.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    p["greedy_identical_tp1_tp2"] = f"{sum(d is None for d in first_div)}/{len(tp2)}"
    p["first_divergence_positions"] = [d for d in first_div if d is not None]
    p["prompts"], p["new_tokens"], p["dtype"] = args.parity_prompts, args.parity_new, args.dtype
    p["pass"] = p["tp2_vs_tp1_teacher_forced"]["top1_clear_margin"] >= 0.99


def _stage_nodes(
    args: argparse.Namespace, ckpt: Path, common: list[str], work: Path, res: dict[str, Any], log: Path
) -> None:
    """Two "nodes": node 1 = `minisgl serve --node-rank 1` on GPU 1, node 0 = LLM(nnodes=2) on GPU 0; their outputs
    must equal the single-node TP=2 ones (work/tp2.json)."""
    py = sys.executable
    bench_tp = [py, "-m", "minisgl", "bench", "tp"]
    shared = {"MINISGL_TP_SECRET": secrets.token_hex(32)}  # what every node of an engine must share
    one_gpu = {**shared, **({"CUDA_VISIBLE_DEVICES": "0"} if args.device == "cuda" else {})}
    addr = f"127.0.0.1:{free_port()}"
    engine = [
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        addr,
        "--dist-timeout",
        "90",
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--num-pages",
        str(PARITY_ENGINE["num_pages"]),
        "--max-prefill-tokens",
        str(PARITY_ENGINE["max_prefill_tokens"]),
    ]
    if args.device == "cuda":
        engine += ["--cuda-graph-max-bs", str(PARITY_ENGINE["cuda_graph_max_bs"])]
    node1_env = {**os.environ, **shared, **({"CUDA_VISIBLE_DEVICES": "1"} if args.device == "cuda" else {})}
    node1_log = open(work / "node1.log", "w")
    cmd1 = [py, "-m", "minisgl", "serve", "--model", str(ckpt), "--node-rank", "1", *engine]
    print("$ [node 1]", " ".join(cmd1), flush=True)
    node1 = subprocess.Popen(
        cmd1, stdout=node1_log, stderr=subprocess.STDOUT, env=parent_env(node1_env), start_new_session=True
    )
    try:
        code, _ = run_child(
            [
                *bench_tp,
                "gen",
                "--tp",
                "2",
                "--nnodes",
                "2",
                "--dist-init-addr",
                addr,
                "--out",
                str(work / "nodes.json"),
                *common,
            ],
            150,
            env=one_gpu,
            log=log,
        )
        try:
            node1_code = node1.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node1_code = "timeout"
    finally:
        kill_group(node1)
        node1_log.close()
    text = (work / "node1.log").read_text()
    with open(log, "a") as f:
        f.write(f"[node 1]\n{text}\n")
    if node1_code != 0:
        print("[node 1 log tail]\n" + "\n".join(text.splitlines()[-40:]))
    n = res.setdefault("nodes", {})
    n["node0_exit"], n["node1_exit"] = code, node1_code
    if (work / "nodes.json").exists():
        tp2 = json.loads((work / "tp2.json").read_text())["tokens"]
        nodes = json.loads((work / "nodes.json").read_text())["tokens"]
        n["identical_outputs"] = f"{sum(a == b for a, b in zip(tp2, nodes))}/{len(tp2)}"
        n["pass"] = nodes == tp2


def stage_kill(args: argparse.Namespace, out_dir: Path, res: dict[str, Any], log: Path) -> None:
    """The kill check with the default environment, then with each of --tp2-env's (e.g. the symm-mem all-reduce)."""
    model = write_config_dir(QWEN3_06B, Path(args.tokenizer_dir), "qwen3-0.6b-dummy-")
    for extra in ["", *filter(None, args.tp2_env.split(";"))]:
        env = dict(kv.split("=", 1) for kv in extra.split())
        k = kill_rank_check(
            model,
            [
                "--load-format",
                "dummy",
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--dist-timeout",
                "60",
                "--cuda-graph-max-bs",
                "16",
                "--num-pages",
                "20000",
            ],
            out_dir / "kill_daemon.log",
            env=env,
        )
        k["pass"] = (
            bool(k.get("stream_error"))
            and k.get("daemon_exit") not in (0, "still running")
            and not k.get("left_behind")
            and k.get("seconds_to_daemon_exit", 1e9) < 60
        )
        res["kill" if not extra else f"kill {extra}"] = k
        print(f"kill {extra}:", json.dumps(k), flush=True)


def parse(out: str, tag: str) -> dict[str, Any] | None:
    for line in out.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    return None


def stage_tput(args: argparse.Namespace, out_dir: Path, res: dict[str, Any], log: Path) -> None:
    model = write_config_dir(SHAPES[args.shape], Path(args.tokenizer_dir), f"{args.shape}-dummy-")
    t = res.setdefault("tput", {"model": f"{args.shape}-shaped dummy, bf16", "requests": args.num_requests})
    runs: list[tuple[str, int, dict[str, str]]] = [("tp1", 1, {"CUDA_VISIBLE_DEVICES": "0"}), ("tp2", 2, {})]
    for extra in filter(None, args.tp2_env.split(";")):  # more TP=2 runs, each with its environment variables
        runs.append((f"tp2 {extra}", 2, dict(kv.split("=", 1) for kv in extra.split())))
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key, _, _ in runs}
    for round_ in range(args.repeat):  # the runs in turn, `repeat` times: each figure the median of its runs
        for key, tp, env in runs:
            cmd = [sys.executable, "-m", "minisgl", "bench", "tp", "bench", "--model-dir", str(model), "--tp", str(tp)]
            cmd += ["--num-requests", str(args.num_requests)] + (["--latency"] if args.latency else [])
            if args.profile and round_ == 0:
                cmd += ["--profile-dir", str(out_dir / (key.replace(" ", "_").replace("=", "-") + "_profile"))]
            code, out = run_child(cmd, args.bench_timeout, env=env, log=log)
            r = parse(out, "RESULT") or {"error": f"exit {code}"}
            r.update(parse(out, "LATENCY") or {})
            profile = parse(out, "PROFILE")
            if profile:
                r["profile"] = profile
            rounds[key].append(r)
    for key, rs in rounds.items():  # the median run (its latency too), every run's throughput, the profile
        ok = sorted((r for r in rs if "output_tok_s" in r), key=lambda r: r["output_tok_s"])
        t[key] = dict(ok[len(ok) // 2], output_tok_s_runs=[r["output_tok_s"] for r in ok]) if ok else rs[0]
        if "profile" in rs[0]:
            t[key]["profile"] = rs[0]["profile"]
    for key, _, _ in runs[1:]:
        if "output_tok_s" in t.get("tp1", {}) and "output_tok_s" in t[key]:
            t[key]["speedup"] = round(t[key]["output_tok_s"] / t["tp1"]["output_tok_s"], 2)
    if "speedup" in t["tp2"]:
        t["speedup"] = t["tp2"]["speedup"]
        t["pass"] = t["speedup"] >= 1.6


def stage_hfpatch(args: argparse.Namespace, out_dir: Path, res: dict[str, Any], log: Path) -> None:
    c = QWEN3_06B
    shape = dict(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
        rope_theta=c["rope_theta"],
        rms_norm_eps=c["rms_norm_eps"],
        tie_word_embeddings=True,
    )
    ckpt = write_hf_checkpoint(Path(args.tokenizer_dir), "qwen3-0.6b-hf-", args.device, **shape)
    runs = args.hfpatch_args.split(";")  # one `bench hf-generate` run per ";"-separated argument list
    for i, extra in enumerate(runs):
        path = out_dir / ("hfpatch.json" if len(runs) == 1 else f"hfpatch_{i}.json")
        code, _ = run_child(
            [
                sys.executable,
                "-m",
                "minisgl",
                "bench",
                "hf-generate",
                "--model",
                str(ckpt),
                "--num-prompts",
                "256",
                "--device",
                "cuda",
                "--json",
                str(path),
                *extra.split(),
            ],
            300,
            log=log,
        )
        h = json.loads(path.read_text()) if path.exists() else {"error": f"exit {code}"}
        if "speedup" in h:
            h["pass"] = h["speedup"] >= 10
        res.setdefault("hfpatch", []).append(h)
    shutil.rmtree(ckpt, ignore_errors=True)


def stage_agents(args: argparse.Namespace, out_dir: Path, res: dict[str, Any], log: Path) -> None:
    model = write_config_dir(QWEN3_06B, Path(args.tokenizer_dir), "qwen3-0.6b-dummy-")
    for budget in args.agents_prefill.split(","):
        a: dict[str, Any] = {"agents": 64, "turns": 6, "max_prefill_tokens": int(budget)}
        for cache in ("radix", "naive"):
            path = out_dir / f"agents_{cache}_{budget}.json"
            code, _ = run_child(
                [
                    sys.executable,
                    "-m",
                    "minisgl",
                    "bench",
                    "agents",
                    "--model",
                    str(model),
                    "--load-format",
                    "dummy",
                    "--device",
                    "cuda",
                    "-k",
                    "64",
                    "-t",
                    "6",
                    "--caches",
                    cache,
                    "--max-prefill-tokens",
                    budget,
                    "--json",
                    str(path),
                ],
                180,
                log=log,
            )
            a[cache] = json.loads(path.read_text())[cache] if path.exists() else {"error": f"exit {code}"}
        if "ttft_p50_ms" in a["radix"] and "ttft_p50_ms" in a["naive"]:
            a["ttft_p50_ratio_naive_over_radix"] = round(
                a["naive"]["ttft_p50_ms"] / max(1e-9, a["radix"]["ttft_p50_ms"]), 2
            )
            a["speedup_radix_vs_naive"] = round(a["naive"]["seconds"] / a["radix"]["seconds"], 2)
            a["pass"] = a["ttft_p50_ratio_naive_over_radix"] >= 5 and a["radix"]["hit_ratio_of_max"] >= 0.95
        res.setdefault("agents", {})[budget] = a


def cmd_all(args: argparse.Namespace) -> None:
    import torch  # lazy: `minisgl bench --help` loads every benchmark

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "runs.log"
    on_cuda = args.device == "cuda"
    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if on_cuda else "cpu",
        "gpus": torch.cuda.device_count() if on_cuda else 0,
        "date": time.strftime("%Y-%m-%d"),
        "stages": args.stages,
    }
    t_start = time.perf_counter()
    path = out_dir / "tp.json"
    stages = [
        ("parity", stage_parity),
        ("tput", stage_tput),
        ("kill", stage_kill),
        ("hfpatch", stage_hfpatch),
        ("agents", stage_agents),
    ]
    for name, fn in stages:
        if name not in args.stages:
            continue
        left = args.deadline - (time.perf_counter() - t_start)
        if left < 45:
            res.setdefault("skipped", []).append(name)
            print(f"--- skip {name}: {left:.0f}s left", flush=True)
            continue
        print(f"--- {name} ({left:.0f}s left)", flush=True)
        t0 = time.perf_counter()
        try:
            fn(args, out_dir, res, log)
        except Exception as e:  # keep the other stages' figures
            res.setdefault("errors", {})[name] = repr(e)
            print(f"{name} failed: {e!r}", flush=True)
        res.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(res, indent=2))
    path.write_text(json.dumps(res, indent=2))
    print_table(res)
