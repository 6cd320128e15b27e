"""One measured figure, and the arithmetic the benchmarks share: percentiles, and
for the retrieval quality checks nDCG@10 of a known item and a bootstrap interval."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    parameters: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "parameters": self.parameters,
        }


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def known_item_ndcg_at_10(ranked: Sequence[str], relevant: str) -> float:
    """nDCG@10 of a query with one relevant item: 1/log2(rank + 1), 0 past rank 10."""
    top = list(ranked[:10])
    return 1 / math.log2(top.index(relevant) + 2) if relevant in top else 0.0


def bootstrap_interval(
    values: Sequence[float], *, seed: int, rounds: int = 2000
) -> tuple[float, float]:
    """A 95% bootstrap interval of the mean (paired when `values` are per-query
    differences)."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]
