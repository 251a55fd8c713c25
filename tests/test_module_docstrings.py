"""Module docstrings of moonep and moontrain stay a design record a reader takes in at once: at most
MAX_LINES lines (STYLE.md: protocol, invariants, one current number, rejected alternatives in a line
each). Measurements and the story of how a module got there go to docs/performance.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moonep", "moontrain")
MAX_LINES = 40


def docstring_lines(path: Path) -> int:
    """Lines of the module docstring as written (0 without one)."""
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)), clean=False)
    return len(doc.splitlines()) if doc else 0


def too_long(root: Path) -> dict[str, int]:
    return {path.relative_to(root).as_posix(): n
            for package in PACKAGES for path in sorted((root / package).rglob("*.py"))
            if (n := docstring_lines(path)) > MAX_LINES}


def test_module_docstrings_are_short() -> None:
    assert len(list((ROOT / "moonep").rglob("*.py"))) > 30
    found = too_long(ROOT)
    assert not found, f"module docstrings over {MAX_LINES} lines (move the measurements and the history to " \
                      f"docs/performance.md): {found}"


def test_the_checker_measures_a_planted_docstring(tmp_path: Path) -> None:
    (tmp_path / "moonep").mkdir()
    (tmp_path / "moontrain").mkdir()
    body = "\n".join(f"line {i}" for i in range(MAX_LINES - 1))
    (tmp_path / "moonep" / "ok.py").write_text(f'"""first\n{body}\n"""\n\nX = 1\n')  # MAX_LINES lines
    (tmp_path / "moontrain" / "long.py").write_text(f'"""first\n{body}\nlast\n"""\n')  # one more
    (tmp_path / "moontrain" / "none.py").write_text("X = '''not a docstring'''\n")
    assert docstring_lines(tmp_path / "moonep" / "ok.py") == MAX_LINES
    assert docstring_lines(tmp_path / "moontrain" / "none.py") == 0
    assert too_long(tmp_path) == {"moontrain/long.py": MAX_LINES + 1}
