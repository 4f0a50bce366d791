"""The benchmark scripts stay runnable: each imports cheaply and answers ``--help``.

The benchmarks are not run here (they take minutes to hours and their results are
committed), but a library change that breaks a script's imports or its argument parser
fails this test instead of the next person who runs the script. ``--help`` runs the
module exactly as ``python -m benchmarks.NAME --help`` does (``runpy`` with
``__main__``), in this process; one real subprocess checks the ``-m`` entry itself.
The shared helpers in ``benchmarks.common`` are checked against independent counts.
"""

from __future__ import annotations

import importlib
import json
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from ptq_helpers import tiny_model

ROOT = Path(__file__).resolve().parents[1]
# modules the scripts import, not scripts themselves: no main, no --help
HELPERS = ("__init__", "common", "kv_kl")
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in HELPERS)


def test_every_script_is_listed() -> None:
    assert {"formats", "llamacpp", "peft", "peft_speed", "ptq", "ptq_memory", "ptq_speed", "qat", "qat_codes",
            "qat_init"} <= set(SCRIPTS)


def test_imports_load_no_peer_and_touch_no_path() -> None:
    """Importing every script loads none of the peer libraries and leaves sys.path alone."""
    from benchmarks.common import PEERS

    path = list(sys.path)
    before = set(sys.modules)
    for name in SCRIPTS:
        mod = importlib.import_module(f"benchmarks.{name}")
        assert mod.__doc__, name
        assert callable(getattr(mod, "main", None)), name
    assert sys.path == path
    loaded = {m.split(".")[0] for m in set(sys.modules) - before}
    assert not loaded & set(PEERS), f"a benchmark imports a peer at import time: {loaded & set(PEERS)}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_exits_zero(name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", "--help"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules" after the import test
        runpy.run_module(f"benchmarks.{name}", run_name="__main__")
    assert e.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_module_entry_in_a_fresh_process() -> None:
    r = subprocess.run([sys.executable, "-m", "benchmarks.ptq", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: python -m benchmarks.ptq" in r.stdout


def test_missing_peer_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import common

    monkeypatch.setattr(common, "has_peer", lambda module: False)
    with pytest.raises(SystemExit) as e:
        common.require_peer("auto_round", "pass --tools lowbit")
    msg = str(e.value.code)
    assert "\n" not in msg and "auto-round" in msg and "pip install" in msg and "--tools lowbit" in msg


def test_ptq_refuses_autoround_without_it_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import common, ptq

    monkeypatch.setattr(common, "has_peer", lambda module: False)
    monkeypatch.setattr(ptq, "run_child", lambda *a, **k: pytest.fail("ran a child"))
    with pytest.raises(SystemExit, match="auto-round"):
        ptq.main(["--configs", "rtn-w4g128", "--tools", "lowbit,autoround"])
    with pytest.raises(SystemExit, match="unknown config"):
        ptq.main(["--configs", "nope", "--tools", "lowbit"])


def test_ptq_lowbit_jobs_build_for_every_config() -> None:
    model = tiny_model()
    """Every lowbit config of benchmarks.ptq maps onto valid settings of the current API."""
    from benchmarks import ptq
    from lowbit.ptq import make_settings

    for name, tools in ptq.CONFIGS.items():
        if "lowbit" not in tools:
            continue
        spec = ptq.with_iters(tools["lowbit"], 1)
        method, plan, settings, mixed = ptq.lowbit_job(spec, model)
        make_settings(method, settings)
        assert len(plan) > 0, name
        assert (mixed is not None) == ("avg_bits" in spec and "positional" not in spec), name
    rtn = ptq.lowbit_job(ptq.CONFIGS["rtn-w4g128"]["lowbit"], model)
    assert rtn[2] == {"search": False}  # plain RTN, auto-round's disable_opt_rtn peer


def test_merge_row_replaces_by_key(tmp_path: Path) -> None:
    from benchmarks.common import load_results, merge_row

    out = tmp_path / "r.json"  # an absolute path is used as is
    merge_row(out, {"config": "a", "tool": "x", "v": 1}, ("config", "tool"))
    merge_row(out, {"config": "a", "tool": "y", "v": 2}, ("config", "tool"))
    merge_row(out, {"config": "a", "tool": "x", "v": 3}, ("config", "tool"), protocol="p")
    data = json.loads(out.read_text())
    assert sorted((r["tool"], r["v"]) for r in data["rows"]) == [("x", 3), ("y", 2)]
    assert data["protocol"] == "p"
    merge_row(out, {"config": "a", "tool": "z", "v": 4}, lambda r: (r["config"],))  # a key function
    assert [r["v"] for r in load_results(out)["rows"]] == [4]
    assert load_results(tmp_path / "none.json", empty={}) == {}

def test_bigmodel_keeps_one_cpus_rows_beside_anothers(tmp_path: Path) -> None:
    """CPU seconds of different machines are not comparable: a row measured on another CPU is kept beside the old one
    (rows before session 6 name no cpu), a row on the same CPU replaces it; --table --this-cpu shows one CPU's."""
    from benchmarks import bigmodel

    out = tmp_path / "b.json"
    row = {"shape": "s", "scheme": "q4_k_m", "tool": "lowbit-stream", "rule": "fit", "rc": 0, "seconds": 1.0,
           "cpu_seconds": 1.0, "peak_rss_gib": 1.0, "output_bytes": 1, "source_bytes": 2}
    bigmodel.save([row], out)
    bigmodel.save([{**row, "cpu": "EPYC AVX-512", "cpu_seconds": 2.0}], out)
    bigmodel.save([{**row, "cpu": "EPYC AVX-512", "cpu_seconds": 3.0}], out)
    assert sorted(r["cpu_seconds"] for r in json.loads(out.read_text())["rows"]) == [1.0, 3.0]
    assert isinstance(bigmodel.cpu_model(), str)
    ballast = bytearray(256 << 20)  # this process's peak now exceeds 256 MiB: a child must not report it as its own
    ballast[::4096] = b"x" * len(ballast[::4096])
    loads: list[float] = []
    rc, _, cpu, rss = bigmodel.child([sys.executable, "-S", "-c", "pass"], tmp_path / "c.log", loads=loads)
    assert rc == 0 and cpu >= 0 and 0 < rss < 128 << 20 and loads
    rc, *_ = bigmodel.child([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "c.log")
    assert rc == 3
    del ballast


def test_bigmodel_tree_rss_sums_a_tool_and_its_worker(tmp_path: Path) -> None:
    """wait4's peak is the largest process of a tree, not the sum: a tool quantizing in a worker process (auto-round's
    model-free path) is also sampled as the summed tree, here a parent and its worker each holding 96 MiB."""
    from benchmarks import bigmodel

    hold = "import time; b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep({})"
    code = (f"import subprocess, sys; w = subprocess.Popen([sys.executable, '-S', '-c', {hold.format(3)!r}]); "
            f"{hold.format(3)}; w.wait()")
    tree: list[int] = []
    rc, _, _, rss = bigmodel.child([sys.executable, "-S", "-c", code], tmp_path / "t.log", tree=tree)
    assert rc == 0 and tree
    assert rss < 160 << 20 < max(tree), (rss >> 20, max(tree) >> 20)  # one process's peak vs the two at once



def test_alternating_reverses_every_other_round() -> None:
    from benchmarks.common import alternating

    assert list(alternating(["a", "b"], 3)) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def test_tuning_gflop_counts() -> None:
    """3 GEMMs (forward, weight and input gradients) of 2 x params x tokens each, q/k/v without dX."""
    from benchmarks.common import tuning_gflop
    from lowbit.models import linear_layers

    model = tiny_model()
    layers = linear_layers(model)
    params = sum(m.weight.numel() for m in layers.values())
    qkv = sum(m.weight.numel() for n, m in layers.items() if n.endswith(("q_proj", "k_proj", "v_proj")))
    assert qkv > 0
    tokens, iters = 64, 5
    assert tuning_gflop(model, iters, tokens, qkv_input_grad=True) == pytest.approx(
        6 * params * tokens * iters / 1e9)
    assert tuning_gflop(model, iters, tokens) == pytest.approx((6 * params - 2 * qkv) * tokens * iters / 1e9)


def test_fresh_clone_records_the_load_average_its_times_hold_for() -> None:
    """Issue 38: the README's fresh-clone times held on an idle machine only; each row now says its load."""
    import time

    from benchmarks.fresh_clone import LoadSampler

    with LoadSampler(every=0.01) as load:
        time.sleep(0.1)
    s = load.summary()
    assert set(s) == {"load_before", "load_mean", "load_max", "cpus"} and len(load.samples) > 2
    assert 0 <= s["load_before"] and s["load_mean"] <= s["load_max"]


def _tiny_moe(experts: int = 4):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True)
    return Qwen3MoeForCausalLM(cfg).eval()


def test_organism_moe_counts_parameters_by_kind_and_tokens_per_expert() -> None:
    """The MoE organism's accounting: every parameter in one kind (tied embeddings once), experts =
    layers x E x 3 x I x H, routed tokens = tokens x top-k per layer."""
    import torch

    from benchmarks.organism import expert_tokens, load_summary, param_kinds

    model = _tiny_moe()
    kinds = param_kinds(model)
    assert kinds["total"] == sum(p.numel() for p in model.parameters())
    assert sum(v for k, v in kinds.items() if k not in ("total", "active_per_token", "shares")) == kinds["total"]
    assert kinds["experts"] == 2 * 4 * 3 * 16 * 32 and kinds["router"] == 2 * 4 * 32
    assert kinds["embeddings"] == 64 * 32 and kinds["active_per_token"] == kinds["total"] - kinds["experts"] // 2
    counts = expert_tokens(model, torch.randint(0, 64, (3, 10)), batch=2)
    assert counts.shape == (2, 4) and (counts.sum(dim=1) == 3 * 10 * 2).all()
    s = load_summary(torch.tensor([[5, 5, 5, 5], [0, 10, 4, 6]]))
    assert s["min_share"] == 0.0 and s["max_share"] == 2.0 and s["experts_without_tokens"] == 1


def test_organism_balance_loss_is_one_when_balanced_and_grows_with_skew() -> None:
    import torch

    from benchmarks.organism import balance_loss

    experts, top_k = 4, 2
    rows = torch.arange(8) % experts  # each expert picked equally often, with equal mean probability
    balanced = torch.zeros(8, experts)
    balanced[torch.arange(8), rows] = 3.0
    balanced[torch.arange(8), (rows + 1) % experts] = 3.0
    skewed = torch.zeros(8, experts)
    skewed[:, :2] = 3.0  # every token to experts 0 and 1, in one layer of the two
    assert balance_loss((balanced, balanced), top_k).item() == pytest.approx(1.0)
    assert balance_loss((balanced, skewed), top_k).item() > 1.3


def test_acts_per_call_input_scales_follow_each_input() -> None:
    """The peers' convention row: an input 100x the calibrated maximum saturates with lowbit's static NVFP4 tensor
    scale, and is quantized as well as a calibrated-size one once the scale follows each call."""
    import torch
    from torch import nn

    from benchmarks.acts import per_call_input_scales
    from lowbit.formats.inputs import InputScheme
    from lowbit.nn.input_quant import InputQuantizer

    torch.manual_seed(0)
    model = nn.Sequential(InputQuantizer(InputScheme.base("nvfp4"), amax=4.0))
    x = torch.randn(8, 64) * 100.0
    err = lambda: float((model(x) - x).norm() / x.norm())  # noqa: E731
    static = err()
    assert per_call_input_scales(model) == 1
    assert static > 0.5 and err() < 0.15, (static, err())
    with pytest.raises(RuntimeError, match="no static input quantizer"):
        per_call_input_scales(nn.Sequential(nn.Linear(4, 4)))


def test_acts_own_weight_tensor_scales_give_each_fused_part_its_own_and_restore_sharing() -> None:
    """The fouroversix-convention row: inside the context RTN quantizes q/k/v and gate/up with each weight's own
    NVFP4 tensor scale (not the group's shared smallest one); afterwards RTN shares again."""
    from ptq_helpers import uniform

    from benchmarks.acts import own_weight_tensor_scales
    from lowbit.files.fused import fused_groups
    from lowbit.formats import Scheme
    from lowbit.models.fused import own_tensor_scale
    from lowbit.nn import quant_layers
    from lowbit.ptq import quantize_model

    def scales(own_scales: bool) -> tuple[dict, list]:
        model = tiny_model()
        plan = uniform(model, "nvfp4")
        own = {n: float(own_tensor_scale(model.get_submodule(n).weight, Scheme.parse("nvfp4"))) for n in plan}
        with own_weight_tensor_scales(own_scales):
            quantize_model(model, plan, "rtn", {"search": False}, progress=False)
        got = {n: float(m.tensor_scale) for n, m in quant_layers(model).items()}
        return {n: (got[n], own[n]) for n in plan}, fused_groups(plan)

    pairs, groups = scales(True)
    assert all(got == own for got, own in pairs.values())
    assert any(len({pairs[n][1] for n in g}) > 1 for g in groups)  # sharing would have changed some
    pairs, _ = scales(False)  # the context restored RTN's sharing
    for g in groups:
        assert {pairs[n][0] for n in g} == {min(pairs[n][1] for n in g)}


def test_kv_scales_errors_are_the_softmax_weighted_score_variance_and_the_mixed_value_error() -> None:
    """benchmarks.kv_scales' criteria against a loop over queries with torch's float8 cast: per candidate, the keys'
    sum over queries of Var_p(q . dk * scaling) (every 4th query, causal) — about twice KL(p || p_quantized) — and
    the values' |p @ dv|^2."""
    import torch

    from benchmarks.kv_scales import QUERY_STRIDE, candidate_errors, factors

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16) * 4, torch.randn(1, 1, 8, 16)
    ks, vs = k.abs().amax() / 448, v.abs().amax() / 448
    ek, ev = candidate_errors(q, k, v, ks, vs, 0.25)
    fp8 = lambda x, s: (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s  # noqa: E731
    for i, f in enumerate(factors()):
        dk, dv = fp8(k, ks * f) - k, fp8(v, vs * f) - v
        want_k = want_v = kl = 0.0
        for h in range(2):
            for t in range(0, 8, QUERY_STRIDE):
                s = (k[0, 0, : t + 1] @ q[0, h, t]) * 0.25
                ds = (dk[0, 0, : t + 1] @ q[0, h, t]) * 0.25
                p = s.softmax(0)
                want_k += float((p * ds * ds).sum() - (p * ds).sum() ** 2)
                want_v += float((p @ dv[0, 0, : t + 1]).pow(2).sum())
                kl += float((p * (p.log() - (s + ds).log_softmax(0))).sum())
        assert ek[i] == pytest.approx(want_k, rel=1e-4, abs=1e-9) and ev[i] == pytest.approx(want_v, rel=1e-4)
        assert kl == pytest.approx(want_k / 2, rel=0.25)  # second order: third-order terms remain


def _vllm_cpu_e4m3_write(v: np.ndarray, inv_scale: float) -> np.ndarray:
    """vLLM CPU's FP8 cache write as its C++ states it (``float_to_fp8e4m3_scalar``): scale, clamp to
    +-448, move the exponent bias by 2^-120, keep the float32 bits 20..26 (sign apart), 0x7F reserved."""
    y = np.clip(v.astype(np.float32) * np.float32(inv_scale), -448.0, 448.0).astype(np.float32)
    bits = (y * np.float32(2.0 ** -120)).astype(np.float32).view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    payload = np.minimum((bits >> 20) & 0x7F, 0x7E).astype(np.uint8)
    return np.where(y == 0, 0, sign | payload).astype(np.uint8)


def test_kv_vllm_probe_cache_write_is_vllm_cpus_truncating_cast() -> None:
    """The probe's emulation equals a bit-level transcription of vLLM's write, which rounds toward zero."""
    import torch

    from benchmarks.kv_vllm_probe import vllm_cpu_cache_write

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 3, torch.randn(1000, generator=g) * 1e-3,
                   torch.tensor([0.0, -0.0, 600.0, -600.0, 1e-9])]).to(torch.bfloat16)
    s = torch.tensor(0.0123)
    got = vllm_cpu_cache_write(x, s).float()
    codes = _vllm_cpu_e4m3_write(x.float().numpy(), float(1.0 / s))
    want = (torch.from_numpy(codes).view(torch.float8_e4m3fn).float() * s).to(x.dtype).float()  # read back in x's dtype
    assert torch.equal(got, want)
    rne = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert (got.abs() <= x.float().abs() + 1e-12).all() and (got != rne).any()  # toward zero, not nearest
