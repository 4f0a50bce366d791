"""--avg-bits on a lazily loaded model: DeltaLoss block by block gives the whole-model scores, plan and checkpoint.

Tolerance: in fp32 the streamed passes run every block on the same chunks of samples in the same order as the
whole-model passes, and sum each weight gradient over the chunks before the abs, as ``delta_loss`` does; the only
difference is where autograd sums the residual stream's gradient at a block boundary (a leaf's ``.grad`` instead of
inside one graph). On this machine the scores come out bit-identical; the tests allow ``rel=1e-6`` (fp32 rounding
of a reordered sum, ~1e-7 relative) so a CPU whose kernels sum in another order does not fail them, which is still
far below the gaps between layers' scores that decide the knapsack (the plans are asserted equal, exactly).
"""

from __future__ import annotations

import json

import pytest
import torch
from gguf_moe_helpers import tiny_moe
from ptq_helpers import block_names, calib, tiny_model
from safetensors.torch import save_file
from test_ptq_pipeline import same_weights

from lowbit.errors import ConfigError
from lowbit.models.experts import expert_tensors
from lowbit.models.lazy import is_lazy, load_lazy
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan
from lowbit.ptq import quantize_model
from lowbit.ptq import streamed_deltaloss as sd
from lowbit.ptq.mixed import MixedSettings, mixed_plan
from lowbit.ptq.sensitivity import delta_loss

pytestmark = pytest.mark.usefixtures("one_thread")
REL = 1e-6


def _llama(tmp_path, layers: int = 3):
    m = tiny_model(layers=layers)
    with torch.no_grad():  # norms that are not all ones
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(n))) + 0.5)
    m.save_pretrained(tmp_path / "hf")
    return m, tmp_path / "hf", block_names(m)


def _moe(tmp_path, layers: int = 2):
    """A tiny Qwen3-MoE written with its fused experts tensors under the model's own names (what lazy loading
    reads; transformers' save_pretrained splits them per expert)."""
    m = tiny_moe("qwen3_moe", layers=layers)
    folder = tmp_path / "hf"
    folder.mkdir()
    m.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(folder / "model.safetensors"))
    return m, folder, list(build_plan(m, "w4g32"))


def _same_scores(want, got, names):
    assert set(got) == set(want)
    for o in want:
        assert set(got[o]) == set(names)
        for n in names:
            assert got[o][n] == pytest.approx(want[o][n], rel=REL, abs=1e-12), (o, n)


OPTIONS = [
    (["w2g32", "w4g32"], "abs"),  # weight terms only
    (["w2g32", "w4a4-mxfp4"], "signed"),  # one weight-only option: every option keeps the weight term
    (["w4a4-nvfp4", "w8a8-fp8-static"], "abs"),  # activation terms alone, static input scales
]


@pytest.mark.parametrize("options,mode", OPTIONS)
def test_llama_scores_equal_the_whole_model_scores(tmp_path, options, mode):
    """Every decoder Linear and an (untied) planned lm_head, scored block by block: the whole-model scores."""
    model, folder, names = _llama(tmp_path)
    names = [*names, "lm_head"]
    c = calib(6, 24)
    want = delta_loss(model, names, options, c, mode=mode, progress=False)
    lazy = load_lazy(folder)
    got = sd.streamed_delta_loss(lazy, names, options, c, mode=mode, progress=False)
    _same_scores(want, got, names)
    assert all(p.device.type == "meta" for b in lazy.model.layers for p in b.parameters())  # released again
    assert all(v != 0 for s in got.values() for v in s.values())


@pytest.mark.parametrize("options,mode", OPTIONS)
def test_moe_scores_equal_the_whole_model_scores(tmp_path, options, mode):
    """Qwen3-MoE: fused experts tensors (weight terms summed over experts, each expert's inputs quantized in the
    routed loop, one static scale per expert calibrated with every token reaching every expert)."""
    model, folder, names = _moe(tmp_path)
    assert set(expert_tensors(model)) <= set(names)
    c = calib(6, 24).remainder(128)
    want = delta_loss(model, names, options, c, mode=mode, progress=False)
    got = sd.streamed_delta_loss(load_lazy(folder), names, options, c, mode=mode, progress=False)
    _same_scores(want, got, names)


