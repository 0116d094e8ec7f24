"""The README is a front page that links one page per topic under docs/, and code, chart and tests send readers to
those pages (`docs/security.md#threat-model`): every relative link of README.md and docs/ must lead to a file that
exists and, with an #anchor, to a heading of that page as GitHub names it; so must every such reference in the
repository's files. A heading renamed or text moved to another page otherwise leaves links that lead nowhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.docs_pages import ROOT, anchors, broken, broken_links, slug

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# A docs page or the README named in any file, with its anchor: `docs/router.md#configuration`.
REFERENCE = re.compile(r"(?<![\w/.-])(README\.md|docs/[\w-]+\.md)(#[\w-]+)?")


def tracked_files() -> list[Path]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, so no list of the repository's files: {e}")
    return [ROOT / name for name in done.stdout.decode().split("\0") if name]


def test_every_relative_link_of_the_readme_and_the_docs_leads_to_a_file_and_heading() -> None:
    assert len(PAGES) > 10, PAGES  # the README, architecture.md, the topic pages and the experiments
    assert [e for page in PAGES for e in broken_links(page)] == []


def test_every_docs_page_a_file_names_exists_with_the_heading_it_names() -> None:
    errors, naming = [], set()
    for path in tracked_files():
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        for page, anchor in REFERENCE.findall(text):
            naming.add(path.relative_to(ROOT).parts[0])
            error = broken(page + anchor, ROOT)
            if error:
                errors.append(f"{path.relative_to(ROOT)}: {error}")
    assert errors == []
    assert {"src", "deploy", "tests"} <= naming, naming  # the scan reads code, the chart and tests, not only docs


def test_anchors_are_githubs_and_the_check_finds_what_leads_nowhere(tmp_path: Path) -> None:
    assert slug("Security and tenancy") == "security-and-tenancy"
    assert slug("The HTTP path's overhead (gRPC vs OpenAI HTTP, same cluster)") == (
        "the-http-paths-overhead-grpc-vs-openai-http-same-cluster"
    )
    assert slug("`pdserve scale --addr`") == "pdserve-scale---addr"
    assert slug("Prefix-cache isolation") == "prefix-cache-isolation"
    assert slug("[Alerts](other.md) and snake_case") == "alerts-and-snake_case"
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Threat model\n\n## Threat model\n\n```bash\n# not a heading\n[not](a-link.md)\n```\n\n"
        "[ok](#threat-model) [ok](#threat-model-1) [ok](other.md#a-b) [ok](https://example.com/x.md) `[code](x.md)`\n"
        "[gone](missing.md) [gone](other.md#nothing) [gone](#not-a-heading) [multi\nline](missing-too.md)\n"
    )
    (tmp_path / "other.md").write_text("# A b\n")
    assert anchors(page) == {"title", "threat-model", "threat-model-1"}
    found = broken_links(page)
    assert [e.split(": ", 1)[1].split(":")[0] for e in found] == [
        "missing.md",
        "other.md#nothing",
        "page.md#not-a-heading",
        "missing-too.md",
    ], found
