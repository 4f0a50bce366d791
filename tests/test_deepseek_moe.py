"""DeepSeek-V3 quantized whole (issue 34 point 4): MLA attention, a dense first layer, shared experts, and
sigmoid routing with group-limited top-k and a score-correction bias.

A tiny random model from transformers' ``DeepseekV3Config`` (`test_accounting.make`: 2 layers, the first dense,
8 routed experts in 2 groups with top-2 and one group kept, one shared expert, q/kv LoRA ranks 16). References:
the float model's own forward on the dequantized experts (the routing must stay the model's, bit for bit), the
accounting of every matmul weight, the native checkpoint's exact round trip, and transformers + compressed-tensors
reading the export back with the same logits.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_accounting import _last, _save, make
from test_experts import _reference

from lowbit.cli import main
from lowbit.files.native import load, save
from lowbit.models.accounting import account_model
from lowbit.models.experts import expert_tensors
from lowbit.nn.quant_experts import quant_stacks
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan
from lowbit.ptq import quantize_model
from lowbit.ptq.signround import make_config, signround_quantize

pytestmark = pytest.mark.usefixtures("one_thread")


def deepseek() -> torch.nn.Module:
    """The tiny DeepSeek-V3 with a score-correction bias that changes which groups and experts win.

    The bias is a buffer saved with the checkpoint; zero (as the config builds it) it would not test that the
    routing reads it.
    """
    model = make("deepseek_v3")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    return model


def _ids(seed: int = 1, n: int = 2, seqlen: int = 24) -> torch.Tensor:
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _routing(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, weights) the MoE layer's router picks for its input in ``model``'s forward."""
    got = {}
    gate = model.model.layers[1].mlp.gate
    h = gate.register_forward_hook(lambda _m, _a, out: got.setdefault("out", out))
    with torch.no_grad():
        model(ids)
    h.remove()
    _, w, idx = got["out"]
    return idx, w


def test_the_architecture_is_what_the_tests_claim():
    model = deepseek()
    mlp = model.model.layers[1].mlp
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # first_k_dense_replace=1
    assert type(mlp).__name__ == "DeepseekV3MoE" and hasattr(mlp, "shared_experts")
    assert hasattr(model.model.layers[0].self_attn, "kv_b_proj")  # MLA
    idx, w = _routing(model, _ids())
    groups = (idx // 4).reshape(-1, 2)
    assert bool((groups[:, 0] == groups[:, 1]).all())  # topk_group=1: both picks from one group of 4
    assert float(w.sum(-1).max()) > 1.0 and bool((w > 0).all())  # sigmoid scores, renormalised, times 2.5
    plain = make("deepseek_v3")  # the same weights without the correction bias route differently
    assert not torch.equal(_routing(plain, _ids())[0], idx)


@pytest.mark.parametrize("scheme", ("w4g8", "nvfp4"))
def test_quantized_experts_keep_the_routing_and_run_the_float_forward_on_dequantized_weights(scheme):
    model = deepseek()
    plan = build_plan(model, scheme)
    experts = expert_tensors(model)
    assert set(experts) == {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    q = copy.deepcopy(model)
    quantize_model(q, Plan({n: plan[n] for n in experts}), "rtn", {"search": False}, progress=False, keep16=False)
    assert len(quant_stacks(q)) == 2 and not expert_tensors(q)
    ref = _reference(model, q)
    ids = _ids()
    with torch.no_grad():
        got, want, fp = q(ids).logits, ref(ids).logits, model(ids).logits
    assert torch.equal(got, want) and not torch.equal(got, fp)
    # the MoE layer's input differs only through layer 0 (float here): the router sees the same tokens
    assert all(torch.equal(a, b) for a, b in zip(_routing(q, ids), _routing(ref, ids), strict=True))


def test_every_matmul_weight_is_quantized_but_the_router_embeddings_and_head():
    model = deepseek()
    quantize_model(model, build_plan(model, "w4g8"), "rtn", {"search": False}, progress=False)
    acc = account_model(model).to_dict()
    assert set(acc["float"]) == {"router", "embeddings", "lm_head"}
    assert set(acc["quantized"]) == {"attention", "mlp", "experts", "shared_experts"}  # MLA's q_a/q_b/kv_a/kv_b/o
    assert acc["float"]["router"] == 8 * 32  # the routed experts' router only (no shared-expert gate here)
    names = {n for n, m in model.named_modules() if type(m).__name__ == "QuantLinear"}
    for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert {f"model.layers.{i}.self_attn.{part}" for i in (0, 1)} <= names
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, torch.linspace(-0.3, 0.3, 8))


def test_gptq_and_signround2_quantize_the_experts_with_every_expert_calibrated():
    model = deepseek()
    calib = _ids(0, 8, 32)
    plan = build_plan(model, "w2g8")
    experts = Plan({n: plan[n] for n in expert_tensors(model)})
    with torch.no_grad():
        fp = model(calib).logits
    rtn, gptq, sr2 = (copy.deepcopy(model) for _ in range(3))
    quantize_model(rtn, experts, "rtn", {"search": False}, calib=calib, progress=False, keep16=False)
    quantize_model(gptq, experts, "gptq", {}, calib=calib, progress=False, keep16=False)
    infos = signround_quantize(sr2, experts, make_config(iters=30, batch_size=4, v2=True), calib, progress=False)
    router = model.model.layers[1].mlp.gate.weight

    def mse(m):
        with torch.no_grad():
            return float((m(calib).logits - fp).pow(2).mean())

    for m in (gptq, sr2):
        assert len(quant_stacks(m)) == 2 and not expert_tensors(m)
        assert all(bool(torch.isfinite(s.scales.float()).all()) for s in quant_stacks(m).values())
        assert torch.equal(m.model.layers[1].mlp.gate.weight, router)  # the router is frozen
        assert mse(m) < mse(rtn)
    cov = quant_stacks(gptq)["model.layers.1.mlp.experts.gate_up_proj"].calibration
    assert cov["all_experts"] and min(cov["statistics_tokens"]) == 8 * 32  # every expert saw every token
    assert sum(cov["routed"]) == 8 * 32 * 2  # top-2 of the group-limited sigmoid router
    assert all(i["loss"] < i["rtn_loss"] for i in infos if "rtn_loss" in i)


def test_native_checkpoint_round_trips_bit_for_bit(tmp_path, tiny_tokenizer):
    model = deepseek()
    quantize_model(model, build_plan(model, "w4g8"), "rtn", {"search": False}, progress=False)
    save(model, tiny_tokenizer, tmp_path / "q")
    spec = json.loads((tmp_path / "q" / "lowbit.json").read_text())["layers"]
    assert spec["model.layers.1.mlp.experts.gate_up_proj"]["experts"] == 8
    back, _ = load(tmp_path / "q")
    for name, s in quant_stacks(model).items():
        t = quant_stacks(back)[name]
        assert torch.equal(t.codes, s.codes) and torch.equal(t.scales, s.scales)
    assert torch.equal(back.model.layers[1].mlp.gate.e_score_correction_bias, torch.linspace(-0.3, 0.3, 8))
    ids = _ids(2, 1, 16)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_compressed_tensors_export_is_per_expert_and_transformers_reads_the_same_logits(tmp_path):
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lowbit.files import compressed_tensors as ct

    model = deepseek()
    quantize_model(model, build_plan(model, "w4g8"), "rtn", {"search": False}, progress=False)
    ct.export(model, None, tmp_path / "ct")
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        have = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    # vLLM's deepseek_v2 loader: experts.{e}.{gate,up,down}_proj (ckpt_*_proj_name), shared_experts as Linears
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{proj}.weight_packed" in have
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight_packed" in have
    assert "model.layers.1.self_attn.kv_b_proj.weight_packed" in have and "model.layers.1.mlp.gate.weight" in have
    assert torch.equal(bias.float(), torch.linspace(-0.3, 0.3, 8))
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.gate" in qc["ignore"]
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32).eval()
        assert torch.equal(theirs(ids).logits, want)
        ours = ct.load_decompressed(tmp_path / "ct")
        assert torch.equal(ours(ids).logits, want)


