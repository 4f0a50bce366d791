"""One typed plan source per run, one conductor, one device: `lowbit.plans.source`, `lowbit.ptq.conductor`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from ptq_helpers import tiny_model

from lowbit.api import QuantizeJob
from lowbit.api.quantize import MixedSettings
from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import Recipe
from lowbit.plans import kmix
from lowbit.plans import source as src
from lowbit.plans.plan import Plan
from lowbit.plans.source import LlamaCppMix, MixedBudget, PlanFile, Uniform, build_plan, parse_scheme
from lowbit.ptq import quantize_model
from lowbit.ptq.methods import METHODS, Method, register


def test_scheme_text_becomes_one_typed_source():
    assert parse_scheme(" Q4_K_M ") == LlamaCppMix("q4_k_m")
    assert parse_scheme("gguf:q2_k", lm_head=True) == LlamaCppMix("gguf:q2_k", lm_head=True)
    assert parse_scheme("w4a4-mxfp4") == Uniform(Recipe.parse("w4a4-mxfp4"))
    assert parse_scheme(None) == Uniform(Recipe.parse(src.DEFAULT_SCHEME))
    assert all(isinstance(parse_scheme(m), LlamaCppMix) for m in kmix.MIXES)
    with pytest.raises(SchemeError, match="unknown K-quant mix"):
        LlamaCppMix("q4_k_x")


@pytest.mark.parametrize(("text", "hint"), [("q4_k_mm", "q4_k_m"), ("w4a4-mxfp", "w4a4-mxfp4"),
                                             ("nvfp4_46", "nvfp4-46")])
def test_a_mistyped_scheme_is_pointed_at_the_closest_name_mixes_included(text, hint):
    with pytest.raises(SchemeError, match=rf"^unknown scheme '{text}' \(did you mean {hint}\?\); valid names: "):
        parse_scheme(text)


def test_one_source_at_a_time(tmp_path):
    plan = tmp_path / "plan.json"
    Plan({"a": Recipe.parse("w4g128")}).save(plan)
    assert isinstance(src.plan_source(plan_file=str(plan)), PlanFile)
    mixed = MixedSettings(avg_bits=3, options=("w2g64", "w4g128"))
    assert src.plan_source(mixed=mixed, lm_head=True) == MixedBudget(mixed, lm_head=True)
    with pytest.raises(ConfigError, match="--scheme and --plan both choose"):
        src.plan_source("w4g128", str(plan))
    with pytest.raises(ConfigError, match="--lm-head adds the lm_head to a uniform plan"):
        src.plan_source(plan_file=str(plan), lm_head=True)


def test_the_job_reads_a_plan_file_once(tmp_path):
    """The job keeps the plan it read: a file changed or removed after validation changes nothing."""
    plan = tmp_path / "plan.json"
    Plan({"model.layers.0.mlp.up_proj": Recipe.parse("w8a8-fp8-static")}).save(plan)
    job = QuantizeJob(out=tmp_path / "out", plan_file=str(plan))
    plan.unlink()
    assert job.static_inputs and job.needs_calib
    assert isinstance(job.source, PlanFile) and list(job.source.plan) == ["model.layers.0.mlp.up_proj"]


def test_build_plan_from_each_source():
    model = tiny_model()
    uniform = build_plan(model, parse_scheme("w4g32"))
    assert uniform.is_uniform and uniform.describe() == "w4g32" and "lm_head" not in uniform
    assert "lm_head" in build_plan(model, parse_scheme("w4g32", lm_head=True))
    mixed = build_plan(model, MixedBudget(MixedSettings(avg_bits=3, options=("w2g32", "w4g32"))))
    assert mixed.describe() == "w2g32" and list(mixed) == list(uniform)
    assert build_plan(model, "w4g32") == uniform  # text is parsed into a source first
    with pytest.raises(ConfigError, match="names layers this model lacks"):
        build_plan(model, PlanFile("p.json", Plan({"model.nope": Recipe.parse("w4g32")})))


def test_the_mix_name_is_a_typed_manifest_entry():
    assert kmix.mix_meta("q4_k_m") == {kmix.META_KEY: "q4_k_m"} and kmix.mix_meta(None) == {}
    assert kmix.mix_of({kmix.META_KEY: "q3_k_m", "plan": "q3_k_m"}) == "q3_k_m"
    assert kmix.mix_of({"plan": "q4_k_m"}) == "q4_k_m"  # a checkpoint written before the entry existed
    assert kmix.mix_of({"plan": "w4g128"}) is None and kmix.mix_of({kmix.META_KEY: ["q4_k_m"]}) is None


@dataclass(frozen=True)
class _Nothing:
    pass


@pytest.fixture
def seen_context():
    """A method that records the `RunContext` it was given (and quantizes nothing)."""
    seen = []
    register(Method("spy", _Nothing, lambda model, plan, settings, ctx: seen.append(ctx) or plan,
                    blockwise=False, needs_calib=lambda _s: False, summary="records its context"))
    yield seen
    del METHODS["spy"]


def test_the_device_reaches_the_method_resolved_once(seen_context):
    model = tiny_model()
    plan = build_plan(model, "w4g32")
    quantize_model(model, plan, "spy", device="cpu", progress=False)
    assert seen_context[0].device == torch.device("cpu") and isinstance(seen_context[0].device, torch.device)
    quantize_model(model, plan, "spy", progress=False)
    assert seen_context[1].device is None  # where the model is
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        quantize_model(model, plan, "spy", device="gpu", progress=False)
    assert len(seen_context) == 2  # refused before the method ran


def test_a_mix_checkpoint_records_its_mix_and_its_gguf_says_so(tiny_hf_dir, tmp_path):
    """quantize writes the mix as its own manifest entry; export reads it back for general.file_type."""
    gguf = pytest.importorskip("gguf")
    from lowbit import api
    from lowbit.files.gguf_export import FILE_TYPES
    from lowbit.files.native import read_manifest

    job = QuantizeJob(out=tmp_path / "q", model=str(tiny_hf_dir), scheme="Q3_K_M", settings={"search": False},
                      evaluation=None, progress=False)
    assert api.quantize(job)["scheme"] == "q3_k_m"
    meta = read_manifest(tmp_path / "q")["meta"]
    assert meta[kmix.META_KEY] == "q3_k_m" and meta["plan"] == "q3_k_m"
    api.export(api.ExportJob(checkpoint=str(tmp_path / "q"), to="gguf", out=str(tmp_path / "q.gguf"),
                             allow_requant=True))  # 64-wide rows take Q5_1 fallbacks, rounded
    field = gguf.GGUFReader(str(tmp_path / "q.gguf")).fields["general.file_type"]
    assert field.contents() == FILE_TYPES["q3_k_m"]
