"""docs/ARCHITECTURE.md names only modules and packages that exist, and links nowhere outside the repository.

The page is a newcomer's map: a module it names that was moved or renamed sends them
nowhere. Every backquoted name that looks like a path (``pkg/module.py``, ``pkg/``,
``pkg/module`` or ``pkg/module.function``) must exist under ``src/lowbit`` (or, for
``tests/``, ``benchmarks/`` and ``docs/``, under the repository root); a bare ``module.py``
must exist somewhere under ``src/lowbit``.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "lowbit"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
TOP = ("tests/", "benchmarks/", "docs/")

# a backquoted path: lower-case segments joined by "/", then ".py", a trailing "/", or ".name" parts
PATH = re.compile(r"`([a-z_][a-z0-9_]*(?:/[a-z_][a-z0-9_]*)*(?:\.py|/|(?:\.[A-Za-z_]\w*)*))`")


def named_paths(text: str) -> list[str]:
    """Every backquoted path-like name of the page: with a slash, or a bare ``module.py``."""
    return sorted({m for m in PATH.findall(text) if "/" in m or m.endswith(".py")})


def exists(name: str, src: Path = SRC, root: Path = ROOT) -> bool:
    if name.startswith(TOP):
        return (root / name).exists()
    if "/" not in name:  # a bare module.py: named inside a section about its folder
        return any(src.rglob(name))
    path = name.removeprefix("lowbit/")
    if path.endswith((".py", "/")):
        return (src / path).exists()
    module = path.split(".")[0]  # pkg/module, or pkg/module.function
    return (src / f"{module}.py").is_file() or (src / module / "__init__.py").is_file()


def missing(text: str, src: Path = SRC, root: Path = ROOT) -> list[str]:
    return [n for n in named_paths(text) if not exists(n, src, root)]


def outside_links(text: str) -> list[str]:
    """Markdown links anywhere but into the repository, and backquoted paths that climb out of it (``../``).

    (A user's own path such as the cache's ``~/.cache/...`` is a place on their machine, not a link.)
    """
    links = re.findall(r"\]\(([^)]+)\)", text)
    climbs = re.findall(r"`(\.\./[^`]*)`", text)
    return [t for t in links if t.startswith(("../", "/", "~", "file:")) or "/../" in t] + climbs


def test_every_module_the_page_names_exists():
    names = named_paths(DOC.read_text())
    assert len(names) > 50 and "files/sealed.py" in names and "ptq/blockwise/" in names  # the scan sees them
    assert missing(DOC.read_text()) == []


def test_the_page_links_nothing_outside_the_repository():
    assert outside_links(DOC.read_text()) == []


def test_the_checks_can_fail(tmp_path):
    """A renamed module, a vanished package and an outside link are each reported."""
    text = ("the engine (`ptq/pipeline.py`), `models/native.py`, `export/`, `files/native.save`, `tests/test_nope.py`,"
            " `vanished.py`, and `ptq/blockwise/` with `loop.py`; design in [DESIGN](../shared/DESIGN.md)")
    assert missing(text) == ["export/", "models/native.py", "ptq/pipeline.py", "tests/test_nope.py", "vanished.py"]
    assert outside_links(text) == ["../shared/DESIGN.md"]
    assert outside_links("the first design is `../shared/DESIGN.md`") == ["../shared/DESIGN.md"]
