"""The number-format families: one registry, every scheme in exactly one family, no import circle,
one grammar for weight and input schemes."""

import ast
from pathlib import Path

import pytest
import torch

from lowbit.formats import PRESETS, InputScheme, Scheme, quantize
from lowbit.formats.args import FormatArgs
from lowbit.formats.families import FAMILIES, Family, family_of
from lowbit.formats.inputs import PRESETS as INPUT_PRESETS

FORMATS = Path(__file__).resolve().parents[1] / "src" / "lowbit" / "formats"


def test_every_family_meets_the_protocol():
    assert set(FAMILIES) == {"int", "fp", "kquant"}
    for name, fam in FAMILIES.items():
        assert isinstance(fam, Family) and fam.name == name


@pytest.mark.parametrize("name", [*PRESETS, "w3g32a", "w6", "nvfp4:block=8"])
def test_every_scheme_has_exactly_one_family(name):
    s = Scheme.parse(name)
    owners = [f for f in FAMILIES.values() if f.claims(s.elem, s.super_block)]
    assert owners == [s.family]
    assert name in PRESETS or s.family.name in ("int", "fp")


def test_presets_come_from_the_families():
    assert list(PRESETS) == [n for f in FAMILIES.values() for n in f.weight_presets()]
    assert list(INPUT_PRESETS) == [n for f in FAMILIES.values() for n in f.input_presets()]
    assert family_of("int", 256) is FAMILIES["kquant"] and family_of("e2m1") is FAMILIES["fp"]


def _runtime_imports(path: Path) -> set[str]:
    """Modules imported outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    hidden = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
              for sub in node.body for n in ast.walk(sub)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


@pytest.mark.parametrize("module", ["integer", "float_blocks", "kquants", "blocks", "qtensor", "rules", "minifloat"])
def test_no_family_module_imports_the_scheme(module):
    """The registry sits between the families and `Scheme`: nothing below imports scheme.py (the old circle)."""
    assert "lowbit.formats.scheme" not in _runtime_imports(FORMATS / f"{module}.py")
    assert "lowbit.formats.families" not in _runtime_imports(FORMATS / f"{module}.py")


@pytest.mark.parametrize("name", [n for n, s in PRESETS.items() if s.family.name != "kquant"])
def test_one_level_codes_decode_through_the_family_grid(name):
    """``w = (grid[code] - zero) * scale / enc``: the grid a family reports is the one its codes use."""
    s = PRESETS[name]
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    q = quantize(w, s)
    vals = s.family.grid(s)[q.codes.long()]
    if q.zeros is not None:
        vals = vals - q.zeros.unsqueeze(-1)
    scale = q.scales if q.tensor_scale is None else q.scales / q.tensor_scale
    assert torch.equal((vals * scale.unsqueeze(-1)).reshape(8, -1)[:, :256], q.dequantize())


def test_weights_and_inputs_share_one_grammar():
    for cls in (Scheme, InputScheme):
        assert issubclass(cls, FormatArgs)
        assert not {"parse", "with_options", "name", "_explicit_name", "to_dict", "from_dict"} & set(vars(cls))
    assert Scheme.parse("nvfp4:rule=span,guard=1").name == "nvfp4:rule=span,guard=1"
    assert InputScheme.parse("nvfp4:rule=span,guard=1").name == "nvfp4:rule=span,guard=1"
    assert InputScheme.parse("mxfp4:round=rceil") == InputScheme.parse("mxfp4:round=ceil")
