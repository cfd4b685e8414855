"""What transformers resolves from a model directory, recorded once (minisgl/hf_records.py): a later start reads the
same configs and builds the same tokenizer as transformers does, without importing transformers for them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from conftest import TINY_FAMILIES
from minisgl.hf_records import ConfigView, read_configs
from minisgl.models.config import ModelConfig
from minisgl.tokenizer import has_chat_template, load_tokenizer

TEXTS = ["Hello world, café! 12 x 7 = 84", "  leading spaces\nand\ttabs", "<|im_start|>user\nhi<|im_end|>", "日本語"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _transformers_configs(model_dir: Path):
    has_generation = (model_dir / "generation_config.json").is_file()
    generation = GenerationConfig.from_pretrained(model_dir) if has_generation else None
    return AutoConfig.from_pretrained(model_dir), generation


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_recorded_config_reads_the_same_model_config_as_transformers(family, tiny_model_dir, cache_dir):
    model_dir = tiny_model_dir(family)
    first = read_configs(model_dir)
    second = read_configs(model_dir)
    assert not isinstance(first[0], ConfigView) and isinstance(second[0], ConfigView)  # resolved, then recorded
    expected = ModelConfig.from_hf(*_transformers_configs(model_dir))
    assert ModelConfig.from_hf(*second) == expected
    assert second[0].model_type == expected.hf_config.model_type


def test_the_smollm2_record_matches_transformers(smollm2_dir, cache_dir):
    read_configs(smollm2_dir)
    view, generation = read_configs(smollm2_dir)
    assert isinstance(view, ConfigView)
    assert ModelConfig.from_hf(view, generation) == ModelConfig.from_hf(*_transformers_configs(smollm2_dir))


def test_a_changed_config_file_is_resolved_again(tiny_model_dir, cache_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir("llama"), tmp_path / "model")
    read_configs(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (model_dir / "config.json").write_text(json.dumps(config))
    fresh, _ = read_configs(model_dir)
    assert not isinstance(fresh, ConfigView) and fresh.rms_norm_eps == 1e-3
    assert read_configs(model_dir)[0].rms_norm_eps == 1e-3


def test_a_damaged_record_is_resolved_again(tiny_model_dir, cache_dir):
    model_dir = tiny_model_dir("qwen3")
    read_configs(model_dir)
    for record in (cache_dir / "configs").glob("config-*.json"):
        record.write_text("{not json")
    config, _ = read_configs(model_dir)
    assert ModelConfig.from_hf(config) == ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))


@pytest.mark.parametrize("source", ["smollm2", "tiny"])
def test_a_recorded_tokenizer_class_builds_the_tokenizer_autotokenizer_builds(source, request, cache_dir):
    model_dir = request.getfixturevalue("smollm2_dir") if source == "smollm2" else None
    if model_dir is None:
        model_dir = request.getfixturevalue("tiny_model_dir")("qwen2")
    load_tokenizer(model_dir)  # records the class
    assert list((cache_dir / "configs").glob("tokenizer-*.json"))
    ours, reference = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(reference)
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "What is 12 times 7?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == reference.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (
        reference.bos_token_id,
        reference.eos_token_id,
        len(reference),
    )


def test_has_chat_template_agrees_with_autotokenizer(smollm2_dir, tmp_path):
    assert has_chat_template(smollm2_dir) is (AutoTokenizer.from_pretrained(smollm2_dir).chat_template is not None)
    bare = tmp_path / "bare"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert AutoTokenizer.from_pretrained(bare).chat_template is None
    assert has_chat_template(bare) is False


def test_a_second_start_reads_config_and_tokenizer_without_transformers_config_classes(tiny_model_dir, cache_dir):
    """The scheduler's config and the text worker's tokenizer, once recorded, never import AutoConfig's machinery
    (transformers.models.auto: seconds of import); the first start did."""
    model_dir = tiny_model_dir("llama")
    read_configs(model_dir)
    load_tokenizer(model_dir)
    probe = (
        "import sys; from pathlib import Path\n"
        "from minisgl.hf_records import read_configs\nfrom minisgl.tokenizer import load_tokenizer\n"
        f"d = Path({str(model_dir)!r}); config, _ = read_configs(d)\n"
        "assert 'transformers' not in sys.modules, 'the config imported transformers'\n"
        "tok = load_tokenizer(d); print(type(tok).__name__, tok.encode('hello'))\n"
        "assert not any(m.startswith('transformers.models.auto') for m in sys.modules), 'AutoTokenizer was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == type(AutoTokenizer.from_pretrained(model_dir)).__name__


def test_a_grammar_built_while_the_tokenizer_loads_in_the_background_waits_for_it(tiny_model_dir, cache_dir):
    """The scheduler loads its tokenizer on a thread (TokenizerLoad.start) and may build the grammar backend, which
    imports xgrammar and with it transformers, meanwhile: in a fresh process (transformers not imported yet) both
    succeed, the backend waiting for the load."""
    model_dir = tiny_model_dir("llama")
    probe = (
        "from minisgl.config import EngineConfig\nfrom minisgl.scheduler.requests import Grammars\n"
        "from minisgl.tokenizer import TokenizerLoad\n"
        f"load = TokenizerLoad({str(model_dir)!r}); load.start()\n"
        "backend = Grammars(load.get, 49152, EngineConfig()).backend()\n"
        "print(type(backend).__name__, type(load.get()).__name__)\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[0] == "GrammarBackend"
