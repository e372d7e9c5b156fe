"""docs/architecture.md's package map and the tree under zerospeed/ name the same modules.

The map is the first fenced block of the page: a folder line ends in `/`, and the lines under it,
indented two spaces a level deeper, are its contents. Every `zerospeed/**/*.py` except
`__init__.py` must have its line, and every folder or file the map names must exist.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


def _map_block(text: str) -> list[str]:
    start = text.index("```\n") + 4
    return text[start:text.index("```", start)].splitlines()


def named_paths(text: str) -> list[str]:
    """Paths (relative to the repository) the map names, folders with a trailing `/`."""
    folders: list[str] = []
    paths = []
    for number, line in enumerate(_map_block(text), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent % 2 or indent // 2 > len(folders):
            raise ValueError(f"architecture.md map line {number}: indentation {indent} does not fit: {line!r}")
        del folders[indent // 2:]
        name = line.split()[0]
        paths.append("".join(folders) + name)
        if name.endswith("/"):
            folders.append(name)
    return paths


def _modules() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for path in (ROOT / "zerospeed").rglob("*.py")
            if path.name != "__init__.py"}


def test_every_module_has_its_line_and_every_line_exists():
    named = named_paths(PAGE.read_text())
    missing = sorted(_modules() - set(named))
    assert not missing, f"modules without a line in docs/architecture.md's map: {missing}"
    absent = [path for path in named if not (ROOT / path).exists()]
    assert not absent, f"docs/architecture.md's map names paths that do not exist: {absent}"
    assert all(path.endswith((".py", "/")) for path in named), [p for p in named if not p.endswith((".py", "/"))]
    assert len(named) == len(set(named)), sorted({p for p in named if named.count(p) > 1})


def test_the_parser_reads_nesting():
    text = "```\nzerospeed/\n  a.py  x\n  sub/\n    b.py  y\n  c.py\n```\n"
    assert named_paths(text) == ["zerospeed/", "zerospeed/a.py", "zerospeed/sub/", "zerospeed/sub/b.py",
                                 "zerospeed/c.py"]
