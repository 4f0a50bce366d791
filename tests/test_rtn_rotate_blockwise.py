"""Data-free RTN with rotations on a lazily loaded model, block by block: the whole-model path's checkpoint."""

import json

import pytest
import torch
from conftest import checkpoint_tensors, kill_after_block0, make_llama, make_tokenizer, quantize_json
from safetensors.torch import load_file, save_file

from lowbit.cli import main


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """dtype + tie -> a tiny llama folder (3 blocks, norms that are not all ones, so folding them matters and
    --rotate-keep has quiet channels to find: channel 5 switched off in every norm)."""
    tok = make_tokenizer()
    out = {}
    for tie in (True, False):
        m = make_llama(len(tok), layers=3, tie=tie)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("norm.weight"):
                    p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(n))) + 0.5)
                    p[5] = 1e-4
        for dtype in ("float32", "bfloat16"):
            path = tmp_path_factory.mktemp("hf") / f"{dtype}-{'tied' if tie else 'untied'}"
            m.save_pretrained(path)
            tok.save_pretrained(path)
            if dtype == "bfloat16":
                save_file({k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()},
                          path / "model.safetensors", metadata={"format": "pt"})
                cfg = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "bfloat16", "dtype": "bfloat16"}))
            out[dtype, tie] = path
    return out


CASES = [
    ("float32", True, ["--rotate"], "w4g32"),
    ("float32", False, ["--rotate", "--rotate-online", "down_proj"], "w4g32"),
    ("bfloat16", True, ["--rotate", "--rotate-keep", "auto"], "w4g32"),
    ("bfloat16", False, ["--rotate", "--rotate-keep", "32", "--rotate-online", "down_proj"], "w4g32:rule=search"),
    ("float32", True, ["--rotate-online", "down_proj"], "w4g32:rule=search"),  # the online rotations alone
    ("bfloat16", True, ["--rotate", "--lm-head"], "q4_k"),
]


@pytest.mark.parametrize(("dtype", "tie", "flags", "scheme"), CASES)
def test_rotated_rtn_without_data_block_by_block_gives_the_in_memory_checkpoint(tmp_path, capsys, folders, monkeypatch,
                                                                                dtype, tie, flags, scheme):
    """--method rtn --no-search with the rotation on a lazily loaded model (--offload-dir --no-eval): every block
    read, rotated, rounded, written out and released, one at a time; the in-memory run's files, tensor for tensor
    (dtypes too), the same rotation recorded, and no calibration data read."""
    from lowbit.api import common
    from lowbit.ptq.blockwise import release

    src = folders[dtype, tie]
    base = [str(src), "--method", "rtn", "--no-search", *flags, "--scheme", scheme, "--no-eval"]
    mem = quantize_json(capsys, *base, "--out", str(tmp_path / "mem"))
    held = []
    real = release.release_block

    def spy(model, prefix, i, block, folder):
        done = real(model, prefix, i, block, folder)
        held.append(sum(t.device.type != "meta" for b in model.model.layers for t in b.state_dict().values()))
        return done

    monkeypatch.setattr("lowbit.ptq.blockwise.loop.release_block", spy)
    monkeypatch.setattr(common.Calibration, "batches", lambda *a, **k: pytest.fail("calibration data was read"))
    lazy = quantize_json(capsys, *base, "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "lazy"))
    assert held == [0, 0, 0]  # after each block: every block (finished or not yet read) on meta
    assert lazy["memory_estimate"]["flat_in_depth"] and not mem["memory_estimate"]["flat_in_depth"]
    assert lazy["memory_estimate"]["parts"]["caches"] == 0
    assert lazy["bits_per_weight"] == mem["bits_per_weight"] and lazy["scheme"] == mem["scheme"]
    a, b = checkpoint_tensors(tmp_path / "mem"), checkpoint_tensors(tmp_path / "lazy")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    meta = [json.loads((tmp_path / d / "lowbit.json").read_text()) for d in ("mem", "lazy")]
    assert meta[0]["meta"]["rotation"] == meta[1]["meta"]["rotation"]
    assert len(meta[1]["weights"]) == 4  # the rest, then one file per block
    for k in ("online_layers", "kept_channels", "untied_head", "rotated_width"):
        assert lazy["rotation"].get(k) == mem["rotation"].get(k), k
    assert lazy["rotation"]["probe_rel_diff"] < 1e-5 and "no calibration data" in lazy["rotation"]["probe"]
    if "--rotate-keep" in flags:
        assert 5 in lazy["rotation"]["kept_channels"]


def test_a_killed_run_resumes_to_the_same_checkpoint(tmp_path, capsys, folders, monkeypatch):
    """--workdir: killed after block 0 was written out, the rerun takes block 0's codes from the folder (rounds
    blocks 1 and 2 only) and writes the uninterrupted run's checkpoint; other rotation settings are another run."""
    from lowbit.ptq.blockwise import rounding

    base = [str(folders["bfloat16", True]), "--method", "rtn", "--no-search", "--rotate", "--scheme", "w4g32",
            "--no-eval", "--offload-dir", str(tmp_path / "off"), "--workdir", str(tmp_path / "wd")]
    real = kill_after_block0(monkeypatch)
    assert main(["quantize", *base, "--out", str(tmp_path / "a")]) == 130
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr("lowbit.ptq.blockwise.loop.release_block", real)
    rounded = []
    real_quantize = rounding.quantize
    monkeypatch.setattr(rounding, "quantize", lambda w, *a: rounded.append(w.shape) or real_quantize(w, *a))
    quantize_json(capsys, *base, "--out", str(tmp_path / "a"))
    assert len(rounded) == 2 * 7  # blocks 1 and 2: seven Linears each
    quantize_json(capsys, *[c for c in base if c not in (str(tmp_path / "wd"), "--workdir")], "--out", str(tmp_path / "b"))
    a, b = checkpoint_tensors(tmp_path / "a"), checkpoint_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["quantize", *base, "--rotate-online", "down_proj", "--out", str(tmp_path / "c")]) == 2
    assert "holds a run with different settings" in capsys.readouterr().err


