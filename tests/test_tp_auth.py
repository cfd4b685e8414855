"""The tensor-parallel rendezvous store: bound to the address given, signed typed messages, ranks prove a secret."""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

import psutil
import pytest

from minisgl.config import EngineConfig
from minisgl.distributed import auth
from minisgl.distributed.auth import AuthError, check_proofs, load_secret, post_challenge, prove, sign
from minisgl.distributed.launch import FAILED_KEY, connect_store, free_port, read_failed, set_failed
from minisgl.runtime.protocol import ProtocolError, TPOps, decode, encode
from minisgl.scheduler.tp import _OpsInbox

SECRET = b"0123456789abcdef-the-engine-secret"
TIMEOUT = datetime.timedelta(seconds=5)


@pytest.fixture
def store():
    return connect_store(f"127.0.0.1:{free_port()}", True, TIMEOUT)


class _Payload:
    """What an attacker would push: unpickling it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_the_store_listens_only_on_the_address_given():
    port = free_port()
    store = connect_store(f"127.0.0.1:{port}", True, TIMEOUT)
    listening = [
        c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    ]
    assert listening == ["127.0.0.1"]
    del store


def test_a_rank_applies_only_signed_ops_in_sequence(store, tmp_path):
    import pickle

    marker = tmp_path / "pwned"
    inbox = _OpsInbox(store, "ops", SECRET)
    good = [["add", "r", [1, 2], {"max_tokens": 3}, False], ["abort", "r"]]
    for forged in (
        pickle.dumps(_Payload(marker)),  # a pickle: never decoded
        sign(SECRET, pickle.dumps(_Payload(marker))),  # signed but not msgpack
        encode(TPOps(0, [["exit"]])),  # unsigned
        sign(b"another secret of the same size", encode(TPOps(0, [["exit"]]))),
        sign(SECRET, encode(TPOps(1, [["exit"]]))),  # out of sequence
    ):
        store.queue_push("ops", forged)
    store.queue_push("ops", sign(SECRET, encode(TPOps(0, good))))
    assert inbox.next() == good
    store.queue_push("ops", sign(SECRET, encode(TPOps(0, good))))  # a replay
    store.queue_push("ops", sign(SECRET, encode(TPOps(1, [["exit"]]))))
    assert inbox.next() == [["exit"]]
    assert not marker.exists()


@pytest.mark.parametrize("ops", [[["shell", "rm -rf /"]], [["add", "r"]], ["exit"], [[]]])
def test_an_op_of_unknown_kind_or_shape_does_not_decode(ops):
    with pytest.raises(ProtocolError):
        decode(encode(TPOps(0, ops)))


def test_a_failure_flag_counts_only_when_signed(store):
    store.set(FAILED_KEY, b"stop everything")
    assert read_failed(store, SECRET) is None
    set_failed(store, SECRET, "rank 1 failed")
    assert read_failed(store, SECRET) == "rank 1 failed"


def test_rank_zero_refuses_a_rank_without_the_secret(store):
    post_challenge(store)
    prove(store, SECRET, 1)
    prove(store, b"a guess at the secret", 2)
    with pytest.raises(AuthError, match="rank 2 did not prove the shared secret"):
        check_proofs(store, SECRET, 3)
    prove(store, SECRET, 2)
    check_proofs(store, SECRET, 3)


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
