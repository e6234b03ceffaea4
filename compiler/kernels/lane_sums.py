"""Sums written as balanced trees of TIR expressions, shared by the CPU kernel families (the order is part of the
numerics: the integer-dot GEMV's rows and the prefill attention kernels' block sums are summed exactly so)."""

from __future__ import annotations

import operator

from tvm.script import tirx as T


def lane_sum(value, lanes: int):
    """The sum of a vector expression's `lanes` lanes: halves added by shuffles of the expression itself (it is
    repeated, and LLVM computes it once)."""
    while lanes > 1:
        lanes //= 2
        value = T.Shuffle([value], list(range(lanes))) + T.Shuffle([value], list(range(lanes, 2 * lanes)))
    return value


def pairwise_sum(terms: list, combine=operator.add):
    """terms[0] + terms[1] + ... (or another associative `combine`, such as T.max) as a balanced tree: neighbours
    combined pairwise, level by level."""
    while len(terms) > 1:
        terms = [combine(terms[i], terms[i + 1]) if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]