def test_bf16_passes_stay_close(tmp_path):
    """Under bf16 autocast the blocks run the same operations in the same order: the scores agree closely too."""
    model, folder, names = _llama(tmp_path)
    c = calib(4, 24)
    want = delta_loss(model, names, ["w2g32"], c, dtype="bf16", progress=False)
    got = sd.streamed_delta_loss(load_lazy(folder), names, ["w2g32"], c, dtype="bf16", progress=False)
    for n in names:
        assert got["w2g32"][n] == pytest.approx(want["w2g32"][n], rel=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_the_plan_and_the_checkpoint_equal_the_whole_model_path(tmp_path, arch):
    """--avg-bits through the conductor: the same plan, then the block walk applies it to the same weights."""
    model, folder, _ = (_llama if arch == "llama" else _moe)(tmp_path)
    plan = build_plan(model, "w4g32")
    c = calib(8, 24).remainder(128)
    settings = MixedSettings(avg_bits=3.0, options=("w2g32", "w4g32"), nsamples=8, dtype="fp32")
    # RTN block by block does not calibrate experts (refused before the DeltaLoss passes): GPTQ on the MoE model
    method, knobs = ("rtn", {"search": True}) if arch == "llama" else ("gptq", {"search": False})
    if arch != "llama":
        with pytest.raises(ConfigError, match="RTN block by block does not calibrate fused experts"):
            quantize_model(load_lazy(folder), plan, "rtn", {"search": True}, calib=c, mixed=settings, progress=False)
    want = quantize_model(model, plan, method, knobs, calib=c, mixed=settings, progress=False)
    lazy = load_lazy(folder)
    got = quantize_model(lazy, plan, method, knobs, calib=c, mixed=settings, progress=False)
    assert got.to_json() == want.to_json()
    assert len({r.name for r in got.recipes()}) == 2  # the budget mixes both options
    assert not is_lazy(lazy) and same_weights(model, lazy)
    a, b = model.state_dict(), lazy.state_dict()  # the experts' stacks and everything else too
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_mixed_plan_over_weight_and_input_options_is_the_whole_model_plan(tmp_path):
    model, folder, names = _llama(tmp_path)
    c = calib(8, 24)
    settings = MixedSettings(avg_bits=3.5, options=("w2g32", "w4a4-mxfp4", "w4g32"), nsamples=8, dtype="fp32")
    plan = Plan.uniform(names, "w4g32")
    want = mixed_plan(model, plan, settings, c, progress=False)
    got = mixed_plan(load_lazy(folder), plan, settings, c, progress=False, folder=tmp_path / "off")
    assert got.plan.to_json() == want.plan.to_json()


def test_a_killed_run_does_not_score_finished_options_again(tmp_path, monkeypatch):
    """Each option's scores go to OFFLOAD/deltaloss/ when finished: killed after the first, the rerun scores the
    second only and returns the uninterrupted run's scores; other calibration tokens score everything anew."""
    model, folder, names = _llama(tmp_path)
    c = calib(6, 24)
    options = ["w2g32", "w4g32"]
    full = sd.streamed_delta_loss(load_lazy(folder), names, options, c, progress=False)

    class Killed(Exception):
        pass

    def kill(name):
        raise Killed(name)

    off = tmp_path / "off"
    with pytest.raises(Killed):
        sd.streamed_delta_loss(load_lazy(folder), names, options, c, progress=False, folder=off, on_option=kill)
    stored = sorted(p.name for p in (off / sd.SUBDIR).iterdir())
    assert stored == ["scores_w2g32.json"]
    scored = []
    real = sd._Passes.score

    def spy(self, recipe, amax):
        scored.append(recipe.name)
        return real(self, recipe, amax)

    monkeypatch.setattr(sd._Passes, "score", spy)
    again = sd.streamed_delta_loss(load_lazy(folder), names, options, c, progress=False, folder=off)
    assert scored == ["w4g32"] and again == full
    scored.clear()
    assert sd.streamed_delta_loss(load_lazy(folder), names, options, c, progress=False, folder=off) == full
    assert scored == []  # everything finished: no pass at all
    other = calib(6, 24, seed=5)
    sd.streamed_delta_loss(load_lazy(folder), names, options, other, progress=False, folder=off)
    assert scored == options  # another record: nothing reused
    body = json.loads((off / sd.SUBDIR / "scores_w2g32.json").read_text())
    assert body["record"]["calib_shape"] == [6, 24]


def test_disk_caches_give_the_same_scores(tmp_path):
    """--cache-device disk: the stored block inputs live in unlinked files under the offload folder."""
    _, folder, names = _llama(tmp_path)
    c = calib(4, 24)
    mem = sd.streamed_delta_loss(load_lazy(folder), names, ["w2g32"], c, progress=False)
    disk = sd.streamed_delta_loss(load_lazy(folder), names, ["w2g32"], c, progress=False, folder=tmp_path / "off",
                                  cache_device="disk")
    assert disk == mem
    assert [p.name for p in (tmp_path / "off" / sd.SUBDIR).iterdir()] == ["scores_w2g32.json"]


def test_what_the_streamed_passes_cannot_do_is_refused_before_any_work(tmp_path):
    model, folder, names = _llama(tmp_path)
    lazy = load_lazy(folder)
    lazy.config.output_router_logits = True
    with pytest.raises(ConfigError, match="output_router_logits.*drop --offload-dir"):
        sd.check_streamable(lazy, names)
    lazy.config.output_router_logits = False
    with pytest.raises(ConfigError, match="outside the decoder blocks"):
        sd.check_streamable(lazy, [*names, "model.embed_tokens"])
    lazy.lm_head.weight = lazy.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="shares its weight"):
        sd.check_streamable(lazy, [*names, "lm_head"])


