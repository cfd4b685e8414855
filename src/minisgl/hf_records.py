"""What transformers resolves from a model directory's files, recorded once and read back without importing it.

transformers' import takes about 3 s on a small CPU, the largest part of a daemon's start-up, while a scheduler
needs only the resolved numbers of config.json and a text worker only the tokenizer's class.
- **Configs** (`read_configs`): the first read of a directory resolves config.json and generation_config.json
  with AutoConfig / GenerationConfig and records every attribute (class defaults included:
  `to_json_string(use_diff=False)`); a later read of the same files gives ConfigViews of that record. Only text
  models are recorded: a config with sub-configs (vision-language, ...) is always read by transformers.
- **The tokenizer's class** that AutoTokenizer picks (minisgl.tokenizer.load_tokenizer).

Records live under <cache>/configs (MINISGL_CACHE_DIR, else ~/.cache/minisgl), named by a hash of the files
they come from and of the transformers version: a changed file or an upgrade resolves them again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from minisgl import env
from minisgl.errors import UnknownArchitectureError

logger = logging.getLogger(__name__)

_FILES = ("config.json", "generation_config.json")


class ConfigView:
    """A resolved transformers config as plain attributes (what `getattr(config, name, default)` reads)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def get_text_config(self) -> "ConfigView":
        return self  # only text models are stored

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ConfigView(model_type={getattr(self, 'model_type', None)!r})"


def read_configs(model_dir: Path) -> tuple[Any, Any]:
    """(config, generation config or None) of a model directory; from the cache when these files were read before."""
    record = record_path(model_dir, _FILES, "config")
    stored = read_record(record)
    if stored is not None:
        try:
            generation = stored["generation"]
            return ConfigView(stored["config"]), (ConfigView(generation) if generation is not None else None)
        except (KeyError, TypeError) as e:  # a damaged record: resolve the files again
            logger.debug("ignoring config record %s: %s", record, e)
    hf_config, generation_config = _resolve(model_dir)
    if record is not None and hf_config.get_text_config() is hf_config:
        generation = json.loads(generation_config.to_json_string(use_diff=False)) if generation_config else None
        write_record(record, {"config": json.loads(hf_config.to_json_string(use_diff=False)), "generation": generation})
    return hf_config, generation_config


def _resolve(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoConfig, GenerationConfig  # lazy: transformers' import takes seconds

    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError) as e:  # unknown model_type
        raise UnknownArchitectureError(f"{model_dir}/config.json: {e}") from e
    generation_config = None
    if (model_dir / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(model_dir)
    return hf_config, generation_config


def record_path(model_dir: Path, names: tuple[str, ...], kind: str) -> Path | None:
    """Where what transformers resolved from model_dir's files `names` (as they are now) is kept; None if they
    cannot be read."""
    digest = hashlib.sha256(kind.encode())
    try:
        digest.update(b"\0" + metadata.version("transformers").encode())
        for name in names:
            path = model_dir / name
            digest.update(b"\0" + name.encode() + b"\0")
            if path.is_file():
                digest.update(path.read_bytes())
    except (OSError, metadata.PackageNotFoundError):
        return None
    return env.cache_root() / "configs" / f"{kind}-{digest.hexdigest()[:32]}.json"


def read_record(record: Path | None) -> dict[str, Any] | None:
    """A stored record; None when there is none or it cannot be read."""
    if record is None or not record.is_file():
        return None
    try:
        body = json.loads(record.read_text())
    except (OSError, ValueError) as e:
        logger.debug("ignoring record %s: %s", record, e)
        return None
    return body if isinstance(body, dict) else None


def write_record(record: Path | None, body: dict[str, Any]) -> None:
    """Write a record atomically (a reader sees all of it or none); a cache that cannot be written is skipped."""
    if record is None:
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".record-", dir=record.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, record)
    except OSError as e:
        logger.debug("cannot store record %s: %s", record, e)