def test_mla_parts_vllm_fuses_must_share_a_recipe_in_compressed_tensors():
    """vLLM loads MLA's q_a_proj and kv_a_proj_with_mqa as one ``fused_qkv_a_proj`` (deepseek_v2.py's
    mla_params_mapping): the writer names them when their recipes differ, as it does for q/k/v."""
    from lowbit.files.compressed_tensors import vllm_fused_notes
    from lowbit.files.fused import fused_groups
    from lowbit.files.specs import LayerSpec
    from lowbit.formats import Scheme

    names = ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"]
    assert fused_groups(names) == [names]
    specs = [LayerSpec(n, Scheme.parse(s), None, (16, 32)) for n, s in zip(names, ("w4g8", "w8g8"), strict=True)]
    notes = vllm_fused_notes(specs)
    assert len(notes) == 1 and "q_a_proj, model.layers.0.self_attn.kv_a_proj_with_mqa have different" in notes[0]


def test_kv_cache_quantization_of_mla_is_refused_by_name(tmp_path, tiny_tokenizer, capsys):
    """MLA caches a compressed latent and one shared RoPE key, not per-head keys and values: lowbit's KV
    quantization (per-head keys / values) does not instrument it and says so before any work."""
    src = _save("deepseek_v3", tmp_path / "ds", tiny_tokenizer)
    out = tmp_path / "q"
    assert main(["quantize", str(src), "--scheme", "w4g8", "--kv", "fp8", "--method", "rtn", "--no-eval",
                 "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lowbit")]
    assert len(err) == 1 and "DeepseekV3ForCausalLM" in err[0] and "drop --kv" in err[0]
    assert not out.exists()
    assert main(["quantize", str(src), "--scheme", "w4g8", "--method", "rtn", "--no-search", "--no-eval", "--json",
                 "--out", str(out)]) == 0
    assert set(_last(capsys)["matmul_weights"]["float"]) == {"router", "embeddings", "lm_head"}


def test_w4a4_nvfp4_experts_with_per_expert_input_scales_round_trip_through_compressed_tensors(tmp_path):
    """RTN calibrates one input scale per expert (the routed sum written out per expert); lowbit's reader brings
    the very scales back from the per-expert export, so the folder evaluates as the model did."""
    pytest.importorskip("compressed_tensors")
    from lowbit.files import compressed_tensors as ct
    from lowbit.formats.inputs import encode_scale

    model = deepseek()
    nv, rest = build_plan(model, "w4a4-nvfp4"), build_plan(model, "w4g8")
    # the other Linears in a format compressed-tensors decompresses exactly (its NVFP4 Linears run bf16 weights)
    plan = Plan({n: nv[n] if ".experts." in n else r for n, r in rest.items()})
    quantize_model(model, plan, "rtn", {"search": False}, calib=_ids(0, 4, 32), progress=False)
    stacks = quant_stacks(model)
    assert all(s.input_amax is not None and s.input_amax.shape == (8,) for s in stacks.values())
    ct.export(model, None, tmp_path / "ct")
    back = ct.load_decompressed(tmp_path / "ct")
    for name, s in stacks.items():
        t = quant_stacks(back)[name]
        assert torch.equal(t.codes, s.codes) and t.input_scheme == s.input_scheme
        assert torch.equal(encode_scale(t.input_scheme, t.input_amax), encode_scale(s.input_scheme, s.input_amax))
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