def test_what_the_data_free_walk_cannot_honour_is_refused(tmp_path, capsys, folders):
    """Without a rotation there is nothing for the walk to do that --stream does not (an error naming it); the
    walk holds no activation caches for --cache-device to place; --stream with a rotation names the walk."""
    src = str(folders["float32", True])
    common = [src, "--method", "rtn", "--no-search", "--no-eval", "--offload-dir", str(tmp_path / "off"),
              "--out", str(tmp_path / "q")]
    assert main(["quantize", *common]) == 2
    err = capsys.readouterr().err
    assert "--offload-dir applies to" in err and "--stream" in err
    assert main(["quantize", *common, "--rotate", "--cache-device", "cpu"]) == 2
    assert "drop --cache-device" in capsys.readouterr().err
    for flags in (["--rotate"], ["--rotate-online", "down_proj"]):  # --stream does not rotate: the walk is named
        assert main(["quantize", src, "--stream", *flags, "--out", str(tmp_path / "q")]) == 2
        err = capsys.readouterr().err
        assert f"--stream does not rotate ({flags[0]})" in err and "--offload-dir DIR --no-eval" in err
    assert not (tmp_path / "q").exists()


def test_the_library_path_holds_one_block_and_gives_the_whole_model_weights(tmp_path, folders):
    """`quantize_model` on a lazily loaded model with a rotation and no data: one block's float weights at a time
    and the whole-model run's quantized model, state for state and logit for logit."""
    from ptq_helpers import uniform

    from lowbit.models.lazy import is_lazy, load_lazy
    from lowbit.models.loading import load_model
    from lowbit.ptq import quantize_model
    from lowbit.ptq.rotation import RotationSettings

    src = folders["float32", False]
    ref = load_model(str(src)).model
    plan = uniform(ref, "w4g32")
    rot = RotationSettings(online=("down_proj",))
    quantize_model(ref, plan, "rtn", {"search": False}, rotate=rot, progress=False)
    lazy = load_lazy(src)
    assert is_lazy(lazy)
    read = []
    for b in lazy.model.layers:  # how many other blocks hold float weights while one is rounded
        b.register_forward_pre_hook(lambda mod, *_: read.append(sum(
            1 for other in lazy.model.layers if other is not mod
            for p in other.parameters() if p.device.type != "meta" and p.dim() == 2 and p.dtype == torch.float32)))
    quantize_model(lazy, plan, "rtn", {"search": False}, rotate=rot, progress=False)
    assert read == [0, 0]  # block 0 runs twice (the probe before and after its rotation), no other block runs
    a, b = ref.state_dict(), lazy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    ids = torch.arange(24).reshape(2, 12)
    assert torch.equal(ref(ids).logits, lazy(ids).logits)
    # the rotated tables hold their fp16 values in fp16 (half the float32 bytes), widened where they are used
    assert lazy.model.embed_tokens.weight.dtype == lazy.lm_head.weight.dtype == torch.float16
    assert ref.model.embed_tokens.weight.dtype == torch.float32
    # keep16=False: the whole-model path keeps the rotated tables' float32 values, and so does the walk
    ref = load_model(str(src)).model
    quantize_model(ref, plan, "rtn", {"search": False}, rotate=rot, progress=False, keep16=False)
    lazy = load_lazy(src)
    quantize_model(lazy, plan, "rtn", {"search": False}, rotate=rot, progress=False, keep16=False)
    assert lazy.model.embed_tokens.weight.dtype == lazy.lm_head.weight.dtype == torch.float32
    a, b = ref.state_dict(), lazy.state_dict()
    assert all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_the_estimate_of_the_data_free_walk_and_its_refusal(tmp_path, capsys, folders, monkeypatch):
    """No caches and no forward, the rotation's tables and one block: flat in depth, below the whole-model run's
    at a real shape; refused up front with the numbers and --stream named as what holds less."""
    from lowbit.ptq.memory import EXAMPLES, Shape, estimate

    s = Shape.from_config(EXAMPLES["8B (Llama-3.1)"])
    walk = estimate(s, "rtn", 0, 0, rotate=True)
    whole = estimate(s, "rtn", 0, 0, rotate=True, lazy=False)
    deep = estimate(Shape.from_config({**EXAMPLES["8B (Llama-3.1)"], "num_hidden_layers": 80}), "rtn", 0, 0,
                    rotate=True)
    assert walk.flat and walk.parts["caches"] == 0 and walk.parts["forward"] == 0 and walk.parts["turn"] > 0
    assert walk.peak == deep.peak and walk.peak < whole.peak / 4
    assert not estimate(s, "rtn", 0, 0, rotate=False).flat  # without a rotation: the whole model (--stream instead)
    monkeypatch.setattr("lowbit.ptq.memory.mem_available", lambda: 1 << 20)
    assert main(["quantize", str(folders["float32", True]), "--method", "rtn", "--no-search", "--rotate", "--no-eval",
                 "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "of memory and 0.0 GiB is available" in err[0] and "--stream" in err[0]
    assert "whole float model" not in err[0] and "--nsamples" not in err[0]
