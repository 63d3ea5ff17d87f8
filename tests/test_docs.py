"""A clone stands alone: every document the repository cites is in it.

Code, data files, tests and README cite the design notes as "docs/design.md section N". Every
cited docs/ page must exist, every cited section must be a "## N." heading of that page, and
nothing may cite the old design file that lived outside the repository.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "runs", "node_modules"}
# published measurements: their locators are paths in other repositories (docs/... of those), not citations
EXTERNAL = Path("calibrations") / "measurements" / "published"
SUFFIXES = {".py", ".md", ".csv", ".sh", ".yaml", ".yml", ".json", ".toml", ".txt", ".cfg", ".ini"}
# a locator "owner/repo@commit:docs/x.md" names a page of another repository: not a citation
DOC = re.compile(r"(?<![:\w/.-])docs/[\w./-]+?\.md")
# "docs/design.md section 3", "docs/design.md, section 3", "docs/design.md sections 3 and 7"
CITED_SECTIONS = re.compile(r"(?<![:\w/.-])(docs/[\w./-]+?\.md),?\s+sections?\s+(\d+(?:(?:\s*,\s*|\s+and\s+)\d+)*)")
OUTSIDE = re.compile(r"\bDESIGN\b")  # the notes before they moved into docs/


def _texts():
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if rel.is_relative_to(EXTERNAL):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or rel.parts[0] == ".ci"):
            try:
                yield rel, path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


def _flat(text: str) -> str:
    """Text with comment markers and line breaks folded, so a citation split over lines reads whole."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def _sections(doc: Path) -> set[str]:
    return set(re.findall(r"^##\s+(\d+)\.", doc.read_text(encoding="utf-8"), flags=re.M))


def test_the_design_notes_are_in_the_repository():
    assert (ROOT / "docs" / "design.md").is_file()
    assert {"2", "3", "4", "7"} <= _sections(ROOT / "docs" / "design.md")


def test_every_cited_doc_and_section_exists():
    missing, cited = [], 0
    for rel, text in _texts():
        flat = _flat(text)
        for doc in set(DOC.findall(flat)):
            cited += 1
            if not (ROOT / doc).is_file():
                missing.append(f"{rel}: {doc} does not exist")
        for doc, numbers in CITED_SECTIONS.findall(flat):
            if not (ROOT / doc).is_file():
                continue
            have = _sections(ROOT / doc)
            for n in re.findall(r"\d+", numbers):
                if n not in have:
                    missing.append(f"{rel}: {doc} has no section {n}")
    assert cited, "no docs/ citation found: the scan is broken"
    assert not missing, "\n".join(missing)


def test_nothing_cites_notes_outside_the_repository():
    found = [f"{rel}:{i}" for rel, text in _texts() for i, line in enumerate(text.splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, f"cite docs/design.md instead: {found}"