def test_job_refusals_and_memory_estimate(tmp_path, tiny_hf_dir):
    """The job: --avg-bits with --offload-dir loads lazily; with --rotate / --awq or --kv-bits it is refused before
    loading, naming --offload-dir; the estimate holds the DeltaLoss phase, its caches moved to disk with the rest."""
    from lowbit.api.common import Calibration
    from lowbit.api.quantize import QuantizeJob, job_estimate
    from lowbit.ptq import memory

    mixed = MixedSettings(avg_bits=3.0, options=("w2g32", "w4g32"))
    common = dict(out=tmp_path / "q", model=str(tiny_hf_dir), method="gptq", mixed=mixed, evaluation=None,
                  offload_dir=str(tmp_path / "off"), calib=Calibration(nsamples=4, seqlen=32))
    job = QuantizeJob(**common)
    assert job.loads_lazily
    for extra, flag in (({"rotate": True}, "--rotate"), ({"awq": True}, "--awq"),
                        ({"kv": "fp8,int8", "kv_bits": 6.0, "method": "rtn"}, "--kv")):
        with pytest.raises(ConfigError, match="drop --offload-dir") as e:
            QuantizeJob(**{**common, **extra})
        assert flag in str(e.value)
    est = job_estimate(job)
    assert est is not None and {"deltaloss", "deltaloss_caches"} <= set(est.parts)
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    assert est.parts["deltaloss_caches"] == (cfg["num_hidden_layers"] + 2) * 4 * 32 * cfg["hidden_size"] * 4
    moved = memory.caches_on_disk(est)
    assert "deltaloss_caches" not in moved.parts and moved.disk["offload"] >= est.parts["deltaloss_caches"]
    # the scoring phase is not held at once with the walk: the peak is the larger of the two
    walk = sum(v for k, v in est.parts.items() if k in memory.WALK)
    scoring = est.parts["deltaloss"] + est.parts["deltaloss_caches"]
    rest = sum(v for k, v in est.parts.items() if k not in (*memory.WALK, *memory.APART, *memory.DELTALOSS))
    assert est.peak == rest + max(walk, scoring, *(est.parts.get(k, 0) for k in memory.APART))
    # without --offload-dir DeltaLoss back-propagates the whole model: its originals, gradients and autocast copies
    whole = job_estimate(QuantizeJob(**{**common, "offload_dir": None}))
    planned = cfg["num_hidden_layers"] * memory.Shape.from_config(cfg).block_params
    assert whole is not None and "deltaloss_caches" not in whole.parts and whole.parts["deltaloss"] > 12 * planned
    assert whole.peak > whole.parts["whole"] + whole.parts["deltaloss"]


def _cli(capsys, *argv):
    from lowbit.cli import main

    code = main(["quantize", *argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_cli_avg_bits_with_offload_dir_writes_the_in_memory_checkpoint_and_resumes(tmp_path, capsys, tiny_hf_dir,
                                                                                   monkeypatch):
    """`lowbit quantize --avg-bits --offload-dir`: DeltaLoss block by block, the plan and the checkpoint of the run
    without --offload-dir (dtype auto, as a user runs it); killed after its first option, the rerun scores the
    second only and writes the same checkpoint."""
    from lowbit.cli import main

    common = [str(tiny_hf_dir), "--method", "gptq", "--no-search", "--avg-bits", "3", "--options", "w2g32,w4g32",
              "--nsamples", "4", "--seqlen", "32", "--no-eval"]
    mem = _cli(capsys, *common, "--out", str(tmp_path / "mem"))
    real = sd._Passes.score
    scored = []

    def killed_after_first(self, recipe, amax):
        if scored:
            raise KeyboardInterrupt
        scored.append(recipe.name)
        return real(self, recipe, amax)

    monkeypatch.setattr(sd._Passes, "score", killed_after_first)
    lazy = [*common, "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path / "lazy")]
    assert main(["quantize", *lazy]) == 130
    assert not (tmp_path / "lazy").exists()
    assert [p.name for p in (tmp_path / "off" / sd.SUBDIR).iterdir()] == [f"scores_{scored[0]}.json"]
    again = []
    monkeypatch.setattr(sd._Passes, "score", lambda self, r, amax: again.append(r.name) or real(self, r, amax))
    got = _cli(capsys, *lazy)
    assert again == [n for n in ("w2g32", "w4g32") if n != scored[0]]
    assert got["scheme"] == mem["scheme"] and got["bits_per_weight"] == mem["bits_per_weight"]
    assert (tmp_path / "lazy" / "plan.json").read_text() == (tmp_path / "mem" / "plan.json").read_text()
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "lazy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {"deltaloss", "deltaloss_caches"} <= set(got["memory_estimate"]["parts"])
