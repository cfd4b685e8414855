"""What the `minisgl bench tp` stages share: checkpoints and prompts, child processes, scoring against HF, and the
rank-kill check (tests/test_tp.py runs it on CPU)."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from minisgl import MiniSGLError, SamplingParams
from minisgl.lifetime import parent_env

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
    import torch  # lazy: `minisgl bench --help` loads every benchmark
    from transformers import Qwen3Config, Qwen3ForCausalLM  # lazy: transformers' import takes seconds

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


def profile_steps(llm: Any, out_dir: str, batch: int = 256, prompt_len: int = 128, steps: int = 32) -> dict:
    """torch.profiler on every rank over `steps` decode steps at full batch (after the batch's prefill).

    Each rank writes rank{R}.json / .txt / .trace.json.gz under out_dir (distributed/profile.py); returns the ranks'
    per-step figures without the per-step list.
    """
    sched = llm.scheduler
    rng = random.Random(2)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        n = rng.randrange(prompt_len // 2, prompt_len * 2)  # mixed lengths: requests open new pages at different steps
        sched.add_request(f"profile-{i}", [rng.randrange(10, 10000) for _ in range(n)], params)
    for _ in range(8):  # the prefill (batch * prompt_len tokens in max_prefill_tokens chunks), then a few decodes
        sched.step()
    if hasattr(sched, "profile"):  # tensor parallel: every rank profiles the same steps
        sched.profile("start", out_dir)
        for _ in range(steps):
            sched.step()
        sched.profile("stop")
    else:  # one rank: the same figures, for the comparison
        from minisgl.distributed.profile import RankProfiler  # lazy: torch, when the benchmark runs

        prof = RankProfiler(out_dir, 0)
        for _ in range(steps):
            t0 = time.perf_counter()
            sched.step()
            prof.record_step(0.0, time.perf_counter() - t0)
        prof.stop()
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
        env=parent_env({**os.environ, **(env or {})}),
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        code, out = 124, (out or "") + "\n[timed out]"
    finally:  # Ctrl-C or SIGTERM too: the child has its own session, which no signal to ours reaches
        kill_group(proc)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out}\n[exit {code}]\n")
    lines = [ln for ln in out.splitlines() if not ln.rstrip().endswith("it/s]")]
    sys.stdout.write("\n".join(lines[-15:] if code == 0 else lines[-60:]) + "\n")
    return code, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def teacher_forced_hf(model_dir: Path, prompts: list[list[int]], outs: list[list[int]], device: str) -> list[Any]:
    import torch  # lazy: `minisgl bench --help` loads every benchmark
    from transformers import AutoModelForCausalLM  # lazy: transformers' import takes seconds

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
    import torch  # lazy: `minisgl bench --help` loads every benchmark

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
    from minisgl import Client, SamplingParams  # lazy: zmq, when the benchmark runs
    from minisgl.runtime.launcher import wait_ready  # lazy: zmq, when the benchmark runs

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
        "--no-http",  # the stream under test is a ZeroMQ client's
        *serve_args,
    ]
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=parent_env({**os.environ, **(env or {})}),
        )
    r: dict[str, Any] = {}
    try:
        wait_ready(address, start_timeout, proc=proc, log_path=log_path)
        with Client(str(model_dir), address, auto_start=False, timeout=60) as client:
            first = client.generate([11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            r["served_before_kill"] = len(first.outputs[0].token_ids) == 8
            ranks = [pid for pid, line in session_pids(proc.pid) if "minisgl.runtime.tp" in line]
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
