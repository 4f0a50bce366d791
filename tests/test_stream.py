"""The data-free streaming path (`lowbit quantize --stream`, `lowbit.ptq.stream`).

Reference: the in-model RTN path (`lowbit.ptq.conductor.conduct` on the model transformers
loads, then `lowbit.files.native.save`) on the same folder and scheme: the streamed checkpoint
must hold the same tensors, byte for byte and dtype for dtype, and the same manifest entries.
Quantized sources: an FP8 (block / channel / tensor scaled) or MXFP4 source must give the
same output as its float dequantization saved as a float32 checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_accounting import make

from lowbit.api.stream import StreamJob, stream_quantize
from lowbit.cli import main
from lowbit.errors import ModelError
from lowbit.files import native
from lowbit.io import OutputError
from lowbit.models.accounting import gate
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan, plan_source
from lowbit.ptq import stream
from lowbit.ptq.conductor import PtqSpec, conduct
from lowbit.ptq.methods import RunContext
from lowbit.ptq.rtn import searched


def _saved(arch: str, path, shard: str = "40KB", dtype=torch.bfloat16):
    make(arch).to(dtype).save_pretrained(path, max_shard_size=shard)
    return path


def _in_model(src, scheme: str, out, search: bool = True):
    """What `lowbit quantize --method rtn` writes (search on the weights alone: uniform importance)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    plan = build_plan(model, plan_source(scheme))
    dropped = gate(model, list(plan))
    plan = Plan({n: r for n, r in plan.items() if n not in dropped})
    conduct(model, searched(plan) if search else plan, PtqSpec("rtn", {"search": False}), RunContext(progress=False))
    return native.save(model, None, out)


def _tensors(folder) -> dict[str, torch.Tensor]:
    m = json.loads((folder / native.MANIFEST).read_text())
    out: dict[str, torch.Tensor] = {}
    for f in native.weight_files(m):
        out.update(load_file(folder / f))
    return out


def _same(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert set(ta) == set(tb)
    bad = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not bad, bad[:5]
    ma, mb = (json.loads((f / native.MANIFEST).read_text()) for f in (a, b))
    assert ma["layers"] == mb["layers"] and ma["aliases"] == mb["aliases"]


def _stream(src, out, scheme: str, **kw):
    return stream_quantize(StreamJob(model=src, out=out, scheme=scheme, progress=False, shard_mb=0.02, **kw))


@pytest.mark.parametrize(("arch", "scheme"), [("llama", "w4g8"), ("llama", "nvfp4-46"), ("llama", "fp8"),
                                              ("qwen3_moe", "w4g8"), ("qwen3_moe", "nvfp4-46"), ("mixtral", "w4g8"),
                                              ("qwen2_moe", "nvfp4"), ("gpt_oss", "w4g8")])
def test_streamed_checkpoint_is_the_in_model_rtn_checkpoint(tmp_path, arch, scheme):
    """Per-expert keys on disk (qwen3_moe, qwen2_moe, mixtral's w1/w3/w2) and gpt-oss's fused transposed ones become
    the fused expert entries the in-model path stores; tied embeddings stay an alias; NVFP4's q/k/v and gate/up share
    their tensor scale; several shards on both sides."""
    src = _saved(arch, tmp_path / "src")
    assert len(list(src.glob("model-*.safetensors"))) > 1
    s = _stream(src, tmp_path / "stream", scheme)
    _same(_in_model(src, scheme, tmp_path / "ref"), tmp_path / "stream")
    assert s["source_precision"] == {"bfloat16": s["source_precision"]["bfloat16"]}
    assert s["matmul_weights"]["float"].keys() <= {"embeddings", "lm_head", "router"}
    model, _ = native.load(tmp_path / "stream")  # it loads, checksums verified
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
    if arch == "llama":  # transformers' loader of lowbit checkpoints reads the shards too
        from transformers import AutoModelForCausalLM

        import lowbit  # noqa: F401  (registers the loader)

        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "stream")
        ids = torch.tensor([[1, 2, 3]])
        assert torch.equal(hf(ids).logits, model(ids).logits)


