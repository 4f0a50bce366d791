"""`lowbit quantize`'s method flags come from the methods' settings dataclasses.

Every flag the hand-written parser had keeps its name and meaning (the table below is
that parser's, at ea37487), and a method registered with `knob` fields gets its flags
without any edit to the command line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from lowbit.cli import build_parser
from lowbit.cli.quantize import build_job
from lowbit.errors import ConfigError
from lowbit.ptq.methods import METHODS, Method, knob, method_flags, register

# (argv after `lowbit quantize --out o`, the settings field it sets, the value) for every old method flag
OLD_FLAGS = [
    (["--method", "rtn", "--search"], "search", True),
    (["--method", "rtn", "--no-search"], "search", False),
    (["--method", "gptq", "--no-search"], "search", False),
    (["--method", "gptq", "--damp", "0.05"], "damp", 0.05),
    (["--method", "gptq", "--act-order"], "act_order", True),
    (["--method", "gptq", "--no-act-order"], "act_order", False),
    (["--method", "gptq", "--no-act-order", "--static-groups"], "static_groups", True),
    (["--method", "gptq", "--no-static-groups", "--no-act-order"], "static_groups", False),
    (["--method", "gptq", "--lazy-batch", "64"], "lazy_batch", 64),
    (["--method", "gptq", "--true-sequential"], "true_sequential", True),
    (["--method", "gptq", "--no-true-sequential"], "true_sequential", False),
    (["--method", "signround", "--iters", "0"], "iters", 0),
    (["--method", "signround2", "--iters", "7"], "iters", 7),
    (["--method", "signround", "--batch-size", "4"], "batch_size", 4),
    (["--method", "signround2", "--fp-inputs"], "fp_inputs", True),
    (["--method", "signround", "--tune-dtype", "fp32"], "tune_dtype", "fp32"),
    (["--method", "signround", "--tune-dtype", "bf16"], "tune_dtype", "bf16"),
    (["--method", "signround", "--cache-dtype", "bf16"], "cache_dtype", "bf16"),
    (["--method", "signround2", "--compile"], "compile", True),
    (["--method", "signround", "--preset", "light"], "iters", 50),
    (["--method", "signround2", "--seed", "3"], "seed", 3),
]


def _job(argv: list[str], tmp_path):
    args = build_parser().parse_args(["quantize", "--out", str(tmp_path / "o"), "--no-eval", *argv])
    return build_job(args)


@pytest.mark.parametrize(("argv", "name", "value"), OLD_FLAGS, ids=[" ".join(a) for a, _, _ in OLD_FLAGS])
def test_every_old_flag_parses_to_the_same_setting(argv, name, value, tmp_path):
    assert getattr(_job(argv, tmp_path).settings, name) == value


@pytest.mark.parametrize(("argv", "why"), [
    (["--method", "signround", "--iters", "-1"], "--iters must be >= 0"),
    (["--method", "signround", "--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--method", "gptq", "--lazy-batch", "0"], "--lazy-batch must be a positive integer"),
    (["--method", "signround", "--tune-dtype", "fp16"], "invalid choice"),
    (["--method", "gptq", "--damp", "x"], "invalid float value"),
])
def test_old_limits_hold(argv, why, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _job(argv, tmp_path)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_a_flag_of_another_method_is_refused_naming_the_takers(tmp_path):
    with pytest.raises(ConfigError, match=r"--iters does not apply to --method gptq; it applies to --method "
                                          r"signround \| signround2"):
        _job(["--method", "gptq", "--iters", "5"], tmp_path)
    with pytest.raises(ConfigError, match=r"--damp does not apply to --method rtn; it applies to --method gptq"):
        _job(["--damp", "0.1"], tmp_path)


def test_help_names_each_flag_its_methods_and_default():
    text = {f.name: f.help for f in method_flags()}
    assert text["search"].startswith("rtn, gptq: ") and text["search"].endswith("(default on)")
    assert text["lazy_batch"] == "gptq: columns per lazy batch update (default 128)"
    assert text["preset"] == "signround, signround2: light | default | best"
    assert "seed" not in text and "lr" not in text  # fields without a knob have no flag


@dataclass(frozen=True)
class _ToySettings:
    strength: int = knob(3, "how hard the toy method pushes", minimum=1)
    gentle: bool = knob(False, "push gently")
    note: str = "not a flag"


@pytest.fixture
def toy_method():
    register(Method("toy", _ToySettings, lambda model, plan, settings, ctx: plan, blockwise=False,
                    needs_calib=lambda _s: False, summary="a toy method"))
    yield
    del METHODS["toy"]


def test_a_new_method_gets_its_flags_from_its_settings(toy_method, tmp_path, capsys):
    job = _job(["--method", "toy", "--strength", "5", "--gentle"], tmp_path)
    assert job.settings == _ToySettings(strength=5, gentle=True)
    assert _job(["--method", "toy"], tmp_path).settings == _ToySettings()
    with pytest.raises(SystemExit):
        _job(["--method", "toy", "--strength", "0"], tmp_path)
    assert "--strength must be a positive integer" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--strength does not apply to --method rtn; it applies to --method toy"):
        _job(["--strength", "2"], tmp_path)
    helps = {a.dest: a.help for a in _quantize_parser()._actions}
    assert helps["strength"] == "toy: how hard the toy method pushes (default 3)"
    assert "toy" in helps["method"]


def _quantize_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["quantize"]
