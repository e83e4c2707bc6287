"""The order in which a benchmark's sides take their turns, round after round.

A side's time depends on where in a round it runs (first after the bandwidth probe, right after a side that read
twice the bytes or ran other kernels: 8-19 % on the Zen 5 VM), so every side must take every position, and follow
every other side, equally often. Cycling through all n! permutations does that only over a multiple of n! rounds:
with four sides (`--base`) that is 24, and 7 or 25 rounds put this tree's sides first in almost every round (the
permutations come in lexicographic order), which printed identical code 3-10 % slower than the base's. A Williams
design does it in n rounds (2n for odd n): each side once in each position, each ordered pair of sides adjacent
once (twice for odd n). Callers run whole cycles of it (:func:`whole_cycles`).
"""

from __future__ import annotations


def balanced_orders(n: int) -> list[tuple[int, ...]]:
    """Orders of sides ``0 .. n-1`` for successive rounds, a Williams design: row r is ``r + c_j (mod n)`` for the
    column offsets ``c = 0, 1, n-1, 2, n-2, ...``; for odd n > 1 the reversed rows follow."""
    offsets = [0]
    for j in range(1, n):
        offsets.append((j + 1) // 2 if j % 2 else n - j // 2)
    rows = [tuple((r + c) % n for c in offsets) for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows


def whole_cycles(rounds: int, n: int) -> int:
    """``rounds`` rounded up to a whole number of cycles of :func:`balanced_orders` (n)."""
    cycle = len(balanced_orders(n))
    return -(-rounds // cycle) * cycle
