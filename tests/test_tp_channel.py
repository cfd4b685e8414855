"""The tensor-parallel control channel: private on one host, CURVE across hosts, signed typed messages, and no
port a foreign local user can use to read an op or delay a step."""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
from tests.daemon_fixtures import daemon_runtime_dir, free_port, start_serve, wait_http  # noqa: F401 - fixtures

from minisgl.config import EngineConfig
from minisgl.distributed import auth
from minisgl.distributed.auth import AuthError, load_secret, sign
from minisgl.distributed.channel import ChannelPlace, Hub, Spoke, TPEvent, TPOps

SECRET = b"0123456789abcdef-the-engine-secret"


class _Payload:
    """What an attacker would send: unpickling it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.fixture
def private_channel():
    place = ChannelPlace.private()
    hub = Hub(place, SECRET, world_size=2)
    spoke = Spoke(place, SECRET, rank=1)
    spoke.join()
    assert hub.hello_from(5000) == 1
    yield place, hub, spoke
    spoke.close()
    hub.close()
    place.remove()


def tcp_place() -> ChannelPlace:
    while True:  # P+1..P+3 free too
        port = free_port()
        try:
            for offset in (1, 2, 3):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return ChannelPlace(host="127.0.0.1", port=port)
        except OSError:
            continue


def test_one_hosts_channel_lives_in_a_directory_only_its_user_can_enter(private_channel):
    place, _, _ = private_channel
    assert stat.S_IMODE(os.stat(place.directory).st_mode) == 0o700
    assert sorted(p.name for p in Path(place.directory).iterdir()) == ["control.ipc", "events.ipc", "ops.ipc"]
    assert all(place.endpoint(name).startswith(f"ipc://{place.directory}/") for name in ("ops", "events", "control"))


def test_a_rank_applies_only_signed_ops_in_sequence(private_channel, tmp_path):
    import pickle

    _, hub, spoke = private_channel
    marker = tmp_path / "pwned"
    good = [["add", "r", [1, 2], {"max_tokens": 3}, False], ["abort", "r"]]
    for forged in (
        pickle.dumps(_Payload(marker)),  # a pickle: never decoded
        sign(SECRET, pickle.dumps(_Payload(marker))),  # signed but not msgpack
        TPOps(0, [["exit"]]).pack(SECRET)[32:],  # unsigned
        TPOps(0, [["exit"]]).pack(b"another secret of the same size"),
        TPOps(1, [["exit"]]).pack(SECRET),  # out of sequence
    ):
        hub.send_ops(forged)
    hub.send_ops(TPOps(0, good).pack(SECRET))
    assert spoke.next_ops() == good
    hub.send_ops(TPOps(0, good).pack(SECRET))  # a replay
    hub.send_ops(TPOps(1, [["exit"]]).pack(SECRET))
    assert spoke.next_ops() == [["exit"]]
    assert not marker.exists()


@pytest.mark.parametrize("ops", [[["shell", "rm -rf /"]], [["add", "r"]], ["exit"], [[]]])
def test_an_op_of_unknown_kind_or_shape_does_not_decode(ops):
    assert TPOps.unpack(SECRET, TPOps(0, ops).pack(SECRET)) is None


def test_an_event_counts_only_when_signed_and_well_formed(private_channel):
    _, hub, spoke = private_channel
    import msgpack

    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(spoke.place.endpoint("events"))
    raw.send(msgpack.packb(["failed", 1, "stop everything"]))  # unsigned
    raw.send(sign(b"another secret", msgpack.packb(["failed", 1, "stop everything"])))
    raw.send(sign(SECRET, msgpack.packb(["format the disk", 1, ""])))  # signed, of no known kind
    spoke.report("failed", "rank 1 failed")
    events: list[TPEvent] = []
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        events = hub.events_ready(100)
    assert events == [TPEvent("failed", 1, "rank 1 failed")]
    raw.close(linger=0)


def test_rank_zero_ignores_a_hello_without_the_secret():
    place = ChannelPlace.private()
    hub = Hub(place, SECRET, world_size=3)
    impostor, rank2 = Spoke(place, b"a guess at the secret", 1), Spoke(place, SECRET, 2)
    try:
        impostor.join()
        assert hub.hello_from(2000) is None
        rank2.join()
        assert hub.hello_from(2000) == 2
    finally:
        for end in (impostor, rank2, hub):
            end.close()
        place.remove()


def test_across_hosts_only_a_holder_of_the_secret_connects_and_reads():
    """tcp: CURVE with keys derived from the secret; a client with other keys, or none, reads nothing and cannot
    take a rank's place; the one with the secret does."""
    place = tcp_place()
    hub = Hub(place, SECRET, world_size=2)
    ctx = zmq.Context()
    try:
        outsiders = []
        for keys in (None, zmq.curve_keypair()):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            dealer = ctx.socket(zmq.DEALER)
            dealer.identity = b"rank-1"
            for sock in (sub, dealer):
                if keys is not None:
                    sock.curve_publickey, sock.curve_secretkey = keys
                    sock.curve_serverkey = zmq.curve_keypair()[0]  # a guess at the server's key
                sock.connect(place.endpoint("control" if sock is sub else "ops"))
            outsiders.append((sub, dealer))
        spoke = Spoke(place, SECRET, rank=1)
        spoke.join()
        assert hub.hello_from(5000) == 1
        listener = spoke.control_socket(ctx)
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            hub.publish(TPEvent("heartbeat", 0))
            if listener.poll(100):
                got = TPEvent.unpack(SECRET, listener.recv())
        assert got == TPEvent("heartbeat", 0)
        hub.send_ops(TPOps(0, [["abort", "r"]]).pack(SECRET))
        assert spoke.next_ops() == [["abort", "r"]]
        for sub, dealer in outsiders:
            assert not sub.poll(500) and not dealer.poll(100)
            sub.close(linger=0)
            dealer.close(linger=0)
        listener.close(linger=0)
        spoke.close()
    finally:
        hub.close()
        ctx.term()


