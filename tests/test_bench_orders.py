"""The benchmarks' turn order (benchmarks/orders.py): over one cycle every side takes every position equally often
and follows every other side equally often, so no side of a comparison is systematically first or after a
heavier one."""

from __future__ import annotations

import collections
import importlib.util
import itertools
from pathlib import Path

import pytest

# loaded from its file: putting benchmarks/ on sys.path would let its helper modules shadow other imports
_spec = importlib.util.spec_from_file_location(
    "bench_orders", Path(__file__).resolve().parents[1] / "benchmarks" / "orders.py")
_orders = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_orders)
balanced_orders, whole_cycles = _orders.balanced_orders, _orders.whole_cycles


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_each_side_takes_each_position_and_follows_each_other_side_equally_often(n):
    orders = balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    positions = collections.Counter((side, at) for order in orders for at, side in enumerate(order))
    assert set(positions.values()) == {len(orders) // n}
    assert len(positions) == n * n
    pairs = collections.Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert set(pairs) == set(itertools.permutations(range(n), 2))
    assert len(set(pairs.values())) <= 1


def test_rounds_are_rounded_up_to_whole_cycles():
    assert [whole_cycles(r, 2) for r in (1, 2, 7, 8)] == [2, 2, 8, 8]
    assert [whole_cycles(r, 4) for r in (7, 25)] == [8, 28]
    assert whole_cycles(7, 3) == 12
