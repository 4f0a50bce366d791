"""Calibrated runs at any size: finished blocks written out and released, the memory estimate, the refusal."""

import json

import pytest
import torch
from conftest import checkpoint_tensors, kill_after_block0, quantize_json
from safetensors.torch import load_file

from lowbit.cli import main


@pytest.mark.parametrize("method", ["gptq", "signround2"])
def test_released_blocks_give_the_same_checkpoint(tmp_path, capsys, tiny_hf_dir, method, monkeypatch):
    """--offload-dir --no-eval writes each finished block out and empties it: the checkpoint (now one weight file
    per block) holds the same tensors as the in-memory run's, loads, and no tuned block stayed in memory."""
    from lowbit.ptq.blockwise import release

    extra = ["--no-search"] if method == "gptq" else ["--iters", "2", "--batch-size", "2"]
    common = [str(tiny_hf_dir), "--method", method, *extra, "--scheme", "w4g32", "--nsamples", "4", "--seqlen",
              "32", "--no-eval"]
    mem = quantize_json(capsys, *common, "--out", str(tmp_path / "mem"))
    held = []
    real = release.release_block

    def spy(model, prefix, i, block, folder):
        done = real(model, prefix, i, block, folder)
        blocks = model.model.layers
        held.append(sum(t.device.type != "meta" for b in blocks for t in b.state_dict().values()))
        return done

    monkeypatch.setattr("lowbit.ptq.blockwise.loop.release_block", spy)
    lazy = quantize_json(capsys, *common, "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "lazy"))
    assert held and max(held) == 0  # after each block: every block (finished or not yet read) on meta
    assert lazy["bits_per_weight"] == mem["bits_per_weight"]
    assert lazy["matmul_weights"] == mem["matmul_weights"]
    a, b = checkpoint_tensors(tmp_path / "mem"), checkpoint_tensors(tmp_path / "lazy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    files = json.loads((tmp_path / "lazy" / "lowbit.json").read_text())["weights"]
    assert files[0] == "model.safetensors" and len(files) == 3  # the rest, then one file per block
    assert not list((tmp_path / "off").glob("q_*"))  # moved into the checkpoint
    from lowbit.files.native import load

    ids = torch.arange(16).reshape(1, 16)
    m1, _ = load(tmp_path / "mem")
    m2, _ = load(tmp_path / "lazy")
    assert torch.equal(m1(ids).logits, m2(ids).logits)


@pytest.mark.parametrize("flags", [
    ["--method", "rtn"],  # the importance search (the default), block by block on the float chain
    ["--method", "rtn", "--awq"],
    ["--method", "gptq", "--no-search", "--rotate", "--rotate-online", "down_proj"],
    ["--method", "rtn", "--rotate", "--awq"],
])
def test_presteps_and_rtn_block_by_block_give_the_in_memory_checkpoint(tmp_path, capsys, tiny_hf_dir, flags):
    """RTN with importance, AWQ and the rotation on a lazily loaded model (--offload-dir --no-eval: every block
    read from the checkpoint, transformed, quantized, written out and released): the in-memory run's checkpoint,
    file content for file content, with the same summary of what the pre-steps did."""
    common = [str(tiny_hf_dir), *flags, "--scheme", "w4g32", "--nsamples", "4", "--seqlen", "32", "--no-eval"]
    mem = quantize_json(capsys, *common, "--out", str(tmp_path / "mem"))
    lazy = quantize_json(capsys, *common, "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "lazy"))
    assert lazy["bits_per_weight"] == mem["bits_per_weight"] and lazy["scheme"] == mem["scheme"]
    assert lazy["memory_estimate"]["flat_in_depth"] and not mem["memory_estimate"]["flat_in_depth"]
    a, b = checkpoint_tensors(tmp_path / "mem"), checkpoint_tensors(tmp_path / "lazy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if "--awq" in flags:
        assert {k: lazy["awq"][k] for k in ("groups", "scaled", "mean_error_ratio")} == {
            k: mem["awq"][k] for k in ("groups", "scaled", "mean_error_ratio")}
    if "--rotate" in flags:
        assert lazy["rotation"]["online_layers"] == mem["rotation"]["online_layers"]
        assert json.loads((tmp_path / "lazy" / "lowbit.json").read_text())["meta"]["rotation"] == json.loads(
            (tmp_path / "mem" / "lowbit.json").read_text())["meta"]["rotation"]
    assert json.loads((tmp_path / "lazy" / "lowbit.json").read_text())["weights"][1:]  # one file per block


def test_a_killed_awq_run_block_by_block_resumes_to_the_same_checkpoint(tmp_path, capsys, tiny_hf_dir, monkeypatch):
    """AWQ's scales and the method's codes of a block are kept together in --workdir: killed after block 0, the
    rerun replays block 0 (no search) and writes the uninterrupted run's checkpoint."""
    from lowbit.ptq import awq

    common = [str(tiny_hf_dir), "--method", "rtn", "--awq", "--rotate", "--scheme", "w4g32",
              "--nsamples", "4", "--seqlen", "32", "--no-eval", "--offload-dir", str(tmp_path / "off"),
              "--workdir", str(tmp_path / "wd")]
    real = kill_after_block0(monkeypatch)
    assert main(["quantize", *common, "--out", str(tmp_path / "a")]) == 130
    monkeypatch.setattr("lowbit.ptq.blockwise.loop.release_block", real)
    searched = []
    real_search = awq.search_scales
    monkeypatch.setattr(awq, "search_scales", lambda *a, **k: searched.append(1) or real_search(*a, **k))
    quantize_json(capsys, *common, "--out", str(tmp_path / "a"))
    assert len(searched) == 3  # block 1's groups only (grouped-query attention: no v -> o group)
    quantize_json(capsys, *[c for c in common if c not in (str(tmp_path / "wd"), "--workdir")], "--out", str(tmp_path / "b"))
    a, b = checkpoint_tensors(tmp_path / "a"), checkpoint_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # another pre-step setting is another run: refused, not mixed with the folder's blocks
    assert main(["quantize", *common, "--rotate-online", "down_proj", "--out", str(tmp_path / "c")]) == 2
    assert "holds a run with different settings" in capsys.readouterr().err


def test_rtn_without_data_is_not_taken_block_by_block(tmp_path, capsys, tiny_hf_dir):
    """Plain RTN (--no-search) without a rotation reads no data and turns nothing, so there is no walk for
    --offload-dir to serve: an error naming --stream, never a silently whole-model run (with --rotate it walks the
    blocks: tests/test_rtn_rotate_blockwise.py)."""
    assert main(["quantize", str(tiny_hf_dir), "--method", "rtn", "--no-search", "--offload-dir",
                 str(tmp_path / "off"), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "--offload-dir applies to" in err and "--stream" in err


def test_a_bf16_checkpoint_keeps_its_tables_in_bf16_and_writes_the_same_checkpoint(tmp_path, capsys, tiny_hf_dir,
                                                                                    monkeypatch):
    """A bf16 source: the released run holds the embeddings and lm_head in bf16 through the walk (the in-memory
    run in fp32) and writes the very files the in-memory run writes (same dtypes: lossless fp16 where it was)."""
    import shutil

    from safetensors.torch import save_file

    from lowbit.ptq.blockwise import release

    src = tmp_path / "bf16"
    shutil.copytree(tiny_hf_dir, src)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()},
              src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    common = [str(src), "--method", "gptq", "--no-search", "--scheme", "w4g32", "--nsamples", "4", "--seqlen", "32",
              "--no-eval"]
    quantize_json(capsys, *common, "--out", str(tmp_path / "mem"))
    held = []
    real = release.release_block

    def spy(model, prefix, i, block, folder):
        held.append((model.model.embed_tokens.weight.dtype, model.lm_head.weight.dtype))
        return real(model, prefix, i, block, folder)

    monkeypatch.setattr("lowbit.ptq.blockwise.loop.release_block", spy)
    quantize_json(capsys, *common, "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "lazy"))
    assert held and set(held) == {(torch.bfloat16, torch.bfloat16)}
    a, b = checkpoint_tensors(tmp_path / "mem"), checkpoint_tensors(tmp_path / "lazy")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert b["model.embed_tokens.weight"].dtype == torch.float16


def test_evaluated_lazy_runs_keep_their_blocks(tmp_path, capsys, tiny_hf_dir):
    """A perplexity pass needs the quantized model: the blocks are not released (one weight file)."""
    r = quantize_json(capsys, str(tiny_hf_dir), "--method", "gptq", "--no-search", "--scheme", "w4g32", "--nsamples", "4",
             "--seqlen", "32", "--eval-seqlen", "32", "--windows", "2", "--offload-dir", str(tmp_path / "off"),
             "--out", str(tmp_path / "q"))
    assert "ppl_q" in r
    assert "weights" not in json.loads((tmp_path / "q" / "lowbit.json").read_text())


# ------------------------------------------------------------------------------------------- the estimate

TINY = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, vocab_size=512, num_attention_heads=4,
            num_key_value_heads=2)


def test_shape_counts_the_parameters_a_model_has(tiny_hf_dir):
    """The config arithmetic gives the matmul weights a built model has, untied and tied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lowbit.ptq.memory import Shape

    for tie in (False, True):
        config = AutoConfig.from_pretrained(tiny_hf_dir)
        config.tie_word_embeddings = tie
        model = AutoModelForCausalLM.from_config(config)
        s = Shape.from_config(config)
        block = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
        assert s.block_params == block
        assert s.params == sum(p.numel() for p in model.parameters() if p.dim() == 2) + s.hidden  # + final norm


def test_the_lazy_estimate_is_flat_in_depth_and_grows_with_calibration():
    from lowbit.ptq.memory import Shape, estimate

    shallow, deep = Shape.from_config(TINY), Shape.from_config({**TINY, "num_hidden_layers": 400})
    for method in ("gptq", "signround2"):
        a, b = estimate(shallow, method, 16, 512), estimate(deep, method, 16, 512)
        assert a.peak == b.peak and a.flat  # only the disk grows with depth
        assert b.disk["offload"] == 100 * a.disk["offload"]
        more = estimate(shallow, method, 64, 512)
        assert more.parts["caches"] == 4 * a.parts["caches"]
    whole = estimate(deep, "gptq", 16, 512, lazy=False)
    assert not whole.flat and whole.parts["whole"] == deep.params * 4
    kept = estimate(deep, "gptq", 16, 512, evaluate=True)
    assert not kept.flat and kept.parts["quantized"] >= deep.layers * deep.block_params
    # RTN with data, AWQ and the rotation per block: flat in depth too
    for kw in ({}, {"awq": True}, {"rotate": True}):
        a, b = estimate(shallow, "rtn", 16, 512, **kw), estimate(deep, "rtn", 16, 512, **kw)
        assert a.peak == b.peak and a.flat, kw
    plain = estimate(shallow, "gptq", 16, 512)
    with_awq = estimate(shallow, "gptq", 16, 512, awq=True)
    assert with_awq.parts["caches"] == 3 * plain.parts["caches"]  # its own chain: the inputs and float outputs
    rotated = estimate(Shape.from_config({**TINY, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}), "gptq",
                       16, 512, rotate=True)
    # the embedding widened to fp32, the tied head untied into a bf16 copy, widened after the walk ("turn")
    assert rotated.parts["outside"] == 512 * 64 * (2 + 2) + 4 * 64  # the embedding held in fp16 once turned
    assert rotated.parts["turn"] >= 512 * 64 * 2 and rotated.peak >= sum(
        v for k, v in rotated.parts.items() if k not in ("save", "turn", "block", "caches", "forward", "method"))
    assert not estimate(deep, "rtn", 0, 0).flat  # RTN without data: the whole model
    # GPTQ caches the quantized chain alone, SignRound the float chain too
    assert estimate(shallow, "gptq", 16, 512).parts["caches"] * 2 == estimate(shallow, "signround2", 16, 512).parts[
        "caches"]


def test_the_tables_count_in_the_checkpoint_dtype(tmp_path):
    """A bf16 checkpoint's embeddings and lm_head are held in bf16 by a lazy run: half the fp32 bytes, the dtype
    from config.json or, where it names none, from the safetensors headers (a planned lm_head counts in fp32)."""
    from safetensors.torch import save_file

    from lowbit.ptq.memory import Shape, estimate, with_stored_dtype

    save_file({"model.embed_tokens.weight": torch.zeros(512, 64, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(64)}, tmp_path / "model.safetensors")
    cfg = with_stored_dtype(dict(TINY), tmp_path)
    assert cfg["torch_dtype"] == "bfloat16"
    assert with_stored_dtype(TINY | {"torch_dtype": "float32"}, tmp_path)["torch_dtype"] == "float32"
    bf16, f32 = Shape.from_config(cfg), Shape.from_config(TINY)
    outside = [estimate(s, "gptq", 4, 32).parts["outside"] for s in (bf16, f32)]
    assert outside == [512 * 64 * 2 * 2 + 4 * 64, 512 * 64 * 2 * 4 + 4 * 64]
    assert estimate(bf16, "gptq", 4, 32, lm_head=True).parts["outside"] == 512 * 64 * (2 + 4) + 4 * 64


def test_refusal_names_the_numbers():
    from lowbit.ptq.memory import GiB, Shape, estimate, refusal

    est = estimate(Shape.from_config(TINY), "gptq", 16, 512)
    assert refusal(est, 64 * GiB, {"out": 64 * GiB, "offload": 64 * GiB}) is None
    why = refusal(est, est.peak // 2, {})
    assert why and "of memory and" in why and f"{est.peak / 2 / GiB:.1f} GiB is available" in why
    why = refusal(est, None, {"out": 10, "offload": 64 * GiB})
    assert why.startswith("--out needs about") and "0.00 GiB free" in why
    why = refusal(est, None, {"out": 64 * GiB, "offload": 0})
    assert why.startswith("--offload-dir needs")
    whole = estimate(Shape.from_config(TINY), "gptq", 16, 512, lazy=False)
    assert "pass --offload-dir" in refusal(whole, 1, {})


def test_a_run_the_machine_cannot_hold_is_refused_before_loading(tmp_path, capsys, tiny_hf_dir, monkeypatch):
    """Too little memory (MemAvailable faked) or disk: exit 2, one line with the numbers, nothing written."""
    import shutil
    from collections import namedtuple

    monkeypatch.setattr("lowbit.ptq.memory.mem_available", lambda: 1 << 20)
    argv = ["quantize", str(tiny_hf_dir), "--method", "gptq", "--nsamples", "4", "--seqlen", "32", "--no-eval",
            "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "q")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "of memory and 0.0 GiB is available (MemAvailable)" in err[0]
    assert not (tmp_path / "q").exists() and not (tmp_path / "off").exists()
    monkeypatch.setattr("lowbit.ptq.memory.mem_available", lambda: 1 << 40)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 1000))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out needs about" in err[0] and "free some space" in err[0]


def test_the_refusal_names_the_flag_that_loads_the_whole_model(tmp_path, capsys, tiny_hf_dir, monkeypatch):
    """--awq, --rotate and --avg-bits (its DeltaLoss passes block by block, `lowbit.ptq.streamed_deltaloss`) no
    longer need the whole float model: their refusal is the block-wise one, with the numbers."""
    monkeypatch.setattr("lowbit.ptq.memory.mem_available", lambda: 1 << 20)
    common = ["quantize", str(tiny_hf_dir), "--nsamples", "4", "--seqlen", "32", "--no-eval", "--offload-dir",
              str(tmp_path / "off"), "--out", str(tmp_path / "q")]
    for flags in (["--method", "gptq", "--awq"], ["--method", "rtn", "--rotate"],
                  ["--method", "gptq", "--avg-bits", "4", "--options", "w4g32,w8"]):
        assert main([*common, *flags]) == 2
        err = capsys.readouterr().err
        assert "of memory and 0.0 GiB is available" in err and "whole float model" not in err, flags


def test_a_killed_released_run_resumes_to_the_same_checkpoint(tmp_path, capsys, tiny_hf_dir, monkeypatch):
    """--workdir with released blocks: killed after block 0 was written out, the rerun replays it and writes the
    checkpoint the uninterrupted run writes."""

    common = [str(tiny_hf_dir), "--method", "gptq", "--no-search", "--scheme", "w4g32", "--nsamples", "4",
              "--seqlen", "32", "--no-eval", "--offload-dir", str(tmp_path / "off"), "--workdir", str(tmp_path / "wd")]
    real = kill_after_block0(monkeypatch)
    assert main(["quantize", *common, "--out", str(tmp_path / "a")]) == 130
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr("lowbit.ptq.blockwise.loop.release_block", real)
    quantize_json(capsys, *common, "--out", str(tmp_path / "a"))
    quantize_json(capsys, *[c for c in common if c != str(tmp_path / "wd") and c != "--workdir"], "--out", str(tmp_path / "b"))
    a, b = checkpoint_tensors(tmp_path / "a"), checkpoint_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_caches_on_disk_give_the_same_checkpoint_and_are_chosen_when_only_they_do_not_fit(
        tmp_path, capsys, tiny_hf_dir, monkeypatch):
    """--cache-device disk: the activations live in memory-mapped files in --offload-dir (unlinked once mapped:
    nothing left), same checkpoint; a machine whose memory holds all but the caches gets them there by itself."""
    from lowbit.api.quantize import QuantizeJob, job_estimate
    from lowbit.ptq.blockwise import cache

    made = []
    real = cache._file_tensor
    monkeypatch.setattr(cache, "_file_tensor", lambda *a: made.append(a[1]) or real(*a))
    common = [str(tiny_hf_dir), "--method", "signround2", "--iters", "2", "--batch-size", "2", "--scheme", "w4g32",
              "--nsamples", "4", "--seqlen", "32", "--no-eval", "--offload-dir", str(tmp_path / "off")]
    quantize_json(capsys, *common, "--out", str(tmp_path / "ram"))
    assert not made
    quantize_json(capsys, *common, "--cache-device", "disk", "--out", str(tmp_path / "disk"))
    assert len(made) == 2 and made[0] == (4, 32, 64)  # X_q and the float chain, [nsamples, seqlen, hidden]
    assert not list((tmp_path / "off").glob("cache_*"))
    a, b = checkpoint_tensors(tmp_path / "ram"), checkpoint_tensors(tmp_path / "disk")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from lowbit.api.common import Calibration
    from lowbit.api.quantize import check_memory
    from lowbit.ptq.memory import caches_on_disk

    big = QuantizeJob(out=tmp_path / "x", model=str(tiny_hf_dir), method="signround2", evaluation=None,
                      offload_dir=str(tmp_path / "off"), calib=Calibration(nsamples=1024, seqlen=2048))
    est = job_estimate(big)
    room = int(caches_on_disk(est).peak * 1.1) + 1
    assert room < est.peak * 1.1
    monkeypatch.setattr("lowbit.ptq.memory.mem_available", lambda: room)
    with pytest.warns(UserWarning, match="kept in files in --offload-dir"):
        need, job = check_memory(big)
    assert job.cache_device == "disk" and "caches" not in need.parts
    assert need.disk["offload"] == est.disk["offload"] + est.parts["caches"]


_FRAGMENT = """
import random, torch
from lowbit.ptq.blockwise.release import give_back_free_memory

def rss():
    return next(int(x.split()[1]) << 10 for x in open("/proc/self/status") if x.startswith("VmRSS:"))

random.seed(0)
big = torch.ones(30 << 20, dtype=torch.uint8)
del big  # glibc raises its mmap threshold to a freed mapping's size: the tensors below land in its heap
keep = []
for _ in range(3):  # blocks: tensors freed after use, a few small ones kept alive between them (as a walk does)
    tmp = []
    for i in range(40):
        tmp.append(torch.ones(random.randint(1 << 19, 8 << 20), dtype=torch.uint8))
        if i % 10 == 0:
            keep.append(torch.ones(4096, dtype=torch.uint8))
    del tmp
before = rss()
print(give_back_free_memory(), before, rss())
"""


def test_freed_pages_go_back_to_the_kernel_after_a_block():
    """The walk's per-block RSS growth was the allocator keeping freed chunks (bytes in use flat): handing them
    back drops the resident set of a process that fragmented its heap as a block does."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, check=True).stdout.split()
    if out[0] != "True":
        pytest.skip("no malloc_trim in this C library")
    before, after = int(out[1]), int(out[2])
    assert before - after > 100 << 20, (before >> 20, after >> 20)


_MAPPED = """
import ctypes, torch
from lowbit.ptq.blockwise.release import steady_allocator

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
try:
    info = ctypes.CDLL(None).mallinfo2
except AttributeError:
    raise SystemExit("skip")
info.restype = Info
big = torch.ones(30 << 20, dtype=torch.uint8)
del big  # glibc raises its mmap threshold to this freed mapping's size
n = info().hblks
a = torch.ones(8 << 20, dtype=torch.uint8)
heap = info().hblks - n  # 0: an 8 MiB tensor now comes from the heap
fixed = steady_allocator()
n = info().hblks
b = torch.ones(8 << 20, dtype=torch.uint8)
print(fixed, heap, info().hblks - n)
"""


def test_a_steady_allocator_maps_the_mid_sized_tensors_a_block_frees():
    """After glibc has raised its mmap threshold, an 8 MiB tensor lands in the heap (where freed blocks leave holes
    that fragment it block after block); once the threshold is fixed at 4 MiB it is mapped, and unmapped when freed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MAPPED], capture_output=True, text=True, check=True).stdout.split()
    if out == ["skip"] or out[0] != "True":
        pytest.skip("no mallinfo2 / mallopt in this C library")
    assert out[1:] == ["0", "1"], out


def test_a_released_walk_fixes_the_allocator_threshold_once(tmp_path, capsys, tiny_hf_dir, monkeypatch):
    calls = []
    monkeypatch.setattr("lowbit.ptq.blockwise.loop.steady_allocator", lambda: calls.append(1) or True)
    quantize_json(capsys, str(tiny_hf_dir), "--method", "gptq", "--no-search", "--scheme", "w4g32", "--nsamples", "4",
         "--seqlen", "32", "--no-eval", "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "o"))
    assert calls == [1]


def test_the_walk_gives_free_memory_back_after_every_block(tmp_path, capsys, tiny_hf_dir, monkeypatch):
    calls = []
    monkeypatch.setattr("lowbit.ptq.blockwise.loop.give_back_free_memory", lambda: calls.append(1) or True)
    quantize_json(capsys, str(tiny_hf_dir), "--method", "gptq", "--no-search", "--scheme", "w4g32", "--nsamples", "4",
         "--seqlen", "32", "--no-eval", "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "o"))
    blocks = json.loads((tiny_hf_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(calls) == blocks
