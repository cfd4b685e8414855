"""Tensor parallelism on a 2-GPU machine (issue 9): parity, throughput, two "nodes"; plus issue 7 / 10 GPU figures.

    minisgl bench tp all --out-dir out            # every stage, a table at the end (tools/device/gpu_tp_check.sh)
    minisgl bench tp gen --model-dir D --tp 2 --out F [--teacher-force G] [--nnodes 2 --dist-init-addr A]
    minisgl bench tp bench --model-dir D --tp 2 [--num-requests 256] [--latency]

Stages of `all` (each engine in its own process, so each sizes its KV pool from a clean GPU):
  parity   a Qwen3-shaped checkpoint with HF's random init (8 layers, hidden 1024, 16 q / 8 kv heads,
           vocab 49152, tied), bf16. TP=2 greedy outputs are scored by the TP=1 engine teacher-forced
           (its greedy top-1 after every prefix of TP=2's output) and by HF fp32, everywhere and where
           fp32 HF's top-2 margin is clear (> 1% of the top logit), as tests/test_gpu.py does.
  nodes    the same TP=2 run as two "nodes" on one machine: node 1 is `minisgl serve --node-rank 1`
           with CUDA_VISIBLE_DEVICES=1, node 0 an LLM(nnodes=2, node_rank=0) with CUDA_VISIBLE_DEVICES=0,
           tcp rendezvous on 127.0.0.1; its outputs must equal the single-node TP=2 outputs.
  tput     the issue-8 offline workload (`minisgl bench throughput`'s workload()) on a Qwen3-14B-shaped dummy
           model (40 layers, hidden 5120, 40 q / 8 kv heads, intermediate 17408, vocab 151936, untied),
           bf16, TP=1 (one GPU) vs TP=2.
  hfpatch  `minisgl bench hf-generate` --num-prompts 256 --device cuda on a Qwen3-0.6B-shaped HF checkpoint.
  kill     a `minisgl serve --tp 2` daemon (Qwen3-0.6B shape, dummy weights) has rank 1 SIGKILLed in the middle of a
           stream: the stream must end with a typed error, the daemon exit non-zero and nothing of its process
           session outlive it, all within bounded time (kill_rank_check; tests/test_tp.py runs it on CPU).
  agents   `minisgl bench agents` -k 64 -t 6 on the Qwen3-0.6B-shaped dummy model, radix and naive each in
           its own process (the first engine's KV pool is not given back inside one process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from minisgl.bench.throughput import QWEN3_06B, decode_latency, timed_workload, workload
from minisgl.env import TOKENIZER_DIR

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
VOCAB = 49152
PARITY_ENGINE = dict(num_pages=40000, cuda_graph_max_bs=32, max_prefill_tokens=8192)
TOK_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(tok_dir: Path, out: Path) -> None:
    for name in TOK_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)


def write_config_dir(config: dict[str, Any], tok_dir: Path, prefix: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix=prefix))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tok_dir, out)
    return out


def write_hf_checkpoint(tok_dir: Path, prefix: str, device: str, **shape: Any) -> Path:
    """A Qwen3 checkpoint with HF's own random init (seed 0), saved in bf16 with the tokenizer files of tok_dir."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(tempfile.mkdtemp(prefix=prefix))
    config = Qwen3Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    copy_tokenizer(tok_dir, out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def parity_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 20..200 ids; the second half shares a 96-token prefix (as tests/test_gpu.py)."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, VOCAB) for _ in range(96)]
    prompts = [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(20, 200))] for _ in range(n // 2)]
    prompts += [shared + [rng.randrange(10, VOCAB) for _ in range(rng.randrange(1, 100))] for _ in range(n - n // 2)]
    return prompts


# ---------------------------------------------------------------------------- gen: greedy tokens (parity)


def cmd_gen(args: argparse.Namespace) -> None:
    from minisgl import LLM, SamplingParams

    kw: dict[str, Any] = dict(PARITY_ENGINE, dtype=args.dtype, device=args.device, tp=args.tp, dist_timeout=90)
    if args.device == "cpu":
        kw.pop("cuda_graph_max_bs")
    if args.nnodes > 1:
        kw.update(nnodes=args.nnodes, node_rank=0, dist_init_addr=args.dist_init_addr)
    prompts = parity_prompts(args.num_prompts)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"tp": args.tp, "nnodes": args.nnodes}
    with LLM(str(args.model_dir), **kw) as llm:
        result["init_s"] = round(time.perf_counter() - t0, 1)
        result["tokens"] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if args.teacher_force:
            # This engine's greedy top-1 after every prefix of the other run's outputs (one token each).
            other = json.loads(Path(args.teacher_force).read_text())["tokens"]
            reqs = [p + o[:t] for p, o in zip(prompts, other) for t in range(len(o))]
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            flat = [o.token_ids[0] for o in llm.generate(reqs, one, use_tqdm=False)]
            forced, i = [], 0
            for o in other:
                forced.append(flat[i : i + len(o)])
                i += len(o)
            result["forced_top1"] = forced
        llm.check_integrity()
    Path(args.out).write_text(json.dumps(result))
    print(f"gen tp={args.tp} nnodes={args.nnodes}: {len(result['tokens'])} outputs in {time.perf_counter() - t0:.1f}s")
    sys.stdout.flush()
    os._exit(0)  # the figures are written: no wait on NCCL's exit handlers


# ---------------------------------------------------------------------------- bench: offline throughput


def cmd_bench(args: argparse.Namespace) -> None:
    import logging

    from minisgl import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    t0 = time.perf_counter()
    llm = LLM(
        str(args.model_dir),
        dtype="bfloat16",
        load_format="dummy",
        tp=args.tp,
        max_prefill_tokens=16384,
        dist_timeout=180,
    )
    init_s = time.perf_counter() - t0
    sched = getattr(llm.scheduler, "sched", llm.scheduler)
    result: dict[str, Any] = {"tp": args.tp, "requests": args.num_requests}
    result.update(timed_workload(llm, sched, workload(args.num_requests)))
    result.update(init_s=round(init_s, 1), kv_pages=sched.cache.num_pages)
    print("RESULT " + json.dumps(result), flush=True)
    if args.latency:
        print("LATENCY " + json.dumps(decode_latency(llm)), flush=True)
    if args.profile_dir and hasattr(llm.scheduler, "profile"):
        print("PROFILE " + json.dumps(profile_steps(llm, args.profile_dir)), flush=True)
    t0 = time.perf_counter()
    llm.shutdown()
    print(f"shutdown {time.perf_counter() - t0:.1f}s", flush=True)
    os._exit(0)


def profile_steps(llm: Any, out_dir: str, batch: int = 256, prompt_len: int = 128, steps: int = 32) -> dict:
    """torch.profiler on every rank over `steps` decode steps at full batch (after the batch's prefill).

    Each rank writes rank{R}.json / rank{R}.txt under out_dir (distributed/profile.py); returns the ranks'
    per-step figures without the per-step list.
    """
    from minisgl import SamplingParams

    sched = llm.scheduler
    rng = random.Random(2)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        sched.add_request(f"profile-{i}", [rng.randrange(10, 10000) for _ in range(prompt_len)], params)
    for _ in range(8):  # the prefill (batch * prompt_len tokens in max_prefill_tokens chunks), then a few decodes
        sched.step()
    sched.profile("start", out_dir)
    for _ in range(steps):
        sched.step()
    sched.profile("stop")
    while sched.has_work:
        sched.step()
    sched.step()  # a step carries the stop to the other ranks even when the batch ended with the last one
    deadline = time.monotonic() + 30
    paths = [Path(out_dir) / f"rank{r}.json" for r in range(sched.config.tp // sched.config.nnodes)]
    while not all(path.exists() for path in paths) and time.monotonic() < deadline:
        time.sleep(0.2)
    summaries = {}
    for path in paths:
        if path.exists():
            summary = json.loads(path.read_text())
            summary.pop("step_ms", None)
            summaries[path.stem] = summary
    return summaries


# ---------------------------------------------------------------------------- orchestration


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a child started with start_new_session and everything it started (e.g. its TP ranks)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # orphaned ranks of a child that already exited
        except (ProcessLookupError, PermissionError):
            pass


def run_child(
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> tuple[int, str]:
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        code, out = 124, (out or "") + "\n[timed out]"
    kill_group(proc)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out}\n[exit {code}]\n")
    lines = [ln for ln in out.splitlines() if not ln.rstrip().endswith("it/s]")]
    sys.stdout.write("\n".join(lines[-15:] if code == 0 else lines[-60:]) + "\n")
    return code, out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def teacher_forced_hf(model_dir: Path, prompts: list[list[int]], outs: list[list[int]], device: str) -> list[Any]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    rows = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            seq = torch.tensor([prompt + out], device=device)
            rows.append(hf(seq).logits[0, len(prompt) - 1 : -1].float().cpu())
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next stages' engines size their KV pools from free memory
    return rows


def agreement(ref32: list[Any], outs: list[list[int]], other: list[list[int]] | None = None) -> dict[str, float]:
    """Top-1 agreement of outs with other (default: fp32 HF's argmax), everywhere and at fp32-clear positions."""
    import torch

    hits = clear = clear_hits = total = 0
    for i, (logits, out) in enumerate(zip(ref32, outs)):
        top = logits.topk(2, dim=-1)
        want = top.indices[:, 0] if other is None else torch.tensor(other[i])
        ok = want == torch.tensor(out)
        is_clear = (top.values[:, 0] - top.values[:, 1]) > 0.01 * top.values[:, 0].abs()
        hits += int(ok.sum())
        total += len(out)
        clear += int(is_clear.sum())
        clear_hits += int((ok & is_clear).sum())
    return {
        "top1": round(hits / total, 4),
        "top1_clear_margin": round(clear_hits / max(clear, 1), 4),
        "clear_positions": round(clear / total, 3),
        "positions": total,
    }


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
    # Two "nodes": node 1 = `minisgl serve --node-rank 1` on GPU 1, node 0 = LLM(nnodes=2) on GPU 0.
    if "nodes" in args.stages:
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
        node1_env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": "1"} if args.device == "cuda" else {})}
        node1_log = open(work / "node1.log", "w")
        cmd1 = [py, "-m", "minisgl", "serve", "--model", str(ckpt), "--node-rank", "1", *engine]
        print("$ [node 1]", " ".join(cmd1), flush=True)
        node1 = subprocess.Popen(
            cmd1, stdout=node1_log, stderr=subprocess.STDOUT, env=node1_env, start_new_session=True
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
    p["seconds"] = round(time.perf_counter() - t0, 1)
    print("parity:", json.dumps(p))


def session_pids(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process of session sid (Linux /proc)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            found.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()))
        except (OSError, ValueError, IndexError):
            continue
    return found


def kill_rank_check(
    model_dir: Path,
    serve_args: list[str],
    log_path: Path,
    start_timeout: float = 300,
    exit_timeout: float = 120,
    env: dict[str, str] | None = None,
    idle: bool = False,
) -> dict[str, Any]:
    """Start `minisgl serve --tp 2`, stream a long generation, SIGKILL rank 1 mid-stream; report what follows.

    Returns the stream's error (type, message), the daemon's exit code, the seconds from the kill to the
    stream's error and to the daemon's exit, and the processes of the daemon's session still alive after it.
    idle: kill rank 1 while nothing runs instead (no stream: the daemon must still stop on its own).
    """
    from minisgl import Client, SamplingParams
    from minisgl.runtime.launcher import wait_ready

    address = f"ipc://{tempfile.mkdtemp(prefix='msgl-kill-')}/d.sock"
    cmd = [
        sys.executable,
        "-m",
        "minisgl",
        "serve",
        "--model",
        str(model_dir),
        "--tp",
        "2",
        "--address",
        address,
        *serve_args,
    ]
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
    r: dict[str, Any] = {}
    try:
        wait_ready(address, start_timeout, proc=proc, log_path=log_path)
        with Client(str(model_dir), address, auto_start=False, timeout=60) as client:
            first = client.generate([11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            r["served_before_kill"] = len(first.outputs[0].token_ids) == 8
            ranks = [pid for pid, line in session_pids(proc.pid) if "minisgl.scheduler.tp" in line]
            r["rank_processes"] = len(ranks)
            if len(ranks) != 1:
                r["error"] = f"expected one rank-1 process in the daemon's session, found {ranks}"
                return r
            if idle:
                t_kill = time.monotonic()
                os.kill(ranks[0], signal.SIGKILL)
                r["stream_error"] = "(idle: no stream)"
            else:
                r.update(_kill_mid_stream(client, ranks[0]))
                t_kill = time.monotonic() - r["seconds_to_stream_error"]
        try:
            r["daemon_exit"] = proc.wait(timeout=exit_timeout)
        except subprocess.TimeoutExpired:
            r["daemon_exit"] = "still running"
        r["seconds_to_daemon_exit"] = round(time.monotonic() - t_kill, 2)
        time.sleep(1.0)
        r["left_behind"] = [line for _, line in session_pids(proc.pid)]
        return r
    finally:
        kill_group(proc)


def _kill_mid_stream(client: Any, rank_pid: int) -> dict[str, Any]:
    """Stream a long greedy generation, SIGKILL the rank after 16 tokens, read the stream to its end or error."""
    from minisgl import MiniSGLError, SamplingParams

    r: dict[str, Any] = {}
    stream = client.stream([21, 22, 23], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    got = 0
    for chunk in stream:  # let it run a few steps, then kill rank 1 in the middle of the stream
        got += len(chunk.token_ids)
        if got >= 16:
            break
    t_kill = time.monotonic()
    os.kill(rank_pid, signal.SIGKILL)
    r["tokens_before_kill"] = got
    try:
        for chunk in stream:
            got += len(chunk.token_ids)
        r["stream_error"] = None  # ended without an error: a failure of this check
    except MiniSGLError as e:
        r["stream_error"] = f"{type(e).__name__}: {e}"
    r["seconds_to_stream_error"] = round(time.monotonic() - t_kill, 2)
    return r


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
    model = write_config_dir(QWEN3_14B, Path(args.tokenizer_dir), "qwen3-14b-dummy-")
    t = res.setdefault("tput", {"model": "Qwen3-14B-shaped dummy, bf16", "requests": args.num_requests})
    runs: list[tuple[str, int, dict[str, str]]] = [("tp1", 1, {"CUDA_VISIBLE_DEVICES": "0"}), ("tp2", 2, {})]
    for extra in filter(None, args.tp2_env.split(";")):  # more TP=2 runs, each with its environment variables
        runs.append((f"tp2 {extra}", 2, dict(kv.split("=", 1) for kv in extra.split())))
    for key, tp, env in runs:
        cmd = [
            sys.executable,
            "-m",
            "minisgl",
            "bench",
            "tp",
            "bench",
            "--model-dir",
            str(model),
            "--tp",
            str(tp),
            "--num-requests",
            str(args.num_requests),
        ] + (["--latency"] if args.latency else [])
        if tp == 2 and args.profile:
            cmd += ["--profile-dir", str(out_dir / (key.replace(" ", "_").replace("=", "-") + "_profile"))]
        code, out = run_child(cmd, args.bench_timeout, env=env, log=log)
        r = parse(out, "RESULT") or {"error": f"exit {code}"}
        lat = parse(out, "LATENCY")
        if lat:
            r.update(lat)
        prof = parse(out, "PROFILE")
        if prof:
            r["profile"] = prof
        t[key] = r
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


def print_table(r: dict[str, Any]) -> None:
    print(f"\n## {r.get('gpu')}, {r.get('date')}")
    p = r.get("parity", {})
    if "tp2_vs_tp1_teacher_forced" in p:
        tf, h2, h1 = p["tp2_vs_tp1_teacher_forced"], p["tp2_vs_hf_fp32"], p["tp1_vs_hf_fp32"]
        print(
            f"parity ({p['prompts']} prompts x {p['new_tokens']} greedy tokens, {p['dtype']}, {tf['positions']} "
            f"positions; "
            f"clear = fp32 HF top-2 margin > 1%, {tf['clear_positions']:.1%} of positions)"
        )
        print(
            f"  TP=2 tokens vs TP=1 teacher-forced top-1: {tf['top1']:.2%} all, {tf['top1_clear_margin']:.2%} clear "
            f"-> {'PASS' if p['pass'] else 'FAIL'} (>= 99%)"
        )
        print(
            f"  vs HF fp32 top-1: TP=2 {h2['top1']:.2%} / {h2['top1_clear_margin']:.2%} clear; "
            f"TP=1 {h1['top1']:.2%} / {h1['top1_clear_margin']:.2%} clear"
        )
        print(
            f"  greedy sequences identical TP=1 vs TP=2: {p['greedy_identical_tp1_tp2']}; "
            f"first divergences at {p['first_divergence_positions']}"
        )
    elif p:
        print(f"parity: {p}")
    n = r.get("nodes")
    if n:
        print(
            f"two nodes (nnodes 2, 1 GPU each, tcp 127.0.0.1) vs TP=2 one node: identical {n.get('identical_outputs')} "
            f"-> {'PASS' if n.get('pass') else 'FAIL'} (exits node0={n['node0_exit']} node1={n['node1_exit']})"
        )
    t = r.get("tput")
    if t:
        print(f"throughput, {t['model']}, {t['requests']} requests (issue 8 workload)")
        for key in [k for k in t if k.startswith("tp")]:
            x = t[key]
            name = key.replace("tp", "TP=", 1)
            if "output_tok_s" in x:
                lat = f", bs1 {x['decode_ms_per_token_bs1']} ms/token" if "decode_ms_per_token_bs1" in x else ""
                speedup = f" = {x['speedup']}x TP=1" if "speedup" in x else ""
                print(
                    f"  {name}: {x['output_tok_s']:.1f} output tok/s{speedup}, {x['seconds']:.2f}s, "
                    f"{x['kv_pages']} KV slots, init {x['init_s']}s{lat}"
                )
            else:
                print(f"  {name}: {x}")
            for rank, y in x.get("profile", {}).items():
                print(
                    f"    {rank} profile: {y['steps']} steps, wall {y['wall_ms_per_step']} ms/step, host "
                    f"{y['host_ms_per_step']}, ops wait {y['ops_wait_ms_per_step']}, device wait "
                    f"{y['device_wait_ms_per_step']}; GPU {y['gpu_total_ms_per_step']} ms/step {y['gpu_ms_per_step']}"
                )
        if "speedup" in t:
            print(f"  TP=2 / TP=1 = {t['speedup']}x -> {'PASS' if t['pass'] else 'FAIL'} (>= 1.6x)")
    for h in r.get("hfpatch", []):
        if "speedup" in h:
            print(
                f"HF generate drop-in, {h['num_prompts']} {h.get('prompt_set', 'random')} prompts, "
                f"{h['output_len']} new tokens: HF {h['hf_output_tok_s']} tok/s, patched "
                f"{h['minisgl_output_tok_s']} tok/s = {h['speedup']}x ({'PASS' if h['pass'] else 'FAIL'} >= 10x); "
                f"identical rows {h['identical_rows']}"
            )
        else:
            print(f"hfpatch: {h}")
    for key in [k for k in r if k.startswith("kill")]:
        k = r[key]
        print(
            f"{key}: rank 1 SIGKILLed mid-stream (serve --tp 2): stream error after "
            f"{k.get('seconds_to_stream_error')}s "
            f"({k.get('stream_error')}); daemon exit {k.get('daemon_exit')} after {k.get('seconds_to_daemon_exit')}s; "
            f"left behind {k.get('left_behind')} -> {'PASS' if k.get('pass') else 'FAIL'}"
        )
    for budget, a in r.get("agents", {}).items():
        if "ttft_p50_ratio_naive_over_radix" in a:
            ra, na = a["radix"], a["naive"]
            print(
                f"agents K=64 T=6, max_prefill_tokens {budget}: TTFT p50 radix {ra['ttft_p50_ms']} ms vs naive "
                f"{na['ttft_p50_ms']} ms = {a['ttft_p50_ratio_naive_over_radix']}x; hit ratio of max "
                f"{ra['hit_ratio_of_max']:.1%}; end to end {ra['seconds']}s vs {na['seconds']}s -> "
                f"{'PASS' if a['pass'] else 'FAIL'}"
            )
        else:
            print(f"agents ({budget}): {a}")


def cmd_all(args: argparse.Namespace) -> None:
    import torch

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=["all", "gen", "bench"])
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--tokenizer-dir", default=str(TOKENIZER_DIR.get() or ".carry/tok"))
    p.add_argument("--out-dir", default="tp-out")
    p.add_argument("--out")
    p.add_argument("--stages", default="parity,nodes,tput,kill,hfpatch,agents")
    p.add_argument("--agents-prefill", default="8192", help="agents: max_prefill_tokens values, comma-separated")
    p.add_argument("--hfpatch-args", default="", help="hfpatch: more `minisgl bench hf-generate` arguments")
    p.add_argument("--deadline", type=float, default=540, help="seconds: later stages are skipped past it")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--dist-init-addr")
    p.add_argument("--tp2-env", default="", help='tput and kill: more TP=2 runs, ";"-separated, each "VAR=value ..."')
    p.add_argument("--profile", action="store_true", help="all/tput: profile TP=2's ranks over one batch after the run")
    p.add_argument("--profile-dir", help="bench: profile the ranks over one batch after the run, into this directory")
    p.add_argument("--teacher-force", help="gen: also score these outputs (json) teacher-forced")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--parity-prompts", type=int, default=32)
    p.add_argument("--parity-new", type=int, default=48)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--bench-timeout", type=float, default=200)
    p.add_argument("--latency", action="store_true", help="bench: also ms/token at batch 1")
    p.add_argument("--tiny", action="store_true", help="parity: a tiny model (CPU smoke test of this benchmark)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    {"all": cmd_all, "gen": cmd_gen, "bench": cmd_bench}[args.mode](args)
