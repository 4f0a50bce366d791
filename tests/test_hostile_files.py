"""Files lowbit trusts that could silently change its numbers (issue 31, causes 4, 6, 12).

- the converted-GGUF cache is keyed by the GGUF's content and verified on every use: a
  damaged entry is rebuilt with a warning, a same-size same-mtime replacement is read anew;
- a checkpoint's config.json and tokenizer files are checksummed like its weights, and
  ``inspect`` cross-checks the manifest's shapes against the stored tensors;
- a PTQ block file that is not safetensors beside a matching sidecar is re-tuned.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import make_llama
from test_hostile_inputs import one_error_line as one_error

from lowbit.cli import main
from lowbit.errors import CheckpointError


# ------------------------------------------------------------------ the GGUF cache
@pytest.fixture
def two_ggufs(tmp_path, tiny_tokenizer, monkeypatch):
    """Two GGUF exports of the same size (other random weights), and an empty cache."""
    pytest.importorskip("gguf")
    from lowbit.files import gguf_export
    from lowbit.models import linear_layers
    from lowbit.nn import QuantLinear, set_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    paths = []
    for seed in (0, 1):
        m = make_llama(len(tiny_tokenizer), layers=1, seed=seed)
        for n in linear_layers(m):
            set_module(m, n, QuantLinear.from_linear(m.get_submodule(n), "w4g32"))
        paths.append(tmp_path / f"m{seed}.gguf")
        gguf_export.export(m, tiny_tokenizer, paths[-1])
    assert paths[0].stat().st_size == paths[1].stat().st_size
    return paths


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """What transformers' GGUF loader gives for ``path``, without lowbit's cache."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return {k: v.clone() for k, v in m.state_dict().items()}


def same(model, ref: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def cache_entries() -> list[Path]:
    from lowbit.files.gguf_read import cache_root

    return sorted(p for p in cache_root().iterdir() if not p.name.startswith("."))


def test_a_damaged_cache_entry_is_rebuilt_with_a_warning(two_ggufs):
    from safetensors.torch import load_file, save_file

    from lowbit.models import load_model

    path = two_ggufs[0]
    ref = reference_weights(path)
    assert same(load_model(path).model, ref)
    (entry,) = cache_entries()
    f = entry / "model.safetensors"
    t = load_file(str(f))
    key = next(k for k in t if k.endswith("down_proj.weight"))
    t[key][0, 0] += 0.5  # a plausible damaged float (the probe changed perplexity 508.46 -> 512.40)
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="cache entry .* is damaged .*model.safetensors does not match"):
        lm = load_model(path)
    assert same(lm.model, ref)
    assert same(load_model(path).model, ref)  # the rebuilt entry verifies


def test_a_gguf_replaced_with_the_same_size_and_mtime_is_read_anew(two_ggufs):
    from lowbit.models import load_model

    a, b = two_ggufs
    load_model(a)
    stat = a.stat()
    a.write_bytes(b.read_bytes())  # in place (same inode), as cp onto an existing file does
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime, as cp -p / rsync -a / touch -r
    assert a.stat().st_size == stat.st_size and a.stat().st_mtime_ns == stat.st_mtime_ns
    assert same(load_model(a).model, reference_weights(b))
    assert len(cache_entries()) == 2  # keyed by content: one entry per model


