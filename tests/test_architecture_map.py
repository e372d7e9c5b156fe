"""docs/architecture.md's package map and the tree under zerospeed/ name the same modules; no doc names a file that is not there.

The map is the first fenced block of the page: a folder line ends in `/`, and the lines under it,
indented two spaces a level deeper, are its contents. Every `zerospeed/**/*.py` except
`__init__.py` must have its line, and every folder or file the map names must exist.

Every page of docs/ and the README may name source and test files only as they are: a path that
starts in one of the repository's folders (`tests/...`, `zerospeed/...`, `benchmarks/...`) or in
one of the package's (`runtime/pipe/engine.py`, `checkpoint/atomic.py`) must exist, and a bare
test file name (`test_resharding.py`) must be a file under tests/. DeepSpeed's own files are named
with their `deepspeed/` prefix, which this check leaves alone.
"""

from __future__ import annotations

import pathlib
import re

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


DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_PATH = re.compile(r"(?<![\w./$-])((?:[A-Za-z_][\w.-]*/)+[\w.-]+\.py)\b")
_TEST_NAME = re.compile(r"(?<![\w./-])(test_\w+\.py)\b")


def _folders(base: pathlib.Path) -> set[str]:
    return {p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")}


def dead_references(text: str, root: pathlib.Path) -> list[str]:
    """The paths and test file names `text` gives that do not exist under `root`."""
    top, package = _folders(root), _folders(root / "zerospeed")
    test_names = {p.name for p in (root / "tests").rglob("test_*.py")}
    dead = []
    for path in _PATH.findall(text):
        first = path.split("/", 1)[0]
        if first in top and not (root / path).exists():
            dead.append(path)
        elif first in package and first not in top and not (root / "zerospeed" / path).exists():
            dead.append(path)
    dead += [name for name in _TEST_NAME.findall(text) if name not in test_names]
    return dead


def test_docs_name_only_files_that_exist():
    dead = {doc.relative_to(ROOT).as_posix(): found for doc in DOCS if (found := dead_references(doc.read_text(), ROOT))}
    assert not dead, f"docs name files that do not exist: {dead}"


def test_a_dead_reference_is_found():
    text = ("see tests/compat/test_nothing_here.py, runtime/pipe/nowhere.py, test_absent_file.py; "
            "tests/test_architecture_map.py, checkpoint/atomic.py and ckpt/zero_to_fp32.py are fine")
    assert dead_references(text, ROOT) == ["tests/compat/test_nothing_here.py", "runtime/pipe/nowhere.py",
                                           "test_absent_file.py"]
