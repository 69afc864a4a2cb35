"""Every relative link and `#anchor` in README.md, CONTRIBUTING.md and docs/ resolves.

Anchors follow GitHub's rules for heading ids: the heading's text (its markdown rendered to plain
text) lowercased, punctuation removed, each space a hyphen; a heading whose id is taken gets
`-1`, `-2`, ... in order. Links inside code (fenced blocks, inline code) are not links, and
external links (http, https, mailto) are not fetched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "README.md").is_file():
            return folder
    raise AssertionError(f"no repository root above {here}")


ROOT = _repo_root()

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target may sit in <...> and be followed by a title.
_INLINE_LINK = re.compile(
    r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


@dataclass(frozen=True)
class Link:
    source: Path
    line: int
    target: str


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = _FENCE.match(line)
        if fence is None:
            if opened:
                fence = opened.group(1)
                continue
            yield number, line
        elif opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
            fence = None


def _plain_heading_text(markdown: str) -> str:
    """A heading's text as GitHub renders it: code spans, links and emphasis reduced to text."""
    text = _CODE_SPAN.sub(lambda m: m.group(2).strip(), markdown)
    text = _INLINE_LINK.sub(lambda m: m.group(1), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return text.replace("*", "")


def slug(heading: str) -> str:
    """GitHub's id for a heading's plain text (before duplicates are numbered)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, _, - and spaces
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every id a markdown file defines: its headings' (numbered as GitHub numbers duplicates)
    and explicit HTML ones."""
    found: set[str] = set()
    taken: dict[str, int] = {}
    for _, line in _prose_lines(text):
        heading = _HEADING.match(line)
        if heading:
            base = slug(_plain_heading_text(heading.group(2)))
            count = taken.get(base, 0)
            taken[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(_HTML_ID.findall(line))
    return found


def links(path: Path) -> Iterator[Link]:
    """The links of a markdown file, outside code; a link's text may wrap across lines."""
    lines = dict(_prose_lines(path.read_text(encoding="utf-8")))
    numbered = [lines.get(n, "") for n in range(1, max(lines, default=0) + 1)]
    prose = "\n".join(_CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line) for line in numbered)
    for match in _INLINE_LINK.finditer(prose):
        yield Link(path, prose.count("\n", 0, match.start(2)) + 1, match.group(2))
    for number, line in enumerate(numbered, 1):
        definition = _REFERENCE_DEF.match(line)
        if definition:
            yield Link(path, number, definition.group(1))


def broken_links(paths: list[Path], root: Path) -> list[str]:
    """One line per link among `paths` whose file or anchor does not exist."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}

    def anchors_of(path: Path) -> set[str]:
        if path not in cache:
            cache[path] = anchors(path.read_text(encoding="utf-8"))
        return cache[path]

    for path in paths:
        for link in links(path):
            if not link.target or _EXTERNAL.match(link.target):
                continue
            file_part, _, anchor = link.target.partition("#")
            where = f"{link.source.relative_to(root)}:{link.line}: {link.target}"
            target = (link.source.parent / file_part).resolve() if file_part else link.source
            if not target.is_relative_to(root.resolve()):
                problems.append(f"{where}: outside the repository")
                continue
            if not target.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor and target.suffix == ".md" and anchor not in anchors_of(target):
                problems.append(f"{where}: no heading with id #{anchor} in {target.name}")
    return problems


def documentation(root: Path) -> list[Path]:
    """README.md, CONTRIBUTING.md and every markdown file under docs/."""
    return [
        *(root / name for name in ("README.md", "CONTRIBUTING.md") if (root / name).is_file()),
        *sorted((root / "docs").rglob("*.md")),
    ]


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    paths = documentation(ROOT)
    assert ROOT / "README.md" in paths
    assert ROOT / "CONTRIBUTING.md" in paths
    assert sum(1 for path in paths for _ in links(path)) > 80  # the parser finds the links
    assert broken_links(paths, ROOT) == []


# --- the checker itself, on small samples ---------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Install", "install"),
        ("The two commands (fresh machine)", "the-two-commands-fresh-machine"),
        ("The offline bound (`--policy belady`)", "the-offline-bound---policy-belady"),
        ("vLLM's own tests", "vllms-own-tests"),
        (
            "Manager: time inside the manager per key visit",
            "manager-time-inside-the-manager-per-key-visit",
        ),
        ("`kvcache replay`: hit ratios", "kvcache-replay-hit-ratios"),
        ("Settings (`kv_connector_extra_config`)", "settings-kv_connector_extra_config"),
        ("Retention hints: what they are worth", "retention-hints-what-they-are-worth"),
        ("Prefix hits: the **turn** policy", "prefix-hits-the-turn-policy"),
        ("See [the docs](docs/x.md) now", "see-the-docs-now"),
        ("GPU\u21c4host, 4\u2013128 KiB", "gpuhost-4128-kib"),
    ],
)
def test_slugs_follow_githubs_rules(heading: str, expected: str) -> None:
    assert slug(_plain_heading_text(heading)) == expected


SAMPLE_README = """\
# Sample

## Usage
See [usage](#usage), [the guide](docs/guide.md#setup), [again](docs/guide.md#setup-1),
[a third](docs/guide.md#setup-2), [the site](https://example.com/nowhere#x) and
![a picture](docs/missing.png).

## Broken
A [gone file](docs/gone.md), a [gone anchor](#nowhere), a
[gone anchor elsewhere](docs/guide.md#teardown), [out of the tree](../../etc/passwd).

`[not a link](nowhere.md)` in code, and:

```markdown
[not a link either](nowhere.md)
## Not a heading
```

[ref]: docs/guide.md#not-there
"""

SAMPLE_GUIDE = """\
## Setup
## Setup
## Setup
<a id="custom"></a>
Back to the [README](../README.md#usage) and [here](#custom).
"""


def test_the_checker_reports_each_broken_link_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(SAMPLE_README)
    (tmp_path / "docs" / "guide.md").write_text(SAMPLE_GUIDE)
    paths = [tmp_path / "README.md", tmp_path / "docs" / "guide.md"]
    assert broken_links(paths, tmp_path) == [
        "README.md:6: docs/missing.png: no such file",
        "README.md:9: docs/gone.md: no such file",
        "README.md:9: #nowhere: no heading with id #nowhere in README.md",
        "README.md:10: docs/guide.md#teardown: no heading with id #teardown in guide.md",
        "README.md:10: ../../etc/passwd: outside the repository",
        "README.md:19: docs/guide.md#not-there: no heading with id #not-there in guide.md",
    ]
    assert anchors(SAMPLE_README) == {"sample", "usage", "broken"}
    assert anchors(SAMPLE_GUIDE) == {"setup", "setup-1", "setup-2", "custom"}
