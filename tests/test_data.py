import importlib.util
import json
import sys

import pytest
import torch

from lowbit.data import calibration_batches, eval_tokens, load_corpus, load_documents, split_documents
from lowbit.data.batches import training_batches
from lowbit.errors import DataError


def test_bundled_split_is_even_odd_sorted_and_disjoint():
    from pydoc_data.topics import topics

    keys = sorted(topics)
    docs = load_documents(None)
    assert docs == [topics[k] for k in keys]
    calib, ev = split_documents(docs, "calib"), split_documents(docs, "eval")
    assert calib == [topics[k] for k in keys[0::2]] and ev == [topics[k] for k in keys[1::2]]
    # (a few topics share one text under two keys; the split is by key position, never by text)
    assert len(calib) + len(ev) == len(keys)


def test_txt_paragraph_parity(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("p0\n\np1\n\np2\n\np3\n")
    assert load_corpus(f, "calib") == "p0\n\np2"
    assert load_corpus(f, "eval") == "p1\n\np3"


def test_jsonl_text_and_chat(tmp_path, tiny_tokenizer):
    f = tmp_path / "d.jsonl"
    rows = [{"text": "alpha"}, {"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_corpus(f, "calib", tiny_tokenizer) == "alpha"
    assert load_corpus(f, "eval", tiny_tokenizer) == "<|user|>hi\n<|assistant|>yo\n"


@pytest.mark.parametrize("content,needle", [
    (b"", "no text"), (b"\x00\x01\x02binary", "binary"), (b'{"x": 1}\n', "neither"),
    (b"not json\n", "not valid JSON"),
])
def test_bad_text_sources(tmp_path, content, needle):
    f = tmp_path / ("d.jsonl" if b"{" in content or b"json" in content else "d.txt")
    f.write_bytes(content)
    with pytest.raises(DataError, match=needle):
        load_corpus(f)


def test_missing_source_and_single_document(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt")
    (tmp_path / "one.txt").write_text("only one paragraph")
    with pytest.raises(DataError, match="too few"):
        load_corpus(tmp_path / "one.txt", "eval")


def test_calibration_is_seeded_and_from_calib_split(tiny_tokenizer):
    a = calibration_batches(tiny_tokenizer, nsamples=4, seqlen=64, seed=3)
    b = calibration_batches(tiny_tokenizer, nsamples=4, seqlen=64, seed=3)
    c = calibration_batches(tiny_tokenizer, nsamples=4, seqlen=64, seed=4)
    assert a.shape == (4, 64) and torch.equal(a, b) and not torch.equal(a, c)
    calib_text = tiny_tokenizer.decode(a[0])
    assert calib_text in load_corpus(None, "calib")


def test_too_little_calibration_text_says_how_much(tmp_path, tiny_tokenizer):
    f = tmp_path / "s.txt"
    f.write_text("a few words here\n\nand some there\n\nmore\n\nend")
    with pytest.raises(DataError, match=r"has \d+ tokens, too few for even one sample of 64 tokens; use more text"):
        calibration_batches(tiny_tokenizer, f, nsamples=8, seqlen=64)


def test_training_batches_cover_windows_without_overlap(tiny_tokenizer):
    it = training_batches(tiny_tokenizer, seqlen=32, batch_size=4, seed=0, epochs=1)
    seen = torch.cat(list(it))
    assert len({tuple(r.tolist()) for r in seen}) == len(seen)
    assert eval_tokens(tiny_tokenizer).shape[0] == 1


def _save_dataset(path, **splits):
    datasets = pytest.importorskip("datasets")
    made = {k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
    ds = made["rows"] if list(made) == ["rows"] else datasets.DatasetDict(made)
    ds.save_to_disk(str(path))
    return path


def test_saved_dataset_splits_by_row_parity(tmp_path):
    path = _save_dataset(tmp_path / "ds", rows=["r0", "r1", "r2", "r3", "r4"])
    assert load_corpus(path, "calib") == "r0\n\nr2\n\nr4"
    assert load_corpus(path, "eval") == "r1\n\nr3"


def test_dataset_dict_uses_its_own_held_out_split(tmp_path):
    both = _save_dataset(tmp_path / "dd", train=["a", "b", "c"], validation=["v"], test=["t"])
    assert load_corpus(both, "calib") == "a\n\nb\n\nc"
    assert load_corpus(both, "eval") == "v"
    only_train = _save_dataset(tmp_path / "tr", train=["a", "b", "c"])
    assert load_corpus(only_train, "eval") == "b"


def test_dataset_folder_errors(tmp_path, monkeypatch):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("hello")
    if importlib.util.find_spec("datasets") is not None:
        with pytest.raises(DataError, match="not a dataset saved with save_to_disk"):
            load_corpus(tmp_path / "plain")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="pip install datasets"):
        load_corpus(tmp_path / "plain")


def test_token_cache_follows_file_edits_and_is_not_aliased(tmp_path, tiny_tokenizer):
    from lowbit.data import tokenize_split

    f = tmp_path / "t.txt"
    f.write_text("one two\n\nthree\n\nfour five six\n\nseven")
    first = tokenize_split(tiny_tokenizer, f)
    first.zero_()  # a caller scribbling on its copy must not change the cache
    again = tokenize_split(tiny_tokenizer, f)
    assert torch.equal(again, torch.tensor([tiny_tokenizer("one two\n\nfour five six")["input_ids"]]))
    f.write_text("other words entirely\n\nx\n\nand more text here")
    assert not torch.equal(tokenize_split(tiny_tokenizer, f), again)


def test_unknown_split_name(tmp_path):
    with pytest.raises(DataError, match="unknown split"):
        load_corpus(None, "train")
