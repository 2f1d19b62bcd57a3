from __future__ import annotations

import random

from pagoda.analyze.recency import RecencyIndex


def test_counts_units_used_after_a_request_while_growing():
    rng = random.Random(0)
    index, counts = RecencyIndex(size=4), [0] * 300
    for _ in range(2000):
        stamp, units = rng.randrange(300), rng.randrange(-5, 10)
        index.move(stamp, units)
        counts[stamp] += units
        probe = rng.randrange(300)
        assert index.used_after(probe) == sum(counts[probe + 1 :])
    assert index.total == sum(counts)
