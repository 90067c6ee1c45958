"""The PNG of `kvguard simulate --plot`: KV usage, preemptions and admissions over time, one
line per policy.

Needs matplotlib (the optional `plot` extra: `pip install kvguard[plot]`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

from kvguard.admission.capacity import PoolCapacity
from kvguard.sim.model.replay import Run

_COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b"]
_REFUSED = "#ff7f0e"


def plot(path: Path, runs: Sequence[Run], capacity: PoolCapacity, watermark: float) -> None:
    """One line per run (policy) for KV use and preemptions; the ledger's reservations of
    each run that has one; the admissions and refusals of the first run that was decided."""
    figure, (usage, preempt, decisions) = plt.subplots(
        3, 1, figsize=(11, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    for run, colour in zip(runs, itertools.cycle(_COLOURS)):
        times = [s.t for s in run.timeline]
        usage.plot(times, [100 * s.kv_usage for s in run.timeline], color=colour, lw=1.2,
                   label=f"{run.label}: KV blocks in use")  # fmt: skip
        preempt.plot(times, [s.preemptions for s in run.timeline], color=colour, lw=1.5,
                     label=run.label)  # fmt: skip
        if run.reserved:
            usage.plot(
                [t for t, _ in run.reserved],
                [100 * r / capacity.blocks for _, r in run.reserved],
                color=colour, lw=1, ls="--", label=f"{run.label}: blocks reserved in the ledger",
            )  # fmt: skip
    usage.axhline(100 * (1 - watermark), color="grey", ls=":", lw=1,
                  label=f"kvguard limit (watermark {watermark:g})")  # fmt: skip
    usage.set_ylabel("% of KV blocks")
    usage.set_ylim(0, 128)  # headroom above 100 % for the legend
    usage.set_yticks(range(0, 101, 20))
    usage.set_title(
        f"KV cache: {capacity.blocks} blocks of {capacity.block_size} tokens", loc="left"
    )
    usage.legend(loc="upper right", fontsize=8, ncol=2)
    preempt.set_ylabel("preemptions (cumulative)")
    preempt.legend(loc="upper left", fontsize=8)
    end = max([run.end_s for run in runs] + [1e-9])
    bins = 60
    width = end / bins
    decided = next((run for run in runs if run.reserved), None)
    admitted, refused = [0] * bins, [0] * bins
    for t, ok in decided.decisions if decided else []:
        slot = min(int(t / width), bins - 1)
        (admitted if ok else refused)[slot] += 1
    starts = [i * width for i in range(bins)]
    decisions.bar(starts, admitted, width=width, align="edge", color=_COLOURS[1], label="admitted")
    decisions.bar(starts, refused, width=width, align="edge", bottom=admitted, color=_REFUSED,
                  label="refused (429/400; a retry counts again)")  # fmt: skip
    who = decided.label if decided else "kvguard"
    decisions.set_ylabel(f"{who} decisions\nper {width:.3g} s")
    decisions.set_xlabel("simulated time (s)")
    decisions.legend(loc="upper right", fontsize=8)
    for axis in (usage, preempt, decisions):
        axis.grid(alpha=0.3)
        axis.set_xlim(0, end)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
