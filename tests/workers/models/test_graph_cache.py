"""The bounded store of captured graphs (runs on CPU: it only keeps and drops entries)."""

from __future__ import annotations

import pytest

from workers.models.graph_cache import GraphCache


def test_least_recently_used_entries_are_dropped_with_a_callback():
    dropped = []
    cache = GraphCache(2, on_evict=dropped.append)
    cache[1] = "one"
    cache[17] = "seventeen"
    assert cache[1] == "one"  # 1 is now the most recently used
    cache[257] = "two-five-seven"
    assert dropped == [17] and 17 not in cache and cache.keys() == [1, 257]
    cache[1] = "one again"  # replacing refreshes, drops nothing
    cache[65] = "sixty-five"
    assert dropped == [17, 257] and cache.keys() == [1, 65] and len(cache) == 2


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit must be >= 1"):
        GraphCache(0)
