"""Every `docs/X.md, "Section"` reference in the code, scripts, tests and docs names a file that
exists and a heading in it (its text, or the start of it: headings carry dates and issue numbers
after the part that is cited)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("dlinfer", "benchmarks", "scripts", "tests", "docs", "examples")
SUFFIXES = (".py", ".cpp", ".h", ".md", ".sh")
REFERENCE = re.compile(r'docs/([a-z_]+\.md),?\s+"([^"]+)"')
# a line break inside a comment or docstring, with the next line's comment marker
BREAK = re.compile(r"\s*\n\s*(?:#|//|\*)?\s*")


def _files():
    yield ROOT / "README.md"
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            skip = {"__pycache__", "build", ".pytest_cache"} & set(path.parts) or any(
                part.endswith(".egg-info") for part in path.parts)
            if path.suffix in SUFFIXES and not skip and path.is_file():
                yield path


def _headings(doc: Path) -> list:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return [re.sub(r"[`*]", "", h).strip() for h in re.findall(r"^#{1,6}\s+(.+)$", text, re.M)]


def test_every_doc_reference_resolves():
    headings = {}
    broken = []
    for path in _files():
        text = BREAK.sub(" ", path.read_text(errors="replace"))
        for name, section in REFERENCE.findall(text):
            doc = ROOT / "docs" / name
            if not doc.is_file():
                broken.append(f"{path.relative_to(ROOT)}: docs/{name} does not exist")
                continue
            if name not in headings:
                headings[name] = _headings(doc)
            wanted = re.sub(r"[`*]", "", section).strip()
            if not any(h == wanted or h.startswith(wanted) for h in headings[name]):
                broken.append(f'{path.relative_to(ROOT)}: docs/{name} has no heading "{section}"')
    assert not broken, "\n".join(sorted(set(broken)))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not - or _), spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


LINK = re.compile(r"\]\(((?:\.\./)?(?:docs/)?([a-z_]+\.md))?#([^)\s]+)\)")


def test_every_markdown_anchor_resolves():
    """Links such as [x](docs/lmdeploy.md#threads) or [x](#threads) in the README and the docs."""
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, name, anchor in LINK.findall(path.read_text()):
            doc = path if not target else ROOT / "docs" / name
            if not doc.is_file():
                broken.append(f"{path.relative_to(ROOT)}: {target} does not exist")
                continue
            slugs = {_slug(re.sub(r"[`*]", "", h)) for h in _headings(doc)}
            if anchor not in slugs:
                broken.append(f"{path.relative_to(ROOT)}: {target or path.name}#{anchor} names no heading")
    assert not broken, "\n".join(sorted(set(broken)))


def test_code_elsewhere_is_named_not_located_by_line():
    """LMDeploy's (or anyone's) code is cited by qualified name, which survives a release, not by
    file:line, which does not."""
    located = re.compile(r"\b[\w/]+\.py:\d+")
    found = []
    for path in _files():
        if path.suffix in (".py", ".cpp", ".h", ".md") and path.parts[-2:] != ("tests", "test_doc_references.py"):
            for m in located.finditer(path.read_text(errors="replace")):
                found.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not found, "\n".join(found)