def test_multi_node_needs_a_secret_from_the_environment_or_a_private_file(monkeypatch, tmp_path):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    two_nodes = EngineConfig(tp=2, nnodes=2, dist_init_addr="127.0.0.1:1")
    with pytest.raises(AuthError, match="MINISGL_TP_SECRET"):
        load_secret(two_nodes)
    assert load_secret(EngineConfig()) != load_secret(EngineConfig())  # one node: a fresh secret per engine
    path = tmp_path / "secret"
    path.write_text("a secret of two nodes\n")
    path.chmod(0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        load_secret(two_nodes.replace(tp_secret_file=str(path)))
    path.chmod(0o600)
    assert load_secret(two_nodes.replace(tp_secret_file=str(path))) == b"a secret of two nodes"
    monkeypatch.setenv(auth.SECRET_ENV, "from the environment")
    assert load_secret(two_nodes) == b"from the environment"


def test_the_secret_is_handed_to_a_rank_in_its_environment_not_its_argv():
    env = auth.child_env(SECRET)
    assert env[auth.SECRET_ENV] == SECRET.decode() and env["PATH"] == os.environ["PATH"]


def test_no_code_executing_decoder_in_the_tree():
    src = Path(__file__).resolve().parents[1]
    pattern = re.compile(
        r"\b(pickle|marshal|dill|cloudpickle)\.loads?\(|(?<!\.)\beval\(|torch\.load\((?![^)]*weights_only=True)"
    )
    hits = [
        f"{path.relative_to(src)}:{n}"
        for folder in ("src", "integrations")
        for path in (src / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []


def _listening_ports(pids: list[int]) -> list[tuple[str, int]]:
    out = []
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            out.append((conn.laddr.ip, conn.laddr.port))
    return sorted(out)


STORE_PROBE = """
import datetime, os, sys, threading
import torch.distributed as dist
def probe(port):
    try:
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2)).check(["minisgl"])
        print(port, flush=True)
    except Exception:
        pass
for port in sys.argv[1:]:
    threading.Thread(target=probe, args=(int(port),), daemon=True).start()
threading.Event().wait(8)
os._exit(0)
"""


def _store_ports(ports: list[tuple[str, int]]) -> list[int]:
    """The ports at which a torch TCPStore answers (one would hand anyone its keys, and so a queue of ops). A
    client of another kind of server can wait forever in the store's handshake: probes run in threads of a
    child that ends after 8 s."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", STORE_PROBE, *(str(p) for _, p in ports)], capture_output=True, text=True, timeout=60
    ).stdout
    return [int(line) for line in out.split()]


class _Foreigner:
    """A local user without the secret: connects to every port again and again, sends junk, reads what comes."""

    def __init__(self, ports: list[tuple[str, int]]) -> None:
        self.ports, self.received, self.stop = ports, b"", threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        held = []
        while not self.stop.is_set():
            for host, port in self.ports:
                try:
                    s = socket.create_connection((host, port), timeout=0.2)
                    s.sendall(b"\x00\x00\x00\x00\x00\x00\x00\x01" + os.urandom(64))
                    s.settimeout(0.05)
                    try:
                        self.received += s.recv(4096)
                    except OSError:
                        pass
                    held.append(s)  # some stay open, silent, as a stalled peer would
                except OSError:
                    pass
            time.sleep(0.05)
        for s in held:
            s.close()


def _stream_gaps(client, prompt: list[int], params) -> tuple[list[int], float]:
    """A stream's tokens and its largest gap between two chunks."""
    tokens, gaps, last = [], [], time.perf_counter()
    for chunk in client.stream(prompt, params):
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        tokens.extend(chunk.token_ids)
    return tokens, max(gaps[1:], default=0.0)  # the first gap is the prefill


def test_a_foreign_client_on_every_tcp_port_of_a_tp2_daemon_neither_reads_an_op_nor_delays_a_step(
    tiny_model_dir,
    daemon_runtime_dir,  # noqa: F811
    tmp_path,
):
    """`minisgl serve --tp 2` with HTTP: a local user without the secret connects to every TCP port the daemon's
    processes listen on, again and again, sends junk and holds connections open, while a stream runs: the stream
    gives the offline engine's tokens with gaps like its own alone, nothing it reads carries an op, and every
    port is on loopback (gloo is pinned there)."""
    from minisgl import LLM, Client, SamplingParams
    from minisgl.runtime.launcher import wait_ready

    model = str(tiny_model_dir("llama"))
    prompt, greedy = [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    address, log = f"ipc://{daemon_runtime_dir}/tp2.sock", tmp_path / "tp2.log"
    args = ["--model", model, "--device", "cpu", "--num-pages", "512", "--tp", "2", "--address", address]
    http_port = free_port()
    proc = start_serve([*args, "--http-port", str(http_port), "--dist-timeout", "60"], log)
    try:
        with LLM(model, device="cpu", num_pages=512) as llm:
            ref = list(llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids)
        wait_ready(address, 300, proc=proc, log_path=log)
        wait_http(http_port, proc, log)
        client = Client("tiny", address, auto_start=False, timeout=120)
        _stream_gaps(client, prompt, greedy)  # warm
        alone, alone_gap = _stream_gaps(client, prompt, greedy)
        family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        ports = _listening_ports(family)
        assert ("127.0.0.1", http_port) in ports and len(ports) >= 3, ports  # HTTP and gloo's
        assert all(ip in ("127.0.0.1", "::1") for ip, _ in ports), ports
        assert _store_ports(ports) == [], ports
        foreigner = _Foreigner(ports)
        time.sleep(1)
        beside, beside_gap = _stream_gaps(client, prompt, greedy)
        foreigner.stop.set()
        foreigner.thread.join()
        assert alone == beside == ref
        assert beside_gap < 3 * alone_gap + 1.0, (alone_gap, beside_gap)
        assert b"add" not in foreigner.received and b"input_ids" not in foreigner.received
        assert proc.poll() is None, log.read_text()[-2000:]
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_channel_directory_whose_rank_zero_died_is_removed_by_the_next_engine():
    import subprocess
    import tempfile

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"minisgl-tp-{gone.pid}-"))
    live = Path(tempfile.mkdtemp(prefix=f"minisgl-tp-{os.getppid()}-"))
    place = ChannelPlace.private()
    try:
        assert not stale.exists() and live.exists() and Path(place.directory).exists()
    finally:
        place.remove()
        live.rmdir()
