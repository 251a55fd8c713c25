"""Citations of the design record resolve: every "§n" or "§n.m" in the repository's text names a
numbered section of docs/moonep.md, and nothing cites the old contract that lived outside the
repository (the uppercase word it was cited by, alone or as its file name).

The section sign is reserved for docs/moonep.md: a file that uses it must name docs/moonep.md
(a file inside docs/ may say moonep.md), so a reader knows which document the number points into.
The record's headings are numbered in order ("## 5. The planner", "### 5.1 Receive caps"), so a
number, once cited, keeps pointing at the same place until someone renumbers on purpose.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = "docs/moonep.md"
SCANNED_DIRS = ("moonep", "moontrain", "benchmarks", "tests", "docs", "experiments", "launch", "recipes")
SCANNED_FILES = ("README.md", "pyproject.toml")
SUFFIXES = {".py", ".md", ".sh", ".sbatch", ".yaml", ".yml", ".toml", ".txt"}
SKIPPED = ("benchmarks/results/",)  # measurement output, not prose
_HEADING = re.compile(r"^(#{2,3}) (\d+)(?:\.(\d+))?\.? (\S.*)$", re.MULTILINE)
_CITATION = re.compile(r"§(\d+(?:\.\d+)?)")
# the old contract's name, assembled so that this file does not match itself
_OLD = re.compile(r"\b" + "SP" + r"EC\b")


def sections(record: str) -> dict[str, str]:
    """Section number -> title of the record's numbered headings; raises if the numbering is not
    1, 2, ... with subsections n.1, n.2, ... under their section."""
    found: dict[str, str] = {}
    top, sub = 0, 0
    for level, major, minor, title in _HEADING.findall(record):
        if len(level) == 2:
            assert not minor and int(major) == top + 1, f"section {major}.{minor} follows section {top}"
            top, sub = int(major), 0
            found[major] = title
        else:
            assert minor and int(major) == top and int(minor) == sub + 1, \
                f"subsection {major}.{minor} follows {top}.{sub}"
            sub = int(minor)
            found[f"{major}.{minor}"] = title
    return found


def _text_files(root: Path) -> list[Path]:
    files = [root / name for name in SCANNED_FILES if (root / name).is_file()]
    for folder in SCANNED_DIRS:
        files += sorted(p for p in (root / folder).rglob("*") if p.is_file() and p.suffix in SUFFIXES
                        and "__pycache__" not in p.parts)
    return [p for p in files if not str(p.relative_to(root)).startswith(SKIPPED)]


def problems(root: Path, skip: tuple[Path, ...] = ()) -> list[str]:
    """Every broken citation and every reference to the old contract under `root`, one line each."""
    known = sections((root / RECORD).read_text())
    out = []
    for path in _text_files(root):
        if path in skip:
            continue
        rel = path.relative_to(root).as_posix()
        text = path.read_text(errors="replace")
        for number, line in _numbered_lines(text, _OLD):
            out.append(f"{rel}:{line}: cites the old contract ({number!r}); cite {RECORD} §n instead")
        cites = list(_numbered_lines(text, _CITATION))
        if not cites:
            continue
        names_record = rel == RECORD or RECORD in text or (rel.startswith("docs/") and "moonep.md" in text)
        if not names_record:
            out.append(f"{rel}: uses § without naming {RECORD}")
        for number, line in cites:
            if number not in known:
                out.append(f"{rel}:{line}: §{number} is not a section of {RECORD} (it has {sorted(known)})")
    return out


def _numbered_lines(text: str, pattern: re.Pattern) -> list[tuple[str, int]]:
    """(first group or whole match, line number) of each match."""
    return [(m.group(1) if m.groups() else m.group(0), text.count("\n", 0, m.start()) + 1)
            for m in pattern.finditer(text)]


def test_every_citation_names_a_section_of_the_record() -> None:
    found = problems(ROOT, skip=(Path(__file__).resolve(),))
    assert not found, "\n".join(found)


def test_the_record_has_the_contract_sections() -> None:
    """The record covers what the code cites it for (titles as numbered)."""
    titles = sections((ROOT / RECORD).read_text())
    want = {"2": "The invariant", "4": "Symmetric memory", "4.3": "The fp32 grad mirror and the reduce buffer",
            "5": "The planner", "6": "The data path", "8": "Bad input", "9": "Benchmark conventions"}
    assert {n: titles.get(n) for n in want} == want
    cited = {m for p in _text_files(ROOT) if p.suffix == ".py" for m in _CITATION.findall(p.read_text())}
    assert {"5.1", "5.2", "5.3", "5.4", "5.5", "8", "9"} <= cited  # the code cites the record, section by section


def test_the_checker_finds_planted_problems(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "moonep").mkdir()
    (tmp_path / RECORD).write_text("# record\n\n## 1. One\n\n### 1.1 Sub\n\n## 2. Two\n\nSee §1.1.\n")
    (tmp_path / "moonep" / "good.py").write_text('"""Caps (docs/moonep.md §1.1; §2)."""\n')
    (tmp_path / "moonep" / "bad.py").write_text('"""x\n\nsee docs/moonep.md §3 and §1.2\n"""\n')
    (tmp_path / "moonep" / "old.py").write_text("# " + "SP" + "EC 5.2 and " + "SP" + "EC.md\n")
    (tmp_path / "moonep" / "unnamed.py").write_text("# receiver filling, §2\n")
    assert problems(tmp_path) == [
        "moonep/bad.py:3: §3 is not a section of docs/moonep.md (it has ['1', '1.1', '2'])",
        "moonep/bad.py:3: §1.2 is not a section of docs/moonep.md (it has ['1', '1.1', '2'])",
        *["moonep/old.py:1: cites the old contract ('" + "SP" + "EC'); cite docs/moonep.md §n instead"] * 2,
        "moonep/unnamed.py: uses § without naming docs/moonep.md",
    ]
    (tmp_path / RECORD).write_text("## 1. One\n\n### 1.2 Skipped one\n")
    try:
        problems(tmp_path)
    except AssertionError as err:
        assert "subsection 1.2 follows 1.0" in str(err)
    else:
        raise AssertionError("a record numbered 1, 1.2 was accepted")
