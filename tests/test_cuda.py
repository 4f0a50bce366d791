"""The GPU paths: formats, block tuning, mixed precision, checkpoints, adapters and QAT on CUDA.

Everything else in the suite runs on the CPU, where CI runs. These tests compare the
CUDA results with the CPU ones (exact where the arithmetic is elementwise, a bounded
share of near-tie flips where reductions run in another order) and exercise the paths
that move tensors between devices: the pipeline keeps the model on the CPU and moves
one block at a time to the GPU, a resumed run reads its codes back onto the CPU.

They skip without a GPU. ``LOWBIT_TEST_DEVICE=cpu`` runs them on the CPU instead, which
checks the tests themselves where no GPU is at hand (the comparisons are then trivial).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform

from lowbit.formats import Scheme, minifloat, qdq
from lowbit.nn import QuantLinear, quant_layers, replace_linears

DEVICE = os.environ.get("LOWBIT_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
pytestmark = pytest.mark.skipif(not DEVICE, reason="no CUDA device (LOWBIT_TEST_DEVICE=cpu runs these on the CPU)")

EXACT = ["w4g128", "w3g32a", "w2g64", "w8", "nvfp4", "nvfp4-ue5m3", "mxfp4", "mxfp8"]
# rules that compare candidate errors (sums): another summation order may flip a near tie
SEARCHED = ["w4g32:rule=search", "w2g64:rule=search", "nvfp4-46", "mxfp4:rule=search"]


def weight(rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[::7, ::13] *= 40  # outliers, so groups differ in range
    return w


@pytest.mark.parametrize("scheme", EXACT)
def test_rtn_on_device_equals_cpu_exactly(scheme):
    w = weight()
    s = Scheme.parse(scheme)
    assert torch.equal(qdq(w.to(DEVICE), s).cpu(), qdq(w, s))


@pytest.mark.parametrize("scheme", SEARCHED)
def test_searched_rules_on_device_agree_with_cpu(scheme):
    w = weight(seed=1)
    s = Scheme.parse(scheme)
    got, ref = qdq(w.to(DEVICE), s).cpu(), qdq(w, s)
    assert (got != ref).float().mean() < 0.01


def test_e4m3_cast_on_device_matches_torch_float8():
    """In range the cast equals torch's float8 cast on the device; beyond it lowbit saturates.

    torch's own backends disagree past the largest value: on an H200 with torch 2.11 the
    CUDA cast turned 1e6 into NaN where the CPU cast (2.13) gives 448. A scale must stay
    finite, so lowbit saturates everywhere.
    """
    grid = minifloat.minifloat_grid(minifloat.E4M3)
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, -mids, torch.rand(4096) * 463.9, torch.tensor([0.0, 448.0, 463.9])])
    got = minifloat.round_minifloat(x.to(DEVICE), minifloat.E4M3).cpu()
    assert torch.equal(got, x.to(DEVICE).to(torch.float8_e4m3fn).float().cpu())
    big = torch.tensor([464.0, 500.0, 1e6, float("inf")])
    assert torch.equal(minifloat.round_minifloat(big.to(DEVICE), minifloat.E4M3).cpu(), torch.full((4,), 448.0))
    assert torch.equal(minifloat.round_minifloat(-big.to(DEVICE), minifloat.E4M3).cpu(), torch.full((4,), -448.0))


def code_agreement(a, b) -> float:
    qa, qb = quant_layers(a), quant_layers(b)
    assert qa.keys() == qb.keys() and qa
    same = sum((qa[n].codes == qb[n].codes).sum().item() for n in qa)
    return same / sum(qa[n].codes.numel() for n in qa)


def signround(model, scheme: str, device: str, v2: bool = True, iters: int = 12, **kw):
    from lowbit.ptq.signround import make_config, signround_quantize

    cfg = make_config(iters=iters, batch_size=4, v2=v2, **kw)
    return signround_quantize(model, uniform(model, scheme), cfg, calib(), device=device, progress=False)


def test_signround2_on_device_tracks_the_cpu_run():
    m = tiny_model(layers=2)
    gpu, cpu = copy.deepcopy(m), copy.deepcopy(m)
    infos = signround(gpu, "w4g32", DEVICE, tune_dtype="fp32")
    ref = signround(cpu, "w4g32", "cpu", tune_dtype="fp32")
    assert all(i["loss"] <= i["rtn_loss"] for i in infos)
    # sign descent flips a code wherever a gradient's sign differs in float noise
    assert code_agreement(gpu, cpu) > 0.97
    for i, r in zip(infos, ref, strict=True):
        assert i["loss"] == pytest.approx(r["loss"], rel=0.1)
    # the pipeline hands the model back where it was: on the CPU
    assert {p.device.type for p in gpu.parameters()} | {b.device.type for b in gpu.buffers()} == {"cpu"}
    ids = calib(2, 16, seed=5)
    with torch.no_grad():
        assert torch.isfinite(gpu(ids).logits).all()


@pytest.mark.parametrize("scheme,v2", [("w4g32a", False), ("nvfp4-46", True), ("mxfp4", True), ("w2g32", True)])
def test_every_rounder_tunes_on_device(scheme, v2):
    m = tiny_model(layers=1)
    infos = signround(m, scheme, DEVICE, v2=v2, iters=6)
    assert all(torch.isfinite(torch.tensor(i["loss"])) and i["loss"] <= i["rtn_loss"] for i in infos)
    assert len(quant_layers(m)) == 7


def test_bf16_products_on_device():
    m = tiny_model(layers=1)
    infos = signround(m, "w4g32", DEVICE, tune_dtype="bf16")
    assert all(i["loss"] <= i["rtn_loss"] for i in infos)


def test_resume_on_device_continues_from_saved_blocks(tmp_path):
    from test_ptq_pipeline import Interrupt, run_sr

    m = tiny_model(layers=3)
    plan = uniform(m, "w2g32")
    with pytest.raises(Interrupt):
        run_sr(copy.deepcopy(m), plan, tmp_path / "w", stop_after=0, device=DEVICE)
    resumed = copy.deepcopy(m)
    infos = run_sr(resumed, plan, tmp_path / "w", device=DEVICE)
    assert [i.get("resumed", 0.0) for i in infos] == [1.0, 0.0, 0.0]
    assert len(quant_layers(resumed)) == 21


def test_mixed_precision_on_device(tmp_path):
    from lowbit.ptq import MixedSettings, quantize_model

    m = tiny_model(layers=2)
    plan = uniform(m, "w4g32")
    applied = quantize_model(m, plan, "signround2", {"iters": 2, "batch_size": 4}, calib=calib(), progress=False,
                             mixed=MixedSettings(3.2, ("w2g32", "w4g32")), device=DEVICE,
                             workdir=str(tmp_path / "w"))
    assert {s.bits for _, s in applied.items()} == {2, 4}


def test_quantized_model_and_checkpoint_on_device(tmp_path):
    from lowbit.files.native import load, save

    m = tiny_model(layers=2)
    replace_linears(m, uniform(m, "w4g32"))
    ids = calib(2, 16, seed=3)
    with torch.no_grad():
        ref = m(ids).logits
        m.to(DEVICE)
        got = m(ids.to(DEVICE)).logits.cpu()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert all(isinstance(q, QuantLinear) and q.codes.device.type == torch.device(DEVICE).type
               for q in quant_layers(m).values())
    save(m, None, tmp_path / "ck")
    loaded, _ = load(tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, m.cpu()(ids).logits)


@pytest.mark.parametrize("in_f", [48, 576])
def test_qwha_paths_agree_on_device(in_f):
    from test_peft import random_adapter

    x = torch.randn(2, 7, in_f, device=DEVICE)
    outs, grads = [], []
    for path in ("dense", "sparse"):
        a = random_adapter(20, in_f, 150, path=path).to(DEVICE)
        y = a(x)
        (y * torch.arange(20.0, device=DEVICE)).sum().backward()
        outs.append(y.detach().cpu())
        grads.append(a.values.grad.cpu())
    ref = x.cpu().double() @ random_adapter(20, in_f, 150).delta_weight().double().detach().T
    assert torch.allclose(outs[0].double(), ref, atol=1e-4) and torch.allclose(outs[1].double(), ref, atol=1e-4)
    assert torch.allclose(grads[0], grads[1], atol=1e-3, rtol=1e-4)


def test_qat_trains_on_device():
    from test_train import cfg, tokens

    from lowbit.qat import resolve, to_qat
    from lowbit.train import train

    m = tiny_model().to(DEVICE)
    to_qat(m, resolve("w2"))
    r = train(m, tokens(), cfg(steps=8, lr=1e-2))
    assert r.losses[-1] < r.losses[0]


def test_cli_quantize_and_eval_on_device_match_the_cpu(tmp_path, capsys, tiny_tokenizer):
    """RTN and both perplexities move the whole model to the device and back; tuning places blocks."""
    import json

    from test_cli import _save_tiny_qwen

    from lowbit.cli import main

    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    common = ["--scheme", "w4g32", "--nsamples", "4", "--seqlen", "32", "--eval-seqlen", "64", "--windows", "3",
              "--json"]
    runs = {}
    for i, dev in enumerate(("cpu", DEVICE)):
        for method in ("rtn", "signround2"):
            extra = ["--iters", "2", "--batch-size", "2", "--tune-dtype", "fp32"] if method != "rtn" else []
            out = tmp_path / f"{method}-{i}"
            assert main(["quantize", str(tmp_path / "qwen"), "--method", method, *common, *extra,
                         "--device", dev, "--out", str(out)]) == 0, capsys.readouterr().err
            runs[method, dev] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for method in ("rtn", "signround2"):
        a, b = runs[method, "cpu"], runs[method, DEVICE]
        assert a["ppl_fp"] == pytest.approx(b["ppl_fp"], rel=1e-4)
        assert a["ppl_q"] == pytest.approx(b["ppl_q"], rel=0.02)
    assert main(["eval", str(tmp_path / "rtn-1"), "--seqlen", "64", "--windows", "3", "--device", DEVICE,
                 "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e["ppl"] == pytest.approx(runs["rtn", DEVICE]["ppl_q"], rel=1e-4)


def test_on_device_puts_the_model_back():
    from lowbit.models.placement import model_device, on_device

    m = tiny_model(layers=1)
    with on_device(m, DEVICE) as moved:
        assert model_device(moved).type == torch.device(DEVICE).type
    assert {p.device.type for p in m.parameters()} == {"cpu"}


def _last_json(capsys) -> dict:
    import json

    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_formats_ppl_on_device_matches_the_cpu(tmp_path, capsys, tiny_tokenizer):
    from test_cli import _save_tiny_qwen

    from lowbit.cli import main

    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    got = {}
    for dev in ("cpu", DEVICE):
        assert main(["formats", str(tmp_path / "qwen"), "--schemes", "nvfp4", "--block-sizes", "16", "--ppl",
                     "--eval-seqlen", "64", "--windows", "2", "--device", dev, "--json"]) == 0
        got[dev] = _last_json(capsys)
    assert got[DEVICE]["fp_ppl"] == pytest.approx(got["cpu"]["fp_ppl"], rel=1e-4)
    for a, b in zip(got[DEVICE]["rows"], got["cpu"]["rows"], strict=True):
        assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-3)


def test_cli_qat_on_device_matches_the_cpu(tmp_path, capsys):
    from lowbit.cli import main

    folder = _qat_model(tmp_path)
    runs = {}
    for i, dev in enumerate(("cpu", DEVICE)):
        assert main(["qat", str(folder), "--scheme", "w2", "--method", "ste", "--steps", "4", "--batch-size", "2",
                     "--seqlen", "32", "--eval-seqlen", "64", "--windows", "2", "--data", str(folder / "corpus.txt"),
                     "--device", dev, "--json", "--out", str(tmp_path / f"q{i}")]) == 0, capsys.readouterr().err
        runs[dev] = _last_json(capsys)
    assert runs[DEVICE]["initial_loss"] == pytest.approx(runs["cpu"]["initial_loss"], rel=1e-4)
    assert runs[DEVICE]["final_loss"] == pytest.approx(runs["cpu"]["final_loss"], rel=0.05)
    assert runs[DEVICE]["ppl"] == pytest.approx(runs["cpu"]["ppl"], rel=0.05)


def _qat_model(tmp_path):
    from conftest import make_llama
    from test_qat_cli import word_tokenizer

    tok = word_tokenizer()
    folder = tmp_path / "fp"
    make_llama(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    words = tok.convert_ids_to_tokens(list(range(len(tok))))
    docs = [" ".join(words[j] for j in torch.randint(0, len(words), (200,), generator=g).tolist()) for _ in range(8)]
    (folder / "corpus.txt").write_text("\n\n".join(docs))
    return folder


def test_cli_finetune_on_device_matches_the_cpu(tmp_path, capsys):
    from conftest import make_llama
    from test_peft_cli import tokenizer, write_jsonl

    from lowbit.cli import main

    tok = tokenizer()
    make_llama(len(tok), layers=1).save_pretrained(tmp_path / "fp")
    tok.save_pretrained(tmp_path / "fp")
    assert main(["quantize", str(tmp_path / "fp"), "--scheme", "w4g32", "--no-eval", "--no-search",
                 "--out", str(tmp_path / "q")]) == 0
    data = write_jsonl(tmp_path / "d.jsonl")
    runs = {}
    for i, dev in enumerate(("cpu", DEVICE)):
        assert main(["finetune", str(tmp_path / "q"), "--adapter", "lora", "--rank", "4", "--steps", "3",
                     "--batch-size", "4", "--lr", "1e-2", "--seqlen", "24", "--data", str(data), "--no-eval",
                     "--device", dev, "--out", str(tmp_path / f"a{i}"), "--json"]) == 0, capsys.readouterr().err
        runs[dev] = _last_json(capsys)
    assert runs[DEVICE]["loss_first"] == pytest.approx(runs["cpu"]["loss_first"], rel=1e-4)
    assert runs[DEVICE]["loss_last"] == pytest.approx(runs["cpu"]["loss_last"], rel=0.02)


def test_host_caches_tune_like_device_caches():
    """--cache-device cpu (host caches streamed per mini-batch) gives the device-cache result."""
    m = tiny_model(layers=2)
    host, dev = copy.deepcopy(m), copy.deepcopy(m)
    from lowbit.ptq.signround import make_config, signround_quantize

    cfg = make_config(iters=6, batch_size=4, v2=True, tune_dtype="fp32")
    a = signround_quantize(host, uniform(host, "w4g32"), cfg, calib(), device=DEVICE, progress=False,
                           cache_device="cpu")
    b = signround_quantize(dev, uniform(dev, "w4g32"), cfg, calib(), device=DEVICE, progress=False)
    assert [i["loss"] for i in a] == [i["loss"] for i in b]
    assert code_agreement(host, dev) == 1.0


def test_gptq_and_awq_with_host_caches_equal_device_caches():
    """--cache-device cpu reaches GPTQ and AWQ (GPTQ once dropped it): host caches give the device-cache result."""
    from lowbit.ptq import quantize_model
    from lowbit.ptq.awq import AWQSettings

    runs = []
    for where in ("cpu", "device"):
        m = tiny_model(layers=2)
        quantize_model(m, uniform(m, "w4g32"), "gptq", calib=calib(), awq=AWQSettings(grid=4), device=DEVICE,
                       cache_device=where, progress=False)
        runs.append(m)
    assert code_agreement(*runs) == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a GPU matter (the CPU test counts reads)")
def test_tuning_loop_never_syncs_the_host(monkeypatch):
    """No cudaStreamSynchronize or blocking copy anywhere in SignRound's descent (torch's sync debug mode)."""
    from lowbit.ptq import signround

    real = signround.SignRoundTuner._descend
    calls = []

    def descend(self, job, rounders):
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls.append(1)
            return real(self, job, rounders)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(signround.SignRoundTuner, "_descend", descend)
    for scheme in ("w4g32", "w2g32", "nvfp4"):
        signround(tiny_model(layers=1), scheme, DEVICE, iters=4)
    assert len(calls) == 3


def _quantized(model, recipe: str, method: str, device: str, **kw):
    from lowbit.ptq import quantize_model

    plan = quantize_model(model, uniform(model, recipe), method, kw.pop("settings", None), calib=calib(),
                          device=device, progress=False, **kw)
    assert {p.device.type for p in model.parameters()} == {"cpu"}  # handed back where it was
    return plan


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("recipe", ["w4g32", "w2g32", "nvfp4"])
def test_gptq_on_device_tracks_the_cpu_run(recipe):
    """GPTQ's Hessians, float32 factor and column loop on the device: the CPU's codes up to near ties."""
    m = tiny_model(layers=2)
    gpu, cpu = copy.deepcopy(m), copy.deepcopy(m)
    _quantized(gpu, recipe, "gptq", DEVICE)
    _quantized(cpu, recipe, "gptq", "cpu")
    # a near tie rounded the other way feeds a different error into the later columns
    assert code_agreement(gpu, cpu) > 0.9
    ids = calib(2, 16, seed=5)
    ref = _logits(m, ids)
    err = lambda q: float((_logits(q, ids) - ref).pow(2).mean())  # noqa: E731
    assert err(gpu) == pytest.approx(err(cpu), rel=0.2)


@pytest.mark.parametrize("recipe,method", [("w4a4-nvfp4-46", "rtn"), ("w4a4-mxfp4", "signround2"),
                                           ("w8a8-fp8-static", "rtn"), ("w4a4-nvfp4", "gptq")])
def test_activation_recipes_on_device_match_the_cpu(recipe, method):
    """W+A recipes: quantized inputs inside tuning and in the forward, static scales from the calibration pass."""
    m = tiny_model(layers=2)
    gpu, cpu = copy.deepcopy(m), copy.deepcopy(m)
    settings = {"iters": 6, "batch_size": 4} if method == "signround2" else None
    _quantized(gpu, recipe, method, DEVICE, settings=settings)
    _quantized(cpu, recipe, method, "cpu", settings=settings)
    assert code_agreement(gpu, cpu) > (0.999 if method == "rtn" else 0.9)
    ids = calib(2, 16, seed=5)
    a, b = _logits(gpu.to(DEVICE), ids.to(DEVICE)).cpu(), _logits(cpu, ids)
    gpu.cpu()
    assert torch.isfinite(a).all()
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def test_awq_and_rotation_on_device_match_the_cpu():
    """The float pre-steps (Hadamard rotation, AWQ's searched scales) on the device, then RTN."""
    from lowbit.ptq import AWQSettings, RotationSettings

    m = tiny_model(layers=2)
    gpu, cpu = copy.deepcopy(m), copy.deepcopy(m)
    kw = {"rotate": RotationSettings(), "awq": AWQSettings()}
    _quantized(gpu, "w4g32", "rtn", DEVICE, **kw)
    _quantized(cpu, "w4g32", "rtn", "cpu", **kw)
    assert code_agreement(gpu, cpu) > 0.97


@pytest.mark.parametrize("method", ["rtn", "gptq", "signround2"])
def test_online_rotation_on_device_matches_the_cpu(method):
    """The online Hadamard before down_proj (its pre-hook, the quantized layer's rotation) on the device."""
    from lowbit.ptq import RotationSettings

    m = tiny_model(layers=2)
    gpu, cpu = copy.deepcopy(m), copy.deepcopy(m)
    kw = {"rotate": RotationSettings(residual=False, online=("down_proj",))}
    settings = {"iters": 6, "batch_size": 4} if method == "signround2" else None
    _quantized(gpu, "w4a4-mxfp4", method, DEVICE, settings=settings, **kw)
    _quantized(cpu, "w4a4-mxfp4", method, "cpu", settings=settings, **kw)
    assert code_agreement(gpu, cpu) > (0.99 if method == "rtn" else 0.9)
    ids = calib(2, 16, seed=5)
    a, b = _logits(gpu.to(DEVICE), ids.to(DEVICE)).cpu(), _logits(cpu, ids)
    gpu.cpu()
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def test_gptq_on_kquants_on_device_tracks_the_cpu_run():
    """GPTQ through llama.cpp's two-level K-quant scales on the device (KGrid): the CPU's codes up to near ties."""
    m = tiny_model(layers=1, hidden=256, inter=512)
    gpu, cpu = copy.deepcopy(m), copy.deepcopy(m)
    _quantized(gpu, "q3_k", "gptq", DEVICE)
    _quantized(cpu, "q3_k", "gptq", "cpu")
    assert code_agreement(gpu, cpu) > 0.9
