"""common/recent.py: the newest keys are remembered, the oldest forgotten first."""
from __future__ import annotations

import pytest

from common.recent import Recent


def test_the_oldest_key_is_forgotten_first() -> None:
    seen: Recent[str] = Recent(2)
    for key in ("a", "b", "a", "c"):  # "a" again keeps its place: the oldest
        seen.add(key)
    assert ("a" in seen, "b" in seen, "c" in seen, len(seen)) == (False, True, True, 2)
    with pytest.raises(ValueError):
        Recent(0)
