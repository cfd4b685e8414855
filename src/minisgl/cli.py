"""`minisgl serve | stop | shell | generate | bench | keys` (also `python -m minisgl ...`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from minisgl import env
from minisgl.bench import main as bench_main
from minisgl.config import EngineConfig, default_of
from minisgl.engine.threads import default_threads, set_wait_policy
from minisgl.errors import ConfigError, MiniSGLError
from minisgl.lifetime import die_with_parent
from minisgl.llm import LLM
from minisgl.runtime.addresses import default_address
from minisgl.runtime.supervisor import port_taken
from minisgl.server import DEFAULT_HTTP_PORT, HttpOptions
from minisgl.server.binding import check_bind
from minisgl.server.params import sampling_params_for
from minisgl.server.shell import run_shell

logger = logging.getLogger("minisgl")

_TYPES = {"int": int, "float": float, "str": str}


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """--model plus every EngineConfig field as --kebab-case (unset flags keep the config's defaults)."""
    group = parser.add_argument_group("engine options (EngineConfig)")
    group.add_argument(
        "--model", default="smollm2", help="model name, directory, hub id or GGUF file (default: smollm2)"
    )
    notes = {
        "max_decode_gap": "seconds a decoding request may wait between tokens while prompts prefill (unset: 1 on "
        "the CPU, 0.1 on a GPU; 0: unbounded); ",
        "quantization": "fp8 (any device), fp16 or int8 (CPU float32 only); ",
        "speculative": "ngram: draft tokens from the request's own text and finished answers, verified in one "
        "forward (outputs as without it; faster where the answer repeats its context); ",
        "moe_parallel": "MoE under --tp: ep (whole experts per rank), tp (each expert split across the ranks) or "
        "auto (ep where the ranks divide the experts); ",
    }
    defaults = {  # what a None default stands for
        "threads": f"the physical cores this process may use, hyperthreads not counted ({default_threads()} here; "
        "OMP_NUM_THREADS, if set, instead)",
    }
    for f in fields(EngineConfig):
        if f.name in ("model", "extra", *skip):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" | None", "")
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action="store_true", default=argparse.SUPPRESS)
        elif kind in _TYPES:
            group.add_argument(
                flag,
                dest=f.name,
                type=_TYPES[kind],
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=notes.get(f.name, "") + f"default: {defaults.get(f.name, default_of(f))}",
            )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (not the defaults)."""
    names = {f.name for f in fields(EngineConfig)} - {"model", "extra"}
    return {k: v for k, v in vars(args).items() if k in names}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(args.model, **engine_kwargs(args))


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the daemon's address (default: the one serving --model; started if none)")
    parser.add_argument("--curve-client-key", help="the client's CURVE .key_secret file (tcp daemons)")
    parser.add_argument("--curve-server-key", help="the daemon's public CURVE server.key file (tcp daemons)")


def _add_serve_parser(sub: Any) -> None:
    """`minisgl serve`: the daemon's addresses and CURVE, the HTTP API and its guard, idle stop, engine flags."""
    serve = sub.add_parser("serve", help="run the daemon for a model in the foreground (Ctrl-C stops it)")
    serve.add_argument(
        "--address", help="ipc:///path or tcp://HOST:PORT (default: an ipc socket per model in the runtime dir)"
    )
    serve.add_argument("--allow-remote", action="store_true", help="allow a non-loopback tcp address (turns on CURVE)")
    serve.add_argument(
        "--curve", action="store_true", help="require CURVE authentication on an ipc address too (tcp always has it)"
    )
    serve.add_argument(
        "--curve-dir", help="CURVE key directory (default: $MINISGL_CURVE_DIR or ~/.config/minisgl/curve)"
    )
    serve.add_argument("--max-message-bytes", type=int, default=None, help="drop client connections that send more")
    serve.add_argument(
        "--http-port",
        type=_port,
        help="serve the OpenAI/Ollama HTTP API on this port (default: 30000; a taken port is an error; 0: no HTTP)",
    )
    serve.add_argument("--no-http", action="store_true", help="serve ZeroMQ clients only (same as --http-port 0)")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names the HTTP API answers to and lists in /v1/models (the first is the one responses carry)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="HTTP server host (default: 127.0.0.1)")
    serve.add_argument(
        "--api-key",
        help="HTTP server API key (required for a non-loopback --host); better: $MINISGL_API_KEY or --api-key-file, "
        "which `ps` does not show",
    )
    serve.add_argument("--api-key-file", help="a file holding the HTTP server's API key")
    serve.add_argument(
        "--allowed-origins", default="", help="comma-separated origins a browser may call the HTTP API from (CORS)"
    )
    serve.add_argument(
        "--allowed-hosts", default="", help="comma-separated Host names the HTTP API answers besides the bound host"
    )
    serve.add_argument(
        "--max-request-bytes", type=int, default=32 * 2**20, help="HTTP request bodies past this get a 413 (32 MiB)"
    )
    serve.add_argument(
        "--enable-admin",
        action="store_true",
        help="serve the HTTP admin routes (/flush_cache, /reset_prefix_cache) without an API key; with a key they "
        "are on and need it",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=env.IDLE_TIMEOUT.get(),
        metavar="SECONDS",
        help="stop after this many seconds with no request (default: $MINISGL_IDLE_TIMEOUT, else never; "
        "auto-started daemons get $MINISGL_IDLE_TIMEOUT of the program that starts them, else 300; 0: never)",
    )
    add_engine_flags(serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minisgl", description="minisgl: a fast local LLM inference runtime")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    _add_serve_parser(sub)

    stop = sub.add_parser("stop", help="stop daemons started by this user")
    target = stop.add_mutually_exclusive_group()
    target.add_argument("--address", help="stop the daemon at this address")
    target.add_argument("--all", action="store_true", help="stop every registered daemon")
    stop.add_argument("--timeout", type=float, default=30.0)

    ps = sub.add_parser("ps", help="list the running daemons: model, address, state, load")
    ps.add_argument("--json", action="store_true", help="one JSON object per daemon, one per line")

    shell = sub.add_parser("shell", help="interactive chat with a model (/reset clears the history)")
    shell.add_argument("--system", help="a system prompt")
    shell.add_argument("--max-tokens", type=int, help="default: 512 (API_DEFAULTS in minisgl.server.params)")
    shell.add_argument("--temperature", type=float, help="default: 0.7")
    _add_client_flags(shell)
    add_engine_flags(shell)

    gen = sub.add_parser("generate", help="generate once, offline (in this process), and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, help="default: 64 (API_DEFAULTS in minisgl.server.params)")
    gen.add_argument("--temperature", type=float, help="default: 0 (greedy)")
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", dest="sample_seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    add_engine_flags(gen, skip=("seed",))

    sub.add_parser("bench", help="benchmarks (see `minisgl bench --help`)", add_help=False)

    keys = sub.add_parser("keys", help="create CURVE keys for remote access")
    keys.add_argument("--curve-dir", help="key directory (default: $MINISGL_CURVE_DIR or ~/.config/minisgl/curve)")
    keys.add_argument("--client", metavar="NAME", help="also create (and authorize) a client keypair NAME")
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from minisgl.runtime.daemon import DEFAULT_MAX_MESSAGE_BYTES, serve  # lazy: torch and zmq load for serve only

    config = engine_config(args)
    if config.node_rank > 0:  # multi-node TP: this node only runs its ranks; node 0 serves
        from minisgl.runtime.ranks import run_node  # lazy: torch and zmq load for serve only

        return run_node(config)
    http = _http_options(args)
    if http is not None:
        check_bind(args.host, http.api_key)  # refused before the model loads, not by the HTTP process after it
        _check_http_port(http)
    if args.http_port and (running := _running_daemon(config, args.address)) is not None:
        return _serve_http_only(running, http, args.model)
    return serve(
        config,
        args.address,
        allow_remote=args.allow_remote,
        curve=args.curve,
        curve_keys=args.curve_dir,
        http=http,
        max_message_bytes=args.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES,
        log_level=logger.level,
        idle_timeout=args.idle_timeout or None,
    )


def _http_options(args: argparse.Namespace) -> Any:
    """The HTTP server's options, None with --no-http or --http-port 0. Its API key from --api-key, else
    --api-key-file, else $MINISGL_API_KEY."""
    if args.no_http or args.http_port == 0:
        return None
    api_key = args.api_key
    if api_key is None and args.api_key_file:
        with open(args.api_key_file) as f:
            api_key = f.read().strip() or None
    api_key = api_key or env.API_KEY.get()

    def names(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(",") if part.strip())

    return HttpOptions(
        args.host,
        args.http_port or DEFAULT_HTTP_PORT,
        api_key,
        names(args.allowed_origins),
        names(args.allowed_hosts),
        args.max_request_bytes,
        tuple(args.served_model_name or ()),
        enable_admin=args.enable_admin,
    )


def _check_http_port(http: Any) -> None:
    """Refuse a taken HTTP port before the model loads, naming the process that holds it."""
    taken = port_taken(http.host, http.port)
    if taken is not None:
        raise ConfigError(f"{taken}; stop it, or pass --http-port N for another port, or --no-http for ZeroMQ only")


def _running_daemon(config: EngineConfig, address: str | None) -> str | None:
    """The address of a daemon that already answers where `serve` would bind, else None."""
    from minisgl.runtime.launcher import ping  # lazy: zmq

    url = address or default_address(config)
    try:
        return url if ping(url) is not None else None
    except MiniSGLError:  # a CURVE daemon refusing us: serve's own bind reports that address as taken
        return None


def _serve_http_only(address: str, http: Any, model: str) -> int:
    """`serve --http-port` for a model whose daemon already runs: the HTTP API attaches to that daemon."""
    print(
        f"minisgl: a daemon already serves {model} at {address}; serving the HTTP API for it on "
        f"http://{http.host}:{http.port} (Ctrl-C stops the HTTP server only; `minisgl stop --address {address}` "
        "stops the daemon)",
        file=sys.stderr,
        flush=True,
    )
    http.run(address, model, logger.level)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from minisgl.runtime.launcher import running_daemons, stop_daemon  # lazy: zmq

    if args.address:
        addresses = [args.address]
    else:
        records = running_daemons()
        if not args.all and len(records) > 1:
            print("several daemons are running; give --address or --all:", file=sys.stderr)
            for r in records:
                print(f"  {r.address}  model={r.model} pid={r.pid}", file=sys.stderr)
            return 2
        addresses = [r.address for r in records]
    if not addresses:
        print("no minisgl daemon is running")
        return 0
    code = 0
    for address in addresses:
        if stop_daemon(address, args.timeout):
            print(f"stopped {address}")
        else:
            print(f"no daemon answers at {address}", file=sys.stderr)
            code = 1
    return code


def cmd_ps(args: argparse.Namespace) -> int:
    from minisgl.runtime.auth import ClientCurve  # lazy: zmq
    from minisgl.runtime.launcher import daemon_status, running_daemons  # lazy: zmq

    curve = ClientCurve.resolve(None, None)  # $MINISGL_CURVE_CLIENT_KEY/_SERVER_KEY, for CURVE daemons
    statuses = [daemon_status(r, curve) for r in sorted(running_daemons(), key=lambda r: r.started_at)]
    if args.json:
        for status in statuses:
            print(json.dumps(status))
        return 0
    if not statuses:
        print("no minisgl daemon is running")
        return 0
    header = ("MODEL", "ADDRESS", "PID", "STATE", "UP", "QUANTIZATION", "THREADS")
    rows = [(*header, "RUNNING", "WAITING", "KV IN USE", "KV CACHED")]
    for s in statuses:
        engine = (str(s.get("quantization", "-")), str(s.get("threads", "-")))  # a ready daemon's scheduler says
        load = ("-",) * 4
        if "total_pages" in s:
            total = max(s["total_pages"], 1)
            load = (
                str(s["running"]),
                str(s["waiting"]),
                f"{100 * s['req_pages'] / total:.1f}%",
                f"{100 * s['cached_pages'] / total:.1f}%",
            )
        rows.append((s["model"], s["address"], str(s["pid"]), s["state"], _duration(s["uptime_s"]), *engine, *load))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    return 0


def _duration(seconds: float) -> str:
    """3s, 4m12s, 2h05m, 3d04h."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _given(**flags: Any) -> dict[str, Any]:
    """The sampling flags given on the command line (an unset flag takes the command's default)."""
    return {k: v for k, v in flags.items() if v is not None}


def cmd_shell(args: argparse.Namespace) -> int:
    from minisgl.client import Client  # lazy: zmq

    with Client(
        args.model,
        args.address,
        curve_client_key=args.curve_client_key,
        curve_server_key=args.curve_server_key,
        **engine_kwargs(args),
    ) as client:
        params = sampling_params_for("shell", _given(max_tokens=args.max_tokens, temperature=args.temperature))
        return run_shell(client, system_prompt=args.system, sampling_params=params)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = LLM(args.model, **engine_kwargs(args))
    given = _given(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        stop=args.stop,
    )
    params = sampling_params_for("cli.generate", given)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(out.text)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from minisgl.runtime.auth import create_client_keys, curve_dir, ensure_server_keys  # lazy: zmq

    directory = Path(args.curve_dir) if args.curve_dir else curve_dir()
    public, secret = ensure_server_keys(directory)
    print(f"server keys: {secret} (public: {public})")
    if args.client:
        c_public, c_secret = create_client_keys(directory, args.client)
        print(f"client {args.client!r}: {c_secret} (authorized as {directory / 'authorized_clients' / c_public.name})")
        print(f"on the client: MINISGL_CURVE_CLIENT_KEY={c_secret} MINISGL_CURVE_SERVER_KEY={public}")
    return 0


COMMANDS = {
    "serve": cmd_serve,
    "stop": cmd_stop,
    "ps": cmd_ps,
    "shell": cmd_shell,
    "generate": cmd_generate,
    "keys": cmd_keys,
}


def _port(text: str) -> int:
    """argparse type: a TCP port number."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be in 1-65535 (or 0: no HTTP), got {port}")
    return port


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # a command another minisgl command started (MINISGL_PARENT_PID) ends with it
    set_wait_policy()  # before anything loads torch: this process's and its children's OpenMP threads sleep
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        bench_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    from minisgl.runtime.transport import configure_logging  # lazy: zmq

    configure_logging(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except (MiniSGLError, OSError) as e:  # OSError: a path that cannot be read or written (keys --curve-dir, ...)
        print(f"minisgl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
