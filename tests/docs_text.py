"""The text a user reads: the README and every page of the docs site (docs/**/*.md), in one place for
the tests that check what those pages say against the code and the records."""

from pathlib import Path

ROOT = Path(__file__).parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))


def read_pages() -> dict[Path, str]:
    """Each page's text, by path (README first)."""
    return {page: page.read_text() for page in PAGES}


def all_text() -> str:
    """Every page, one after another."""
    return "\n\n".join(read_pages().values())
