"""bench/common.py: what the bench scripts share."""

from __future__ import annotations

from bench import common


def test_spread_is_the_median_with_the_range_and_one_value_alone():
    assert common.spread([0.9, 0.7, 0.8]) == "0.800 (0.700 to 0.900)"
    assert common.spread([1.0, 1.25], "{:.2f}x") == "1.12x (1.00x to 1.25x)"
    assert common.spread([3.0], "{:.0f}") == "3"
    assert common.spread([-0.01, 0.02, 0.0], "{:+.1%}") == "+0.0% (-1.0% to +2.0%)"
