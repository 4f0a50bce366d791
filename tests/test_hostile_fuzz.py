"""Random scheme strings, plan files and safetensors headers through the real CLI (issue 31).

Each input either runs (exit 0, and every tensor written is finite) or is refused (exit
2, exactly one error line, nothing written): no traceback, no NaN, no half-written
output. The strategies mix valid inputs with every kind of bad number (inf, nan, 1e38,
1e-42, 32.5, negative, huge, text where a number belongs), so both outcomes are hit.
Examples are few and the model tiny, to keep the file within a few tens of seconds;
hypothesis draws new ones on every run.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from lowbit.cli import main
from lowbit.errors import LowbitError, SchemeError
from lowbit.formats import InputScheme, Recipe, Scheme, quantize
from lowbit.formats import inputs as input_formats
from lowbit.formats import recipe as recipes
from lowbit.formats import scheme as schemes
from lowbit.formats.finite import nonfinite
from lowbit.formats.ranges import fit

CLI = settings(max_examples=25, deadline=None, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

NUMBERS = ["inf", "-inf", "nan", "1e38", "1e-42", "0", "-1", "1", "2", "3", "4", "5", "8", "16", "32", "32.5",
           "64", "128", "256", "448", "449", "0.015625", "1e300", "99999999999999999999"]
WORDS = ["absmax", "4over6", "span", "brute", "search", "mse", "mae", "max", "fp16", "fp32", "bf16", "e4m3",
         "ue5m3", "e8m0", "int", "e2m1", "floor", "ceil", "nearest", "even", "rceil", "1", "0", "yes", "no", ""]
VALUE = st.one_of(st.sampled_from(NUMBERS + WORDS), st.integers(-300, 300).map(str),
                  st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text("ab=,:@-1.", max_size=4))
KEYS = sorted({*schemes._OPTIONS, *input_formats._OPTIONS}) + ["bogus"]


def _texts(bases: list[str]) -> st.SearchStrategy[str]:
    opts = st.lists(st.tuples(st.sampled_from(KEYS), VALUE), max_size=3)
    return st.builds(lambda b, o: b + (":" + ",".join(f"{k}={v}" for k, v in o) if o else ""),
                     st.sampled_from(bases), opts)


INT_BASES = st.builds(lambda b, g, a: f"w{b}" + (f"g{g}" if g is not None else "") + ("a" if a else ""),
                      st.integers(0, 10), st.one_of(st.none(), st.sampled_from([0, 1, 7, 16, 32, 64, 128, 10**9])),
                      st.booleans())
WEIGHT = st.one_of(_texts(list(schemes.PRESETS)), INT_BASES)
INPUT = _texts(list(input_formats.PRESETS))
RECIPE = st.one_of(WEIGHT, st.sampled_from(list(recipes.PRESETS)), st.builds(lambda w, i: f"{w}@{i}", WEIGHT, INPUT),
                   st.builds(lambda w, s: f"{w}-{s}", WEIGHT, st.sampled_from(["a8", "afp8"])))


def _weight() -> torch.Tensor:
    """[16, 64] weights with what breaks scale formats: a 5e5 outlier row, a tiny row, a zero row."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    w[2] *= 3e7
    w[5] *= 1e-6
    w[7] = 0
    return w


@settings(max_examples=300, deadline=None, database=None)
@given(RECIPE)
@example("nvfp4:block=4@int8")  # a weight with options and an input with a suffix form: named back with @
def test_fuzz_scheme_text_parses_or_refuses_in_one_line(text):
    """Any text: a `SchemeError` of one line, or a recipe whose quantized weights are finite."""
    try:
        r = Recipe.parse(text)
    except SchemeError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert Scheme.parse(r.weight.name) == r.weight and Recipe.parse(r.name) == r  # names round-trip
    w = _weight()
    try:
        r.check_width(w.shape[1])
    except SchemeError as e:
        assert "\n" not in str(e)
        return
    fitted = fit(w, r.weight)
    if fitted.scheme is None:  # the format cannot hold this layer: it stays float
        return
    q = quantize(w, fitted.scheme)
    assert nonfinite([("scales", q.scales), ("dequantized", q.dequantize())]) == []
    if r.input is not None and not r.input.needs_calibration:
        from lowbit.formats import qdq_input

        assert bool(torch.isfinite(qdq_input(w, r.input)).all())