@pytest.mark.parametrize("arch", ("llama", "qwen3_moe"))
def test_big_float_tensors_read_in_pieces_store_the_same_bytes(tmp_path, monkeypatch, arch):
    """Embeddings, a float lm_head and norms above the piece size are converted piece by piece (an 8B model's
    embedding table is never whole in float32): the same stored bytes and dtypes."""
    monkeypatch.setattr(stream, "_CHUNK", 16)
    src = _saved(arch, tmp_path / "src")
    _stream(src, tmp_path / "stream", "w4g8", search=False)
    _same(_in_model(src, "w4g8", tmp_path / "ref", search=False), tmp_path / "stream")


@pytest.mark.parametrize("chunk", [None, 16])
def test_float_tensors_stay_in_the_bf16_source_dtype(tmp_path, monkeypatch, chunk):
    """An embedding table beyond fp16's range from a bf16 source is not rounded to fp16 (it would overflow); it is
    stored in bf16, its source dtype, exactly, not widened to float32: the same in and out of the streaming path
    (read whole, or in pieces), and it loads back to the same values."""
    if chunk is not None:
        monkeypatch.setattr(stream, "_CHUNK", chunk)
    model = make("llama").to(torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 5] = 1e5
    model.save_pretrained(tmp_path / "src", max_shard_size="40KB")
    _stream(tmp_path / "src", tmp_path / "stream", "w4g8", search=False)
    _same(_in_model(tmp_path / "src", "w4g8", tmp_path / "ref", search=False), tmp_path / "stream")
    table = _tensors(tmp_path / "stream")["model.embed_tokens.weight"]
    assert table.dtype == torch.bfloat16 and torch.equal(table, model.model.embed_tokens.weight.detach())
    loaded, _ = native.load(tmp_path / "stream")
    assert torch.equal(loaded.model.embed_tokens.weight, table.float())
    assert loaded(torch.tensor([[1, 3, 5]])).logits.isfinite().all()


def test_keep_experts_writes_them_fused_in_float_as_the_in_model_path(tmp_path):
    """--keep experts: the per-expert keys on disk become the model's fused float tensors."""
    from transformers import AutoModelForCausalLM

    src = _saved("qwen3_moe", tmp_path / "src")
    s = _stream(src, tmp_path / "stream", "w4g8", search=False, keep=("experts",))
    assert "experts" in s["matmul_weights"]["float"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    plan = build_plan(model, plan_source("w4g8"))
    dropped = gate(model, list(plan), ("experts",))
    conduct(model, Plan({n: r for n, r in plan.items() if n not in dropped}), PtqSpec("rtn", {"search": False}),
            RunContext(progress=False))
    _same(native.save(model, None, tmp_path / "ref"), tmp_path / "stream")


def test_kquant_mix_and_plain_rtn_match_too(tmp_path):
    """A llama.cpp mix (per-layer K types: the K-quants' default ``fit`` rule), plain K-quant ranges, and INT; all
    with --no-search (the K-quant search takes minutes here)."""
    import transformers as tf
    from test_accounting import SMALL

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**{**SMALL, "hidden_size": 256, "vocab_size": 64}, intermediate_size=256)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src", max_shard_size="300KB")
    _stream(tmp_path / "src", tmp_path / "a", "q4_k_m", search=False)
    _same(_in_model(tmp_path / "src", "q4_k_m", tmp_path / "ra", search=False), tmp_path / "a")
    assert {r["scheme"].get("rule") for r in json.loads((tmp_path / "a" / native.MANIFEST).read_text())["layers"].values()
            if r["scheme"].get("super_block")} == {"fit"}
    _stream(tmp_path / "src", tmp_path / "c", "q3_k:rule=absmax", search=False)
    _same(_in_model(tmp_path / "src", "q3_k:rule=absmax", tmp_path / "rc", search=False), tmp_path / "c")
    _stream(tmp_path / "src", tmp_path / "b", "w4g32", search=False)
    _same(_in_model(tmp_path / "src", "w4g32", tmp_path / "rb", search=False), tmp_path / "b")


