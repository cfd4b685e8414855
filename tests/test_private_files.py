"""Files that hold or steer secrets are private from their first byte: CURVE keys, and the install script's
temporary files."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_key_files_and_their_directories_are_private_from_the_start(tmp_path: Path, monkeypatch) -> None:
    """No moment exists at which another user could read a secret key: every file and directory is created with
    owner-only permissions (not chmodded after), whatever the umask of the caller."""
    import zmq.auth

    from minisgl.runtime import auth

    made: list[tuple[str, int]] = []
    real = zmq.auth.create_certificates

    def watched(directory: str, name: str) -> tuple[str, str]:
        public, secret = real(directory, name)
        made.extend((p, stat.S_IMODE(os.stat(p).st_mode)) for p in (directory, public, secret))
        return public, secret

    monkeypatch.setattr(zmq.auth, "create_certificates", watched)
    old = os.umask(0o022)
    try:
        root = tmp_path / "config" / "minisgl" / "curve"
        auth.ensure_server_keys(root)
        auth.create_client_keys(root, "laptop")
    finally:
        os.umask(old)
    assert made and all(mode & 0o077 == 0 for _, mode in made), made
    for path in (root.parent, root, root / "clients", root / "authorized_clients"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE((root / "authorized_clients" / "laptop.key").stat().st_mode) & 0o077 == 0


def test_the_scripts_write_no_fixed_name_in_a_shared_temporary_directory():
    """A fixed /tmp name can be planted or swapped by another user before the script writes or reads it (pip -c
    would then take that user's constraints): temporary files come from mktemp."""
    fixed = re.compile(r"(?<![\w{])/tmp/[\w.-]+")
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        for n, line in enumerate(script.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not fixed.search(code) or "mktemp" in code, f"{script.name}:{n}: {line.strip()}"
