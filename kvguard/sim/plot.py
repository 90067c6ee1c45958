"""The PNG of `kvguard simulate --plot`: KV usage, preemptions and admissions over time.

Needs matplotlib (the optional `plot` extra: `pip install kvguard[plot]`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

from kvguard.admission.capacity import PoolCapacity
from kvguard.sim.replay import Run

_UNGUARDED, _GUARDED, _REFUSED = "#d62728", "#1f77b4", "#ff7f0e"


def plot(
    path: Path, unguarded: Run, guarded: Run, capacity: PoolCapacity, watermark: float
) -> None:
    figure, (usage, preempt, decisions) = plt.subplots(
        3, 1, figsize=(11, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    for run, colour in ((unguarded, _UNGUARDED), (guarded, _GUARDED)):
        times = [s.t for s in run.timeline]
        usage.plot(times, [100 * s.kv_usage for s in run.timeline], color=colour, lw=1.2,
                   label=f"{run.label}: KV blocks in use")  # fmt: skip
        preempt.plot(times, [s.preemptions for s in run.timeline], color=colour, lw=1.5,
                     label=run.label)  # fmt: skip
    if guarded.reserved:
        usage.plot(
            [t for t, _ in guarded.reserved],
            [100 * r / capacity.blocks for _, r in guarded.reserved],
            color=_GUARDED, lw=1, ls="--", label="kvguard: blocks reserved in the ledger",
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
    end = max(unguarded.end_s, guarded.end_s, 1e-9)
    bins = 60
    width = end / bins
    admitted, refused = [0] * bins, [0] * bins
    for t, ok in guarded.decisions:
        slot = min(int(t / width), bins - 1)
        (admitted if ok else refused)[slot] += 1
    starts = [i * width for i in range(bins)]
    decisions.bar(starts, admitted, width=width, align="edge", color=_GUARDED, label="admitted")
    decisions.bar(starts, refused, width=width, align="edge", bottom=admitted, color=_REFUSED,
                  label="refused (429/400; a retry counts again)")  # fmt: skip
    decisions.set_ylabel(f"kvguard decisions\nper {width:.3g} s")
    decisions.set_xlabel("simulated time (s)")
    decisions.legend(loc="upper right", fontsize=8)
    for axis in (usage, preempt, decisions):
        axis.grid(alpha=0.3)
        axis.set_xlim(0, end)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
