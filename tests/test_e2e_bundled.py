"""End to end on the bundled SmolLM2-135M: w4g128 RTN -> save -> load -> eval."""

import json

import pytest
from conftest import skip_without_bundled

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _bundled():
    skip_without_bundled()


def test_quantize_save_load_eval_same_perplexity(tmp_path, capsys):
    from lowbit.cli import main

    out = tmp_path / "q"
    code = main(["quantize", "--scheme", "w4g128", "--method", "rtn", "--out", str(out),
                 "--windows", "4", "--eval-seqlen", "256", "--nsamples", "8", "--seqlen", "256", "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(r) >= {"model", "scheme", "method", "seconds", "ppl_fp", "ppl_q", "bits_per_weight", "out"}
    assert r["scheme"] == "w4g128:rule=search" and r["bits_per_weight_nominal"] == pytest.approx(4.125)
    # a 576-wide row stores 5 groups of 128 (the last padded): 640 4-bit codes + 5 fp16 scales per 576 weights;
    # per block 4608 such rows' worth of weights x 576, and 1536 x 576 in down_proj at exactly 4.125
    assert r["bits_per_weight"] == pytest.approx((4608 * (640 * 4 + 5 * 16) / 576 + 1536 * 4.125) / 6144, abs=1e-4)
    assert r["ppl_fp"] < r["ppl_q"] < 1.4 * r["ppl_fp"]

    code = main(["eval", str(out), "--windows", "4", "--seqlen", "256", "--json"])
    assert code == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e["ppl"] == r["ppl_q"]
    assert e["windows"] == 4 and e["tokens"] == r["eval_tokens"]
    # one definition of bits per weight: inspect reads the same figures back from the stored bytes
    assert main(["inspect", str(out), "--json"]) == 0
    i = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (i["bits_per_weight"], i["bits_per_weight_nominal"]) == (r["bits_per_weight"], r["bits_per_weight_nominal"])
