"""The docs the code points at exist: docstrings cite docs/design.md (and sections it has), and its package
diagram has exactly the edges that the packages' imports make."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
FOLDERS = {  # import name -> folder
    "placement": "placement",
    "lifecycle": "lifecycle",
    "value_transfer": "value-transfer",
    "megatron": "megatron-backend",
    "ppo": "ppo-driver",
}
ARROW = "──►"


def _sources() -> list[Path]:
    here = Path(__file__).resolve()
    paths = [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("tests/**/*.py")]
    return [p for p in paths if p.resolve() != here and p.name != "test_readmes.py"]


def test_no_source_cites_a_design_file_that_is_not_there() -> None:
    stale = [p.relative_to(ROOT).as_posix() for p in _sources() if "DESIGN.md" in p.read_text()]
    assert not stale, f"these name DESIGN.md, which is docs/design.md: {stale}"


def test_the_cited_sections_of_docs_design_exist() -> None:
    design = DESIGN.read_text()
    cited = re.compile(r'docs/design\.md(?:\'s)?,? \(?"([^"]+)"')
    missing = []
    for path in _sources():
        for section in cited.findall(path.read_text()):
            if " ".join(section.split()) not in " ".join(design.split()):
                missing.append(f"{path.relative_to(ROOT)}: {section!r}")
    assert not missing, f"docs/design.md has no such text: {missing}"


def import_edges() -> set[tuple[str, str]]:
    """(user, used) folder pairs: a module of `user` imports `tandem.<used>` (any import, also a lazy one)."""
    edges: set[tuple[str, str]] = set()
    for name, folder in FOLDERS.items():
        for path in (ROOT / "packages" / folder / "src").rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                modules = (
                    [node.module]
                    if isinstance(node, ast.ImportFrom) and not node.level and node.module
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                for module in modules:
                    parts = module.split(".")
                    if parts[0] == "tandem" and len(parts) > 1 and parts[1] in FOLDERS and parts[1] != name:
                        edges.add((folder, FOLDERS[parts[1]]))
    return edges


def diagram_edges(text: str) -> set[tuple[str, str]]:
    """The edges of the first diagram after the "## Packages" heading: each line a chain `a ──► b ──► c`."""
    section = text.split("## Packages", 1)[1]
    block = section.split("```", 2)[1]
    edges: set[tuple[str, str]] = set()
    for line in block.splitlines():
        names = [n.strip() for n in line.split(ARROW)]
        if len(names) > 1:
            edges.update(itertools.pairwise(names))
    return edges


def test_the_package_diagram_is_the_import_graph() -> None:
    drawn, imported = diagram_edges(DESIGN.read_text()), import_edges()
    assert drawn == imported, (
        f"docs/design.md's package diagram: drawn but not imported {sorted(drawn - imported)}, "
        f"imported but not drawn {sorted(imported - drawn)}"
    )


def test_the_diagram_reader_reads_chains() -> None:
    text = f"## Packages\n\n```\na {ARROW} b {ARROW} c\na {ARROW} d\n```\n"
    assert diagram_edges(text) == {("a", "b"), ("b", "c"), ("a", "d")}
