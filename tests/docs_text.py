"""The text a user reads: the README and every page of the docs site (docs/**/*.md), in one place for
the tests that check what those pages say against the code and the records."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "docs"))

import check_examples as examples  # noqa: E402  (docs/check_examples.py, the console examples' check)

PAGES, ROOT = examples.PAGES, examples.ROOT  # the pages a user reads, as the examples check reads them


def read_pages() -> dict[Path, str]:
    """Each page's text, by path (README first)."""
    return {page: page.read_text() for page in PAGES}


def all_text() -> str:
    """Every page, one after another."""
    return "\n\n".join(read_pages().values())
