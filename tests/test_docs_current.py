"""Lines of the README and the guides that went stale once, held to what they describe.

Each test here is a line that was found wrong (issue 36): a rebase example the tool refuses, a module
map naming files that moved, run records mixed into the guides. (The build guide's patch count is held
in tests/test_one_source.py, with every other place a patch reaches.)
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
GUIDES = sorted(DOCS.glob("*/README.md"))
RECORDS = DOCS / "records"
DATED = re.compile(r"\d{4}-\d{2}-\d{2}")


def test_the_rebase_examples_name_a_release_the_tool_takes() -> None:
    """``make rebase TO=x`` refuses a release ``patches/`` already holds (more than a prepared pin.toml)."""
    for path, text in [(REPO / "README.md", README), *((g, g.read_text()) for g in GUIDES)]:
        for version in re.findall(r"make rebase TO=(\d+\.\d+\.\d+)", text):
            folder = REPO / "patches" / version
            held = sorted(p.name for p in folder.iterdir() if p.name != "pin.toml") if folder.is_dir() else []
            assert not held, f"{path.relative_to(REPO)}: make rebase TO={version} is refused ({folder} holds {held})"


def test_run_records_live_in_one_place() -> None:
    """No dated folder or file among the guides; every record in the index; each guide links to it."""
    stray = [p.relative_to(REPO) for p in DOCS.rglob("*") if DATED.search(p.name) and RECORDS not in p.parents]
    assert stray == [], f"dated records outside docs/records/: {stray}"
    index = (RECORDS / "README.md").read_text()
    for topic in sorted(p for p in RECORDS.iterdir() if p.is_dir()):
        for entry in sorted(topic.iterdir()):
            if entry.name != "README.md":
                linked = f"{topic.name}/{entry.name}" in index or (
                    f"({topic.name}/)" in index or f"({topic.name}/README.md)" in index)
                assert linked, f"docs/records/README.md does not list {entry.relative_to(REPO)}"
    for guide in GUIDES:
        if guide.parent.name in ("records", "reliability"):  # the index itself; the sweeps' own catalogue
            continue
        text = guide.read_text()
        assert "records/README.md" in text, f"{guide.relative_to(REPO)} does not link to docs/records/"
        headings = [h for h in re.findall(r"(?m)^#+ .*$", text) if DATED.search(h)]
        assert headings == [], f"{guide.relative_to(REPO)}: dated sections belong in docs/records/: {headings}"


def test_the_architecture_module_map_names_files_that_are_there() -> None:
    arch = (DOCS / "ARCHITECTURE.md").read_text()
    section = arch.split("## Module map", 1)[1].split("\n## ", 1)[0]
    for row in section.splitlines()[3:]:
        folder = None
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            path = REPO / name if name.startswith("overlay/") else (folder / name if folder else REPO / name)
            assert path.exists(), f"ARCHITECTURE module map: {name} ({path.relative_to(REPO)}) is not there"
            folder = path if path.is_dir() else path.parent