def test_the_gguf_is_hashed_once_until_it_changes(two_ggufs, monkeypatch):
    from lowbit import io
    from lowbit.files.gguf_read import gguf_digest

    path = two_ggufs[0]
    calls = []
    real = io.sha256_file
    monkeypatch.setattr(io, "sha256_file", lambda p, *a: calls.append(Path(p).name) or real(p, *a))
    digest = gguf_digest(path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() and calls == [path.name]
    assert gguf_digest(path) == digest and calls == [path.name]  # remembered under the file's identity
    memo = next((path.parent / "cache" / "lowbit" / "gguf" / ".digests").iterdir())
    memo.write_text(json.dumps({**json.loads(memo.read_text()), "ctime_ns": 1}))
    assert gguf_digest(path) == digest and calls == [path.name] * 2  # another identity: hashed again


def test_a_cache_entry_with_an_added_file_is_rebuilt(two_ggufs):
    from lowbit.models import load_model

    load_model(two_ggufs[0])
    (entry,) = cache_entries()
    (entry / "added_tokens.json").write_text('{"<evil>": 5}')
    with pytest.warns(UserWarning, match="holds files it did not write: added_tokens.json"):
        load_model(two_ggufs[0])
    assert not (cache_entries()[0] / "added_tokens.json").exists()


# ------------------------------------------------------------------ native checkpoints
@pytest.fixture
def checkpoint(tmp_path, tiny_tokenizer) -> Path:
    from lowbit.files.native import save
    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    model = make_llama(len(tiny_tokenizer), layers=1)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    replace_linears(model, Plan.uniform(names, "w4g32"))
    return save(model, tiny_tokenizer, tmp_path / "ckpt")


def test_every_file_of_a_checkpoint_is_checksummed(checkpoint):
    m = json.loads((checkpoint / "lowbit.json").read_text())
    on_disk = sorted(p.name for p in checkpoint.iterdir() if p.name not in ("lowbit.json", ".lowbit"))
    assert sorted(m["files"]) == on_disk and "config.json" in on_disk and "tokenizer.json" in on_disk
    assert m["checksums"] == "every file"


@pytest.mark.parametrize("command", ["eval", "inspect", "export"])
def test_an_edited_config_is_refused(checkpoint, tmp_path, capsys, command):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5  # the probe: perplexity moved 508.46 -> 510.50 with rc 0
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    args = {"eval": ["--windows", "1"], "inspect": [],
            "export": ["--to", "compressed-tensors", "--out", str(tmp_path / "ct")]}[command]
    assert main([command, str(checkpoint), *args]) == 2
    one_error(capsys, "config.json does not match its checksum")


def test_files_the_loaders_would_read_must_be_covered(checkpoint):
    from lowbit.files.native import load

    (checkpoint / "generation_config.json").write_text('{"eos_token_id": 3}')
    with pytest.raises(CheckpointError, match="generation_config.json is not covered by the checksums"):
        load(checkpoint)
    (checkpoint / "generation_config.json").unlink()
    (checkpoint / "README.md").write_text("my notes")  # not read by any loader: fine
    load(checkpoint)


def test_an_older_checkpoint_loads_with_a_warning(checkpoint):
    """Written by a lowbit that checksummed only the weights: kept usable, but not silently."""
    from lowbit.files.native import load

    m = json.loads((checkpoint / "lowbit.json").read_text())
    m["files"] = {"model.safetensors": m["files"]["model.safetensors"]}
    del m["checksums"]
    (checkpoint / "lowbit.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="older lowbit .* config.json, .* are not verified; re-create"):
        load(checkpoint)


def test_dropping_an_entry_from_a_new_manifest_is_refused(checkpoint):
    from lowbit.files.native import load

    m = json.loads((checkpoint / "lowbit.json").read_text())
    del m["files"]["config.json"]
    (checkpoint / "lowbit.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="config.json is not covered by the checksums"):
        load(checkpoint)


@pytest.mark.parametrize("edit,needle", [
    (lambda m, n: m["layers"][n].update(shape=[2 ** 31, 2 ** 31]), "stored codes is of shape"),
    (lambda m, n: m["layers"][n].update(shape=[64, 128]), "stored codes is of shape"),
    (lambda m, n: m["layers"].pop(n), "stores quantized codes"),
])
def test_inspect_cross_checks_the_manifest_against_the_tensors(checkpoint, capsys, edit, needle):
    m = json.loads((checkpoint / "lowbit.json").read_text())
    edit(m, "model.layers.0.self_attn.q_proj")
    (checkpoint / "lowbit.json").write_text(json.dumps(m))
    assert main(["inspect", str(checkpoint)]) == 2  # was rc 0, reporting 2147483648x2147483648 at 0 bits
    one_error(capsys, needle, "re-create it")


# ------------------------------------------------------------------ PTQ work folders
def test_a_block_file_that_is_not_safetensors_is_retuned(tmp_path):
    """The sidecar matches (the file was swapped with its checksum): the README promises a re-tune."""
    from ptq_helpers import calib, tiny_model, uniform
    from test_ptq_pipeline import same_weights

    from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise
    from lowbit.ptq.methods import RunContext
    from lowbit.ptq.signround import SignRoundTuner, make_config

    def run(model, workdir):
        cfg = make_config(iters=2, batch_size=4)
        return quantize_blockwise(model, uniform(model, "w4g32"), SignRoundTuner(cfg), {"config": cfg.to_dict()},
                                  RunContext(calib=calib(), workdir=workdir, progress=False), PipelineOptions(chunk=4))

    m = tiny_model(layers=2)
    full = copy.deepcopy(m)
    run(full, tmp_path / "w")
    for name, data in (("pickle", b"\x80\x04\x95 not safetensors at all"),
                       ("empty-header", b"\x02\x00\x00\x00\x00\x00\x00\x00{}")):
        block, sidecar = tmp_path / "w" / "block_0001.safetensors", tmp_path / "w" / "block_0001.json"
        block.write_bytes(data)
        sidecar.write_text(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))
        again = copy.deepcopy(m)
        with pytest.warns(UserWarning, match="block 1's saved result is unreadable .*again"):
            infos = run(again, tmp_path / "w")
        assert [i.get("resumed", 0.0) for i in infos] == [1.0, 0.0], name
        assert same_weights(full, again), name
