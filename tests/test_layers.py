"""The package layers of docs/ARCHITECTURE.md, checked against every import in src/lowbit.

A module may import from its own package and from packages of lower layers only; the
command line talks to the api layer alone. Imports inside functions count too: a lazy
upward import is still an upward dependency.
"""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lowbit"

# bottom to top; packages of one row may not import each other
LAYERS = [
    ("errors",),
    ("configs", "io"),
    ("formats", "transforms"),
    ("nn",),
    ("files",),
    ("models", "data"),
    ("plans",),
    ("ptq", "train"),
    ("qat", "peft"),
    ("eval",),
    ("studies",),
    ("api",),
    ("cli",),
    ("__main__",),
]
LEVEL = {pkg: i for i, row in enumerate(LAYERS) for pkg in row}
CLI_MAY_IMPORT = {"cli", "api", "errors"}


def package_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def lowbit_imports(path: Path) -> list[tuple[int, str]]:
    """(line, first package after ``lowbit.``) for every import of a lowbit module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from lowbit import x``: a subpackage, or a name of the top-level package (its version)
            names = [node.module] if node.module != "lowbit" else [
                f"lowbit.{a.name}" for a in node.names if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file()]
        else:
            continue
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("lowbit.")]
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        pkg = package_of(path)
        if pkg == "__init__":  # the top-level package only maps public names to modules, lazily
            continue
        for line, target in lowbit_imports(path):
            where = f"{path.relative_to(SRC)}:{line} imports lowbit.{target}"
            if target not in LEVEL:
                bad.append(f"{where}: package missing from the layer table")
            elif pkg == "cli" and target not in CLI_MAY_IMPORT:
                bad.append(f"{where}: the CLI talks to the api layer only")
            elif target != pkg and LEVEL[target] >= LEVEL[pkg]:
                bad.append(f"{where}: {'same-layer' if LEVEL[target] == LEVEL[pkg] else 'upward'} import")
    return bad


def test_every_package_is_in_the_table():
    pkgs = {package_of(p) for p in SRC.rglob("*.py")} - {"__init__"}
    assert pkgs <= set(LEVEL), sorted(pkgs - set(LEVEL))


def test_imports_follow_the_layers():
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The test itself can fail: a planted upward import is reported."""
    fake = tmp_path / "lowbit"
    (fake / "formats").mkdir(parents=True)
    (fake / "formats" / "bad.py").write_text("def f():\n    from lowbit.ptq import quantize_model\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    assert violations() == ["formats/bad.py:2 imports lowbit.ptq: upward import"]


def test_the_top_level_package_names_real_modules_in_the_table():
    """`lowbit/__init__.py` reaches modules through strings (its lazy public names and the transformers
    registration hook), which the import scan above cannot see: each must exist, in a package of the table."""
    import importlib.util
    import re

    names = set(re.findall(r'"(lowbit(?:\.\w+)+)"', (SRC / "__init__.py").read_text()))
    assert "lowbit.files.hf_quantizer" in names  # the hook: from_pretrained(native_dir) after `import lowbit`
    for name in sorted(names):
        assert name.split(".")[1] in LEVEL, name
        assert importlib.util.find_spec(name) is not None, name


def doc_layers(text: str) -> list[tuple[str, ...]]:
    """The layer table of docs/ARCHITECTURE.md, bottom to top: each row's packages (its second column)."""
    section = text.split("## Layers, bottom to top", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| ")]
    body = [r for r in rows if r[1].strip() not in ("row", "---")]
    return [tuple(p.strip("/") for p in re.findall(r"`([\w/]+)`", r[2])) for r in body]


def test_the_architecture_page_draws_the_same_table():
    """The doc's layer table is this test's table, row for row: neither can change without the other."""
    doc = SRC.parents[1] / "docs" / "ARCHITECTURE.md"
    assert doc_layers(doc.read_text()) == LAYERS


def test_every_package_on_disk_is_in_the_doc_table():
    """A package added under src/lowbit fails here until the architecture page (and LAYERS) list it."""
    drawn = {p for row in doc_layers((SRC.parents[1] / "docs" / "ARCHITECTURE.md").read_text()) for p in row}
    on_disk = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    on_disk |= {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert on_disk - drawn == set()


def test_the_doc_table_check_sees_a_missing_package():
    text = "## Layers, bottom to top\n\n| row | package | owns |\n| --- | --- | --- |\n| 0 | `errors` | x |\n" \
           "| 1 | `configs`, `io` | y |\n\n## Next\n| 9 | `api` | z |\n"
    assert doc_layers(text) == [("errors",), ("configs", "io")]
    assert doc_layers(text) != LAYERS
