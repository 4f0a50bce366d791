"""SignRound / SignRoundV2 through the K-quants' double-quantized scales."""

import copy

import numpy as np
import pytest
import torch
from ptq_helpers import calib, tiny_model

from lowbit.formats import Scheme, quantize
from lowbit.nn import quant_layers
from lowbit.plans.plan import Plan
from lowbit.ptq.kquant_rounder import KQuantRounder
from lowbit.ptq.rtn import rtn_quantize
from lowbit.ptq.signround import make_config, signround_quantize

gguf = pytest.importorskip("gguf")
from lowbit.files.gguf_kquants import pack_kquant  # noqa: E402


def kplan(model, scheme: str) -> Plan:
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    return Plan.uniform(names, scheme)


def block_mse(q, fp, c) -> float:
    with torch.no_grad():
        return float((q(c).logits - fp(c).logits).pow(2).mean())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_untuned_rounder_is_the_rtn_result_and_exports_exact_blocks(bits):
    torch.manual_seed(bits)
    w = torch.randn(8, 512) * 0.05
    imp = torch.rand(512)
    s = Scheme.parse(f"q{bits}_k:rule=search")
    r = KQuantRounder(w, s, imp, v2=True)
    q = r.export()
    assert torch.equal(q.dequantize(), quantize(w, s, imp).dequantize())
    assert torch.equal(r().detach(), q.dequantize())
    with torch.no_grad():  # move offsets and factors: forward and export still agree, blocks stay exact
        r.v.add_(torch.randn_like(r.v) * 0.4)
        r.fs.mul_(1 + torch.randn_like(r.fs) * 0.2)
        r.fm.mul_(1 + torch.randn_like(r.fm) * 0.2)
        r.clamp_()
    q = r.export()
    assert torch.equal(r().detach(), q.dequantize())
    raw = pack_kquant(q)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[f"Q{bits}_K"])
    assert np.array_equal(ref, q.dequantize().numpy())


def test_gradients_reach_the_sub_block_scales_and_mins():
    r = KQuantRounder(torch.randn(4, 256), Scheme.parse("q4_k"), None, v2=False)
    r().pow(2).sum().backward()
    assert r.fs.grad.abs().sum() > 0 and r.fm.grad.abs().sum() > 0 and r.v.grad.abs().sum() > 0


@pytest.mark.parametrize("v2", [False, True])
def test_tuning_beats_searched_rtn_on_q2_k(v2):
    m = tiny_model(layers=1, hidden=256, inter=512)
    c = calib(16, 32)
    rtn, sr = copy.deepcopy(m), copy.deepcopy(m)
    rtn_quantize(rtn, kplan(m, "q2_k"), calib=c, search=True, progress=False)
    signround_quantize(sr, kplan(m, "q2_k"), make_config(iters=60, batch_size=8, v2=v2), c, progress=False)
    assert all(layer.scheme.super_block for layer in quant_layers(sr).values())
    assert block_mse(sr, m, c) < 0.9 * block_mse(rtn, m, c)


def test_deltaloss_mix_of_gguf_types_counts_llama_cpp_bits():
    from lowbit.ptq.allocate import layer_bits
    from lowbit.ptq.mixed import MixedSettings, mixed_plan

    m = tiny_model(layers=2, hidden=256, inter=512)
    names = [n for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and ".layers." in n]
    alloc = mixed_plan(m, Plan.uniform(names, "q4_k"), MixedSettings(avg_bits=3.5, options="q2_k,q3_k,q4_k,q6_k"),
                       calib(4, 32), progress=False)
    assert {s.name for s in alloc.plan.schemes()} <= {"q2_k", "q3_k", "q4_k", "q6_k"}
    assert len(alloc.plan.schemes()) > 1
    sizes = {n: (m.get_submodule(n).out_features, m.get_submodule(n).in_features) for n in names}
    assert alloc.total_bits == sum(layer_bits(alloc.plan[n], sizes[n]) for n in names)
    assert layer_bits(Scheme.parse("q4_k"), (8, 512)) == 8 * 2 * 144 * 8  # llama.cpp's bytes per block
    assert alloc.avg_bits <= 3.5
    # on rows that do not fit 256 a K option costs (and becomes) llama.cpp's fallback type
    assert layer_bits(Scheme.parse("q4_k"), (8, 576)) == layer_bits(Scheme.parse("w5g32"), (8, 576))