# ------------------------------------------------------------------ through the CLI
def _outcome(capsys, code: int, out: Path, fuzzed: bool = True) -> None:
    """exit 0 with only finite tensors written, or exit 2 with one error line and nothing written."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if fuzzed:
        event(f"exit {code}")  # --hypothesis-show-statistics: how often each outcome was reached
    if code == 0:
        from safetensors.torch import load_file

        files = sorted(out.glob("*.safetensors"))
        assert files and all(nonfinite(load_file(f).items()) == [] for f in files)
        return
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("lowbit ")]
    assert len(lines) == 1 and ": error: " in lines[0], err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def _quantize(capsys, model: Path, *args: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "q"
        code = main(["quantize", str(model), *args, "--method", "rtn", "--no-search", "--no-eval", "--out", str(out)])
        _outcome(capsys, code, out)


@settings(CLI, max_examples=15)  # the API-level test above draws 300; a run with static inputs calibrates
@given(st.one_of(st.sampled_from(["w4g32", "nvfp4", "mxfp4@mxfp4:round=even", "w4g64a-a8", "nvfp4-46:smax=300"]),
                 RECIPE))
def test_fuzz_scheme_strings_through_the_cli(tiny_hf_dir, capsys, text):
    _quantize(capsys, tiny_hf_dir, "--scheme", text)


LAYERS = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                               "self_attn.v_proj", "self_attn.o_proj",
                                                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
JSON_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                       st.sampled_from([4, 8, 16, 32, 32.0, 32.5, 448.0, 1e38, 1e-42, "fp32", "e4m3", "absmax"]))


def _scheme_fields(base: str, changes: dict) -> dict:
    return {**Scheme.parse(base).to_dict(), **changes}


FIELD_NAMES = [f for f in Scheme.parse("w4g32").to_dict()] + ["bogus"]
ENTRY = st.one_of(st.sampled_from(["w4g32", "nvfp4", "w2g64a", "mxfp4", "w8a8-fp8"]), RECIPE, JSON_VALUE,
                  st.builds(_scheme_fields, st.sampled_from(["w4g32", "nvfp4", "mxfp4", "w2g64a"]),
                            st.dictionaries(st.sampled_from(FIELD_NAMES), JSON_VALUE, max_size=2)),
                  st.builds(lambda w, i: {"weight": w, "input": i}, WEIGHT, st.one_of(st.none(), INPUT, JSON_VALUE)))
PLAN = st.one_of(st.dictionaries(st.sampled_from(LAYERS + ["lm_head", "model.norm", "x"]), ENTRY, max_size=4)
                 .map(lambda layers: {"layers": layers}),
                 JSON_VALUE, st.dictionaries(st.text(max_size=5), JSON_VALUE, max_size=2))


@CLI
@given(PLAN)
def test_fuzz_plan_files_through_the_cli(tiny_hf_dir, capsys, plan):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "plan.json"
        f.write_text(json.dumps(plan))  # NaN / Infinity stay in: Python's reader accepts them
        _quantize(capsys, tiny_hf_dir, "--plan", str(f))


def _mutate(data: bytes, op: str, pick: int, value: object) -> bytes:
    """One damage to a safetensors file: its header's fields, its length, or its bytes."""
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    names = sorted(k for k in header if k != "__metadata__")
    key = names[pick % len(names)]
    if op == "truncate":
        return data[: pick % len(data)]
    if op == "flip":
        at = 8 + n + pick % len(body)
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
    if op == "length":
        return struct.pack("<Q", value if isinstance(value, int) and 0 <= value < 2**64 else n + 8) + data[8:]
    if op == "drop":
        del header[key]
    elif op == "metadata":
        header["__metadata__"] = {"format": value} if isinstance(value, str) else value
    else:
        header[key] = {**header[key], op: value}
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) + (-len(h) % 8)) + h + b" " * (-len(h) % 8) + body


HEADER_VALUE = st.one_of(st.sampled_from(["F32", "F16", "BF16", "I32", "I64", "U8", "BOOL", "F64", "X"]),
                         st.lists(st.integers(-1, 70000), max_size=3), st.integers(-5, 2**40), JSON_VALUE)


@CLI
@given(st.sampled_from(["dtype", "shape", "data_offsets", "drop", "metadata", "length", "truncate", "flip"]),
       st.integers(0, 10**6), HEADER_VALUE)
def test_fuzz_safetensors_headers_through_the_cli(tiny_hf_dir, capsys, op, pick, value):
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "m"
        shutil.copytree(tiny_hf_dir, model)
        f = model / "model.safetensors"
        f.write_bytes(_mutate(f.read_bytes(), op, pick, value))
        _quantize(capsys, model, "--scheme", "w4g32")


def test_the_fuzzed_outcomes_include_both_kinds(tiny_hf_dir, tmp_path, capsys):
    """The strategies reach both outcomes: a valid edge case runs, a bad number is refused (not all refused)."""
    for text, code in (("nvfp4:smax=0.015625", 0), ("nvfp4:smax=1e-42", 2)):
        out = tmp_path / text.replace(":", "_")
        assert main(["quantize", str(tiny_hf_dir), "--scheme", text, "--no-search", "--no-eval", "--out",
                     str(out)]) == code
        _outcome(capsys, code, out, fuzzed=False)
    with pytest.raises(LowbitError):
        InputScheme.parse("nvfp4:smax=inf")
