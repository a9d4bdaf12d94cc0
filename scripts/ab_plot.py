"""The scatter every alternated A/B in benchmarks/results plots: one column per row of the table, each run of
library A (grey) left of each run of library B (blue), so the spread between runs shows beside the change.

    import sys; sys.path.insert(0, "<repo>/scripts")
    from ab_plot import scatter_ab
    scatter_ab(ax, {("int4", 0.75, 1): {"A": [37.9, 30.6], "B": [47.7, 51.6]}}, ["int4\\n75% b1"])
"""

from __future__ import annotations

from typing import Any, Sequence


def scatter_ab(ax: Any, runs: dict[Any, dict[str, list[float]]], labels: Sequence[str], size: float = 18) -> None:
    """Plot `runs` ({row: {"A": values, "B": values}}, in the order given) on the matplotlib axes `ax`, the rows
    named by `labels`; the legend entries are "A" and "B"."""
    for i, row in enumerate(runs):
        for offset, tree, color in ((-0.15, "A", "tab:gray"), (0.15, "B", "tab:blue")):
            values = runs[row][tree]
            ax.scatter([i + offset] * len(values), values, color=color, s=size, label=tree if i == 0 else None)
    ax.set_xticks(range(len(runs)), list(labels))
