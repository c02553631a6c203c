"""tests/README.md is the map from a package room to its tests: every test file is named there
exactly once, and every file it names exists, so the map cannot drift from the folder."""

from __future__ import annotations

import re
from collections import Counter

from conftest import REPO


def test_every_test_file_is_mapped_once():
    table = (REPO / "tests" / "README.md").read_text()
    named = Counter(re.findall(r"`(test_\w+\.py)`", table))
    present = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert sorted(present - set(named)) == []
    assert sorted(set(named) - present) == []
    assert [n for n, c in named.items() if c > 1] == []
