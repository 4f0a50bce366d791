"""`lowbit finetune` end to end on a tiny quantized Llama with a chat-template tokenizer."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lowbit.cli import main
from lowbit.peft.finetune import IGNORE, instruction_rows

WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<unk>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    return fast


def write_jsonl(path, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(n):
        q = " ".join(WORDS[j] for j in torch.randint(0, 30, (6,), generator=g).tolist())
        a = " ".join(WORDS[30 + (j % 30)] for j in torch.randint(0, 30, (4,), generator=g).tolist())
        rec = {"instruction": q, "output": a} if i % 2 else {"messages": [{"role": "user", "content": q},
                                                                          {"role": "assistant", "content": a}]}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    torch.manual_seed(0)
    tok = tokenizer()
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(root / "fp")
    tok.save_pretrained(root / "fp")
    assert main(["quantize", str(root / "fp"), "--scheme", "w4g32", "--no-eval", "--out", str(root / "q")]) == 0
    return root


def test_instruction_rows_mask_the_prompt(tmp_path):
    tok = tokenizer()
    rows = instruction_rows(tok, write_jsonl(tmp_path / "d.jsonl", 4), seqlen=20)
    ids, labels = rows[0, 0], rows[0, 1]
    prompt_len = 1 + 6 + 1 + 1  # <|user|> q*6 <|end|> <|assistant|>
    assert (labels[:prompt_len] == IGNORE).all()
    assert torch.equal(labels[prompt_len:prompt_len + 5], ids[prompt_len:prompt_len + 5])  # answer + <|end|>
    assert (labels[prompt_len + 5:] == IGNORE).all() and (ids[prompt_len + 5:] == tok.pad_token_id).all()


@pytest.mark.parametrize("adapter", ["qwha", "lora"])
def test_finetune_writes_an_adapter_that_loads(checkpoint, tmp_path, capsys, adapter):
    data = write_jsonl(tmp_path / "train.jsonl", 48)  # 24 training records: the odd ones are the eval split
    out = tmp_path / "adapter"
    code = main(["finetune", str(checkpoint / "q"), "--adapter", adapter, "--rank", "4", "--steps", "4",
                 "--batch-size", "24", "--lr", "1e-2", "--seqlen", "24", "--data", str(data), "--no-eval",
                 "--out", str(out), "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["adapter"] == adapter and r["steps"] == 4 and r["trainable_params"] == \
        sum(4 * (o + i) for o, i in [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]) * 2
    assert (out / "adapter.json").is_file() and r["loss_last"] < r["loss_first"]
    from lowbit.files.native import load
    from lowbit.peft import adapters_of, load_adapters

    model, _ = load(checkpoint / "q")
    load_adapters(model, out)
    assert len(adapters_of(model)) == 14


def test_finetune_merge_writes_a_checkpoint(checkpoint, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "merged"
    assert main(["finetune", str(checkpoint / "q"), "--adapter", "loftq", "--rank", "2", "--steps", "2",
                 "--batch-size", "4", "--seqlen", "24", "--data", str(data), "--no-eval", "--merge",
                 "--out", str(out), "--json"]) == 0
    # every matmul weight accounted for after the re-quantization: no adapter matrix left over in float
    acc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["matmul_weights"]
    assert set(acc["quantized"]) == {"attention", "mlp"} and set(acc["float"]) <= {"embeddings", "lm_head"}
    from lowbit.files.native import load

    model, _ = load(out)
    assert model(torch.randint(0, 60, (1, 8))).logits.isfinite().all()


@pytest.mark.parametrize("extra,needle", [
    (["--adapter", "dora"], "unknown adapter"),
    (["--adapter", "qwha", "--rank", "500"], "exceeds"),
])
def test_bad_finetune_input_is_one_line(checkpoint, tmp_path, capsys, extra, needle):
    data = write_jsonl(tmp_path / "train.jsonl", 8)
    code = main(["finetune", str(checkpoint / "q"), *extra, "--steps", "1", "--batch-size", "4", "--seqlen", "24",
                 "--data", str(data), "--no-eval", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code != 0 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
