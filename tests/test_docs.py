"""The README and docs/ point at things that exist: the README stays a short front door that links every
page, every relative markdown link resolves to a file (and an #anchor to a heading of it), and every
repository path a page names in backticks is still in the tree (files move; the pages must follow).
Pure file reads, no imports of mtds."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 200


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ](target) or ](target "title"); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# inline code (one or more backticks, same count to close) and fenced blocks
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
# a repository path: one of these top-level folders, then path characters
PATH = re.compile(r"(?<![\w./-])((?:mtds|lab|tests|benchmarks|compare|ds_configs)/[\w./-]*)")
PLACEHOLDER = re.compile(r"[{}*<>\[\]]|(?:^|/)(?:X|N|NAME|FILE|PREFIX)(?:[/._]|$)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [m.group(1) for m in LINK.finditer(text)]


def _code_spans(text: str) -> list[str]:
    spans = [m.group(0) for m in FENCE.finditer(text)]
    spans += [m.group(2) for m in INLINE.finditer(FENCE.sub("", text))]
    return spans


def _wanted(path: str) -> bool:
    """The repository paths the check holds: modules, directories of the package and the lab, tests,
    benchmark and compare scripts, shipped DeepSpeed configs."""
    top = path.split("/", 1)[0]
    if top == "mtds":
        return path.endswith(".py") or path.endswith("/")
    if top == "lab":
        return True
    if top in ("tests", "benchmarks", "compare"):
        return path.endswith(".py")
    return path.endswith(".json")       # ds_configs


# a module named from inside the package, e.g. `training/train_loop.py` in a table about mtds/
SUBPACKAGES = tuple(sorted(d.name for d in (ROOT / "mtds").iterdir() if (d / "__init__.py").exists()))
INNER = re.compile(r"(?<![\w./-])((?:" + "|".join(SUBPACKAGES) + r")/[\w./-]*\.py)\b")


def _repo_paths(page: Path) -> list[str]:
    found = []
    for span in _code_spans(page.read_text()):
        for token in re.split(r"\s+", span):
            if PLACEHOLDER.search(token):
                continue
            for m in PATH.finditer(token):
                path = m.group(1).rstrip(".,:;")
                if _wanted(path):
                    found.append(path)
            found += ["mtds/" + m.group(1) for m in INNER.finditer(token)]
    return found


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES}); move details to docs/"


def test_relative_links_resolve():
    """Every relative link names an existing file; a #anchor into a markdown page names one of its headings."""
    broken = []
    for page in _pages():
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue            # http(s):, mailto:
            path, _, anchor = target.partition("#")
            file = page.parent / path if path else page
            if not file.exists():
                broken.append(f"{_rel(page)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{_rel(page)}: {target} (no such heading)")
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken)


def test_backticked_repository_paths_exist():
    missing = []
    for page in _pages():
        for path in sorted(set(_repo_paths(page))):
            if not (ROOT / path).exists():
                missing.append(f"{_rel(page)}: {path}")
    assert not missing, f"{len(missing)} paths not in the tree:\n" + "\n".join(missing)


def test_readme_links_every_doc():
    """The README's documentation list reaches every page under docs/."""
    linked = {t.partition("#")[0] for t in _links(README)}
    unlinked = [f"docs/{page.name}" for page in sorted((ROOT / "docs").glob("*.md")) if f"docs/{page.name}" not in linked]
    assert not unlinked, f"README.md links none of: {unlinked}"


def test_the_checks_see_something():
    """Guards the regular expressions: the README links into docs/ and names repository paths."""
    assert any(t.startswith("docs/") for t in _links(README))
    assert len([p for page in _pages() for p in _repo_paths(page)]) > 50
