"""Benchmarks import nothing from tests/: what a benchmark shares with a test lives in the library
(moonep.testing, moonep.routing) or in benchmarks/, so a benchmark runs from a checkout without the
test tree. Every import counts, wherever it stands (module level or inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports_of_tests(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of `tests` or a module under it in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "tests"]
    return found



def test_no_benchmark_imports_tests() -> None:
    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(files) > 10
    bad = {p.relative_to(ROOT).as_posix(): hits for p in files if (hits := imports_of_tests(p))}
    assert not bad, f"benchmarks importing from tests/ (move the shared code into the library): {bad}"


def test_the_checker_finds_planted_imports(tmp_path: Path) -> None:
    path = tmp_path / "bench_x.py"
    path.write_text("import os\nimport tests.moonep.cases as c\nfrom tests.dist_utils import run_ranks\n"
                    "from testsuite import x\nfrom . import tests\n\ndef f():\n    import tests\n")
    assert imports_of_tests(path) == [(2, "tests.moonep.cases"), (3, "tests.dist_utils"), (8, "tests")]
