"""Find a model (local dir, .gguf file, alias or hub id), read its weights and build it.

GGUF files are converted once, with transformers' own GGUF support, into an HF-style
directory under the cache (~/.cache/minisgl/models, or $MINISGL_CACHE_DIR/models) and read
from there afterwards, so every later start is a plain safetensors load.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minisgl import env
from minisgl.errors import ModelLoadError, UnknownModelError, WeightsError
from minisgl.hf_records import read_configs
from minisgl.layers.fp8 import checkpoint_quantization, with_fp8_weights
from minisgl.models.config import ModelConfig, architecture_of
from minisgl.models.names import ALIASES, check_model_name, looks_like_path
from minisgl.models.registry import get_model_class

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja", "*.txt"]


def cache_root() -> Path:
    return env.cache_root() / "models"


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A local HF-style directory (config.json, tokenizer, *.safetensors) for a dir, .gguf, alias or hub id."""
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"{path} is a directory without config.json; point at a HF-style model directory")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnknownModelError(f"{path} is a file but not a .gguf; give a model directory or a .gguf file")
        return convert_gguf(path)
    if name.lower() in ALIASES:
        return convert_gguf(_alias_file(name.lower()))
    if looks_like_path(name):
        raise UnknownModelError(f"no such model file or directory: {name}")
    check_model_name(name)  # an unreachable hub or a repo it does not have fails now, not after retries
    return _download(name)


def _alias_file(alias: str) -> Path:
    package, filename, install = ALIASES[alias]
    # The package's own __init__ fails to import outside its host app; locate it without importing.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(f"model alias {alias!r} needs its package; install it with: {install}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise UnknownModelError(f"{filename} is missing from the installed {package}; reinstall it with: {install}")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download  # lazy: only to download

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # network, auth, bad id: all mean the same thing to the user
        raise UnknownModelError(
            f"{repo_id!r} is not a local path, alias ({', '.join(ALIASES)}) or reachable hub repo: {e}"
        ) from e


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantise a .gguf once into <cache>/<stem>-<hash>/ (config, tokenizer, model.safetensors)."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:16]
    root = cache_root()
    target = root / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to %s (once)", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        _write_hf_dir(gguf_path, tmp)
        try:
            tmp.rename(target)  # atomic: readers see a complete directory or none
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished the same conversion first; use theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers' import takes seconds

        folder, filename = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    except Exception as e:
        raise ModelLoadError(f"could not read GGUF file {gguf_path}: {e}") from e
    if not getattr(tokenizer, "chat_template", None):
        template = _gguf_chat_template(gguf_path)
        if template:
            tokenizer.chat_template = template
    # save_pretrained refuses models loaded through the GGUF quantizer, although their
    # weights are already dequantised: write config and tensors ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with embed_tokens; safetensors rejects aliases
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"), {"format": "pt"})


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader  # lazy: gguf is optional

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def iter_weights(model_dir: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a model.safetensors or a sharded index, on the CPU."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        if not file.is_file():
            raise WeightsError(f"weights file {file.name} listed in {index.name} is missing from {model_dir}")
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:
            raise WeightsError(f"weights file {file.name} is corrupt or truncated: {e}") from e
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise WeightsError(f"weights file {file.name}: cannot read tensor {name}: {e}") from e
                yield name, tensor


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model: Any, dtype: torch.dtype | None = None, device: torch.device | str = "cpu", load_format: str = "auto"
) -> tuple["nn.Module", ModelConfig]:
    """Build the registered model for a dir / .gguf / alias / hub id, or a live transformers model.

    The architecture is looked up in the registry: the built-ins, and the plugins' once minisgl.plugins has
    loaded them (the engine does, before it calls this).

    A live PreTrainedModel contributes its config and current state_dict (in-memory fine-tunes
    included). An FP8 checkpoint (quantization_config.quant_method "fp8") is dequantized into dtype.
    load_format "dummy" skips the weights files and fills parameters with small random values
    (benchmarks). The returned config's dtype is the dtype the model was built in.
    """
    if not isinstance(model, (str, os.PathLike)):  # a live model: only then import transformers' modeling (seconds)
        from transformers import PreTrainedModel  # lazy: its import takes seconds

        if not isinstance(model, PreTrainedModel):
            raise ModelLoadError(f"model must be a path, an alias, a hub id or a PreTrainedModel, got {type(model)}")
        hf_config, generation_config = model.config, getattr(model, "generation_config", None)
        architecture = (getattr(hf_config, "architectures", None) or [type(model).__name__])[0]
        weights: Any = model.state_dict().items()
    else:
        model_dir = resolve_model(model)
        hf_config, generation_config = read_configs(model_dir)
        architecture = None
        weights = iter_weights(model_dir)
    architecture = architecture or architecture_of(hf_config)
    fp8 = checkpoint_quantization(hf_config)  # an unsupported method fails before any weight is read
    cls = get_model_class(architecture)  # before reading the config: an unknown one fails naming the registered ones
    config = ModelConfig.from_hf(hf_config, generation_config, architecture=architecture)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    with torch.device(device), _default_dtype(dtype):
        instance = cls(config)
    if load_format == "dummy":
        _fill_dummy(instance)
    elif load_format == "auto":
        instance.load_weights(with_fp8_weights(weights, fp8))
    else:
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    instance.eval()
    return instance, replace(config, dtype=dtype)


def _fill_dummy(model: "nn.Module") -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.uniform_(-0.02, 0.02)  # small: keeps activations finite through any depth
