"""An export's limits are known before any loading, and at quantize time; its files load in either dtype."""

import warnings

import pytest
import torch

pytest.importorskip("compressed_tensors")

from lowbit import api  # noqa: E402
from lowbit.cli import main  # noqa: E402
from lowbit.errors import ConfigError, SchemeError  # noqa: E402
from lowbit.files import compressed_tensors as ct  # noqa: E402
from lowbit.files import specs  # noqa: E402
from lowbit.files import targets as limits  # noqa: E402
from lowbit.formats import Scheme  # noqa: E402
from lowbit.models import load_model  # noqa: E402
from lowbit.nn import QuantLinear, set_module  # noqa: E402
from lowbit.plans.plan import Plan  # noqa: E402


def quantize(out, model_dir, scheme, **kw):
    return api.quantize(api.QuantizeJob(out=out, model=str(model_dir), scheme=scheme, method="rtn",
                                        settings={"search": False}, evaluation=None, progress=False, **kw))


def test_a_partial_group_is_named_at_quantize_time_and_refused_before_loading(tiny_hf_dir, tmp_path, monkeypatch):
    # 48 divides neither 64 nor 128 columns: lowbit quantizes a partial last group, vLLM refuses one
    with pytest.warns(UserWarning, match="cannot be exported as it is: --to compressed-tensors"):
        r = quantize(tmp_path / "q", tiny_hf_dir, "w4g48")
    assert set(r["not_exportable"]) == {"compressed-tensors", "gguf"}
    assert "partial last group" in r["not_exportable"]["compressed-tensors"]

    def no_loading(*a, **k):
        raise AssertionError("the checkpoint was loaded before its export was refused")

    monkeypatch.setattr("lowbit.files.native.load", no_loading)
    with pytest.raises(SchemeError, match=r"refuses a partial last group .*e\.g\. w4g32"):
        api.export(api.ExportJob(tmp_path / "q", "compressed-tensors", tmp_path / "ct"))
    with pytest.raises(SchemeError, match="no exact GGUF type"):
        api.export(api.ExportJob(tmp_path / "q", "gguf", tmp_path / "q.gguf"))
    assert not (tmp_path / "ct").exists() and not (tmp_path / "q.gguf").exists()


def test_a_named_export_refuses_the_plan_before_quantizing(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    def no_quantizing(*a, **k):
        raise AssertionError("quantized before the plan was refused")

    monkeypatch.setattr("lowbit.ptq.quantize_model", no_quantizing)
    with pytest.raises(ConfigError, match="--export-to compressed-tensors: .*group 48 does not divide"):
        quantize(tmp_path / "q", tiny_hf_dir, "w4g48", export_to="compressed-tensors")
    assert not (tmp_path / "q").exists()
    code = main(["quantize", str(tiny_hf_dir), "--scheme", "nvfp4", "--method", "rtn", "--no-search", "--no-eval",
                 "--export-to", "gguf", "--out", str(tmp_path / "g")])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (loading shows progress)
    assert code == 2 and len(err) == 1 and "--export-to gguf" in err[0] and "no exact GGUF type" in err[0]
    with pytest.raises(ConfigError, match="--export-to must be one of"):
        api.QuantizeJob(out=tmp_path / "x", export_to="onnx")


def test_a_plan_the_named_export_holds_runs_without_warnings(tiny_hf_dir, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about other exports when the user named one
        r = quantize(tmp_path / "q", tiny_hf_dir, "w4g32", export_to="compressed-tensors")
    assert "not_exportable" not in r
    api.export(api.ExportJob(tmp_path / "q", "compressed-tensors", tmp_path / "ct"))


def test_limits_from_manifest_and_plan_agree(tiny_hf_dir, tmp_path):
    quantize(tmp_path / "q", tiny_hf_dir, "w4g32", export_to="gguf")
    from lowbit.files.native import read_manifest

    got = specs.from_manifest(read_manifest(tmp_path / "q"))
    assert {s.scheme for s in got} == {Scheme.parse("w4g32")} and all(s.input is None for s in got)
    assert limits.refusals(got, "llama") == {}
    assert "gguf" in limits.refusals(got, "gpt2")  # an architecture the GGUF export does not write
    rotated = specs.from_plan(Plan({s.name: "w4g32" for s in got}).layers, {s.name: s.shape for s in got},
                              frozenset([got[0].name]))
    assert set(limits.refusals(rotated, "llama")) == {"compressed-tensors", "gguf"}


def test_vllm_cannot_load_fused_parts_with_different_recipes(tiny_llama, tmp_path):
    model, tok = tiny_llama
    for name, scheme in (("model.layers.0.self_attn.q_proj", "w4g32"), ("model.layers.0.self_attn.k_proj", "w8"),
                         ("model.layers.0.self_attn.v_proj", "w4g32")):
        set_module(model, name, QuantLinear.from_linear(model.get_submodule(name), scheme))
    with pytest.warns(UserWarning, match="vLLM runs them as one matmul"):
        ct.export(model, tok, tmp_path / "ct")


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "w4a4-nvfp4"])
def test_lowbit_loads_its_fp4_exports_in_float32_and_bf16(tiny_llama, tmp_path, recipe):
    """transformers decompresses FP4 to bf16; a float32 model crashed on it ("expected m1 and m2 to have the
    same dtype"). lowbit decompresses on load and casts to the dtype asked for."""
    from lowbit.ptq import quantize_model

    model, tok = tiny_llama
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    calib = torch.randint(0, len(tok), (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(model, Plan.uniform(names, recipe), "rtn", {"search": False}, calib=calib, progress=False)
    ct.export(model, tok, tmp_path / "ct")
    ids = torch.randint(0, len(tok), (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        for dtype in (torch.float32, torch.bfloat16):
            lm = load_model(tmp_path / "ct", dtype=dtype)
            got = lm.model(ids).logits
            assert got.dtype == dtype
            # compressed-tensors unpacks FP4 weights in bf16 (its decompression), so agreement is to bf16
            assert (got.float() - want).abs().max() < 0.1 * want.abs().max()