# ------------------------------------------------------------------ quantized sources

def _fp8_source(src, dst, layout: str) -> None:
    """``src``'s Linear weights as FP8 E4M3 with DeepSeek's block scales or compressed-tensors' channel / tensor ones."""
    import shutil

    shutil.copytree(src, dst)
    for f in dst.glob("model*.safetensors"):
        t = load_file(f)
        out = {}
        for k, w in t.items():
            if not (k.endswith("proj.weight") and w.dim() == 2):
                out[k] = w
                continue
            w = w.float()
            if layout == "block":
                rows, cols = -(-w.shape[0] // 16), -(-w.shape[1] // 16)  # 16x16 blocks on the tiny model
                amax = torch.zeros(rows, cols)
                for i in range(rows):
                    for j in range(cols):
                        amax[i, j] = w[16 * i:16 * i + 16, 16 * j:16 * j + 16].abs().amax()
                s = amax.clamp_min(1e-8) / 448
                full = s.repeat_interleave(16, 0)[:w.shape[0]].repeat_interleave(16, 1)[:, :w.shape[1]]
                out[k], out[k.replace("weight", "weight_scale_inv")] = (w / full).to(torch.float8_e4m3fn), s
            else:
                s = (w.abs().amax(1, keepdim=True) if layout == "channel" else w.abs().amax().reshape(1)) / 448
                out[k], out[k.replace("weight", "weight_scale")] = (w / s).to(torch.float8_e4m3fn), s
                out[k.replace("weight", "input_scale")] = torch.ones(1)  # a static activation scale: ignored
        save_file(out, f, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    m = json.loads(index.read_text())
    for f in dst.glob("model*.safetensors"):
        for k in load_file(f):
            m["weight_map"][k] = f.name
    index.write_text(json.dumps(m))


def _dequantized_copy(src, dst) -> None:
    """``src`` (a quantized source) as float32 safetensors of its dequantized values, the reference input."""
    import shutil

    from lowbit.models.stream_source import StreamSource

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model*"))
    s = StreamSource.open(src)
    names = {n.removesuffix("_blocks").removesuffix("_packed") for n in s.entries
             if not n.endswith(("_scales", "_scale", "_scale_inv", "_zero_point", "_global_scale", "_shape"))}
    mxfp4 = {n.removesuffix("_blocks") for n in s.entries if n.endswith("_blocks")}  # [E, out, in] -> gpt-oss's [E, in, out]
    save_file({n: (s.tensor(n).transpose(1, 2) if n in mxfp4 else s.tensor(n)).contiguous() for n in names},
              dst / "model.safetensors")


@pytest.mark.parametrize("layout", ("block", "channel", "tensor"))
def test_fp8_source_requantizes_as_its_float_dequantization(tmp_path, layout):
    src = _saved("llama", tmp_path / "src", dtype=torch.float32)
    _fp8_source(src, tmp_path / "fp8", layout)
    _dequantized_copy(tmp_path / "fp8", tmp_path / "deq")
    s = _stream(tmp_path / "fp8", tmp_path / "a", "w4g8")
    _stream(tmp_path / "deq", tmp_path / "b", "w4g8")
    _same(tmp_path / "a", tmp_path / "b")
    block = {"block": "per block", "channel": "per channel", "tensor": "per tensor"}[layout]
    assert s["source_precision"][f"fp8 float8_e4m3fn {block}"] == 14  # 7 Linears x 2 blocks
    meta = json.loads((tmp_path / "a" / native.MANIFEST).read_text())["meta"]
    assert meta["source_precision"] == s["source_precision"]


def _mxfp4_source(tmp_path):
    """A gpt-oss folder whose experts are MXFP4 in gpt-oss's layout (``_blocks`` / ``_scales``, [E, out, in])."""
    import transformers as tf
    from test_accounting import SMALL

    from lowbit.formats import quantize
    from lowbit.formats.grids import e2m1_table

    torch.manual_seed(0)
    cfg = tf.GptOssConfig(**SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    src = tmp_path / "src"
    tf.GptOssForCausalLM(cfg).save_pretrained(src)
    t = load_file(src / "model.safetensors")
    lut = e2m1_table()
    for k in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = t.pop(k).transpose(1, 2)  # [E, out, in]
        blocks, scales = [], []
        for e in range(w.shape[0]):
            q = quantize(w[e], "mxfp4")
            vals = q.dequantize()
            s = torch.exp2(torch.floor(torch.log2(q.scales.clamp_min(2.0**-127))))
            codes = (vals.reshape(*q.scales.shape, 32) / s.unsqueeze(-1)).unsqueeze(-1).sub(lut).abs()
            codes = codes.argmin(-1).to(torch.uint8)  # value -> E2M1 code (0 -> +0)
            blocks.append((codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8))
            scales.append((torch.log2(s) + 127).to(torch.uint8))
        t[f"{k}_blocks"], t[f"{k}_scales"] = torch.stack(blocks), torch.stack(scales)
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    return src


def test_mxfp4_source_to_mxfp4_is_bit_exact(tmp_path):
    """gpt-oss MXFP4 experts requantized to MXFP4: the values are the source's exactly, and the output is the one
    its float dequantization gives."""
    src = _mxfp4_source(tmp_path)
    _dequantized_copy(src, tmp_path / "deq")
    s = _stream(src, tmp_path / "a", "mxfp4")
    _stream(tmp_path / "deq", tmp_path / "b", "mxfp4")
    _same(tmp_path / "a", tmp_path / "b")
    assert s["source_precision"]["mxfp4"] == 4  # gate_up and down of two layers
    model, _ = native.load(tmp_path / "a")
    from lowbit.models.stream_source import StreamSource

    source = StreamSource.open(src)
    for name, stack in ((n, m) for n, m in model.named_modules() if type(m).__name__ == "QuantStack"):
        want = source.tensor(name)  # [E, out, in], the source's own values
        assert torch.equal(stack.dequantize(), want)


# ------------------------------------------------------------------ bad input, resume

def test_missing_shard_and_stale_index_are_refused_before_any_work(tmp_path):
    src = _saved("llama", tmp_path / "src")
    index = src / "model.safetensors.index.json"
    m = json.loads(index.read_text())
    m["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(m["weight_map"].values()))
    index.write_text(json.dumps(m))
    with pytest.raises(ModelError, match="names tensor 'model.layers.9.mlp.up_proj.weight' in .* no shard holds it"):
        _stream(src, tmp_path / "out", "w4g8")
    sorted(src.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(ModelError, match="names the weight file 'model-00002"):
        _stream(src, tmp_path / "out", "w4g8")
    assert not (tmp_path / "out").exists()


def test_a_source_type_lowbit_cannot_dequantize_is_named(tmp_path):
    src = _saved("llama", tmp_path / "src", shard="10MB")
    t = load_file(src / "model.safetensors")
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 4, dtype=torch.int32)  # a packed int layout
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"up_proj.weight is stored as torch.int32.*cannot dequantize"):
        _stream(src, tmp_path / "out", "w4g8")


def test_a_nonfinite_source_weight_is_named_and_nothing_is_written(tmp_path):
    src = _saved("llama", tmp_path / "src", shard="10MB", dtype=torch.float32)
    t = load_file(src / "model.safetensors")
    t["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("nan")
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"o_proj.weight holds 1 NaN/inf"):
        _stream(src, tmp_path / "out", "w4g8")
    assert not (tmp_path / "out").exists()


def test_too_little_disk_is_refused_with_the_numbers(tmp_path, monkeypatch):
    import lowbit.io

    src = _saved("llama", tmp_path / "src")
    monkeypatch.setattr(lowbit.io, "_free_bytes", lambda folder: 1000)
    with pytest.raises(OutputError, match=r"needs about .* KiB at .* has 1000 B free"):
        _stream(src, tmp_path / "out", "w4g8")
    assert not (tmp_path / "out").exists() and not stream.work_folder(tmp_path / "out").exists()


def test_a_killed_run_resumes_and_never_takes_a_half_written_shard(tmp_path, monkeypatch):
    src = _saved("llama", tmp_path / "src")
    out = tmp_path / "out"
    calls = {"n": 0}
    real = stream.write_shard

    def dies_on_the_third(work, shard, tensors, record):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed while writing shard 3
        real(work, shard, tensors, record)

    monkeypatch.setattr(stream, "write_shard", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        stream_quantize(StreamJob(model=src, out=out, scheme="w4g8", progress=False, shard_mb=0.004))
    monkeypatch.setattr(stream, "write_shard", real)
    work = stream.work_folder(out)
    shards = sorted(work.glob("model-*.safetensors"))
    assert len(shards) == 2 and len(list(work.glob("*.partial"))) == 0 and not out.exists()
    shards[1].write_bytes(shards[1].read_bytes()[:-8])  # a shard damaged after its seal: redone, not trusted
    lines = []
    monkeypatch.setattr("lowbit.api.stream._reporter", lambda progress: lines.append)
    stream_quantize(StreamJob(model=src, out=out, scheme="w4g8", progress=True, shard_mb=0.004))
    assert any("resuming: 1 of" in ln for ln in lines)
    assert any(ln.startswith("[3/") and "ETA" in ln for ln in lines)  # progress from the first shard redone
    assert not work.exists()
    _same(_in_model(src, "w4g8", tmp_path / "ref"), out)


def test_cli_stream_refuses_what_it_cannot_honour(tmp_path, capsys):
    src = _saved("llama", tmp_path / "src")
    for flags, word in ((["--method", "gptq"], "--method gptq"), (["--avg-bits", "3", "--options", "w4g8"],
                                                                  "--avg-bits"), (["--awq"], "--awq"),
                        (["--nsamples", "4"], "--nsamples"), (["--kv", "fp8"], "--kv")):
        assert main(["quantize", str(src), "--stream", *flags, "--out", str(tmp_path / "o")]) == 2
        assert word in capsys.readouterr().err
    assert main(["quantize", str(src), "--shard-mb", "4", "--out", str(tmp_path / "o")]) == 2
    assert main(["quantize", str(src), "--stream", "--scheme", "w4g8", "--no-eval", "--json", "--out",
                 str(tmp_path / "o")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["method"] == "rtn (streamed)"
    assert main(["inspect", str(tmp_path / "o"), "--json"]) == 0  # inspect reads the shards
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["quantized_layers"] == 14


@pytest.mark.parametrize("scheme", ("w4g16", "w4g16a", "w8g16", "nvfp4", "mxfp4"))
def test_compressed_tensors_source_dequantizes_to_the_weights_it_was_exported_from(tmp_path, scheme):
    """lowbit's own compressed-tensors export read back per tensor gives exactly the dequantized weights of the model
    it was exported from (an independent decoder: lowbit's QTensor), and requantizing it equals requantizing that
    float dequantization."""
    import transformers as tf
    from test_accounting import SMALL

    from lowbit.files.compressed_tensors import export
    from lowbit.models.stream_source import StreamSource
    from lowbit.nn import quant_layers
    from lowbit.ptq import quantize_model

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, intermediate_size=64, tie_word_embeddings=False))
    quantize_model(model, build_plan(model, scheme), "rtn", {"search": False}, progress=False)
    export(model, None, tmp_path / "ct")
    source = StreamSource.open(tmp_path / "ct")
    for name, layer in quant_layers(model).items():
        assert torch.equal(source.tensor(f"{name}.weight"), layer.qweight.dequantize()), name
    _dequantized_copy(tmp_path / "ct", tmp_path / "deq")
    s = _stream(tmp_path / "ct", tmp_path / "a", "w4g8")
    _stream(tmp_path / "deq", tmp_path / "b", "w4g8")
    _same(tmp_path / "a", tmp_path / "b")
    assert any(k.startswith("compressed-tensors") for k in s["source_precision"])
