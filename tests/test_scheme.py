import pytest

from lowbit.errors import SchemeError
from lowbit.formats import PRESETS, Scheme


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_by_name_and_json(name):
    s = Scheme.parse(name)
    assert s.name == name
    assert Scheme.from_dict(s.to_dict()) == s


@pytest.mark.parametrize("text", ["w3g32a", "w2g16", "w4g128:full=0", "nvfp4:block=8,rule=4over6,guard=1",
                                  "mxfp4:round=ceil", "nvfp4-ue5m3:tensor=1", "w4g128:rule=search"])
def test_explicit_names_round_trip(text):
    s = Scheme.parse(text)
    assert Scheme.parse(s.name) == s


def test_explicit_form_sets_fields():
    s = Scheme.parse("nvfp4:block=8,rule=4over6,guard=1")
    assert (s.group_size, s.rule, s.guard, s.elem, s.scale) == (8, "4over6", True, "e2m1", "e4m3")


@pytest.mark.parametrize("bad,needle", [
    ("w9g128", "valid names"), ("int4", "valid names"), ("w4g128:foo=1", "keys"),
    ("w4g128:rule=4over6", "FP4"), ("nvfp4:block=2", "4..256"), ("w4g1", ">= 2"),
    ("mxfp4:tensor=1", "mantissa"), ("w4g128:guard=maybe", "0/1"), ("w4g128:block=x", "bad value"),
])
def test_bad_schemes_name_the_fix(bad, needle):
    with pytest.raises(SchemeError, match=needle):
        Scheme.parse(bad)


def test_bits_per_weight_counts_scale_and_zero():
    assert Scheme.parse("w4g128").bits_per_weight() == 4 + 16 / 128
    assert Scheme.parse("w4g128a").bits_per_weight() == 4 + (16 + 4) / 128
    assert Scheme.parse("nvfp4").bits_per_weight() == 4 + 8 / 16
    assert Scheme.parse("mxfp4").bits_per_weight() == 4 + 8 / 32
    assert Scheme.parse("w8").bits_per_weight(1024) == 8 + 16 / 1024
    assert Scheme.parse("w2g64").bits_per_weight(count_scales=False) == 2


def test_group_wider_than_row_is_refused():
    with pytest.raises(SchemeError, match="larger than the 64 input columns"):
        Scheme.parse("w4g128").check_width(64)


@pytest.mark.parametrize("text,name", [("w2g32", "w2g32"), ("w3g64a", "w3g64a"), ("w6", "w6"),
                                       ("w2g32:full=0", "w2g32:full=0"), ("w4g128", "w4g128")])
def test_int_names_are_canonical(text, name):
    assert Scheme.parse(text).name == name
