"""The repository's Markdown pages as GitHub reads them: the anchors its headings get and the relative links a page
holds, so a test can tell where a link or a `docs/<page>.md#anchor` reference in code leads, and whether it does."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1)(?!\n\s*\n)[\s\S])+?\1")  # within a paragraph
# [text](target) and ![alt](target), the text on one or more lines; the target without spaces, an optional "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def prose(text: str) -> str:
    """The page without its fenced code blocks (a `# comment` in a bash block is no heading, `[x](y)` no link)."""
    kept, fence = [], ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence:
            if m and line.strip().startswith(fence):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        kept.append(line)
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text of its links and code, lowercased, every character but letters,
    digits, spaces, '-' and '_' dropped, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text()).splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's links that lead inside the repository (`other.md#x`, `#x`, `../dir/`)."""
    text = INLINE_CODE.sub("", prose(page.read_text()))
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not EXTERNAL.match(t)]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken(target: str, base: Path) -> str | None:
    """Why `target` (a path relative to the folder `base`, with an optional #anchor) leads nowhere, or None."""
    path, _, anchor = target.partition("#")
    where = (base / path).resolve()
    if not where.exists():
        return f"{target}: no such file"
    if not anchor:
        return None
    if where.is_dir() or where.suffix != ".md":
        return f"{target}: an anchor on something that is no Markdown page"
    if anchor not in anchors(where):
        return f"{target}: {shown(where)} has no heading whose anchor is #{anchor}"
    return None


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` that leads nowhere, saying why; same-page anchors checked against its headings."""
    errors = []
    for target in relative_links(page):
        error = broken(page.name + target if target.startswith("#") else target, page.parent)
        if error:
            errors.append(f"{shown(page)}: {error}")
    return errors
