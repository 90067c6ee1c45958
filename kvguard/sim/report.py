"""Per-tenant figures of a replay, and the side-by-side table `kvguard simulate` prints.

- preemptions: recompute preemptions of the tenant's requests;
- goodput: output tokens of the tenant's completed requests ÷ the run's span (first arrival
  to last completion), tokens/s;
- TTFT p50/p99: arrival to first output token of admitted requests (nearest rank), seconds;
- refused: share of the tenant's requests refused in the end (429, after any retries, or 400
  when they can never fit);
- Jain's fairness index over tenants of x = output tokens served ÷ output tokens asked for
  (1: every tenant got the same share of what it asked; 1/n: one tenant got everything).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvguard.sim.replay import Run


@dataclass(frozen=True, slots=True)
class TenantStats:
    tenant: str
    tier: str
    requests: int
    refused: int
    clamped: int
    preemptions: int
    asked_tokens: int
    served_tokens: int
    goodput: float
    ttft_p50: float | None
    ttft_p99: float | None

    @property
    def refusal_rate(self) -> float:
        return self.refused / self.requests if self.requests else 0.0


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1); None without values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def jain(values: list[float]) -> float:
    """Jain's fairness index: (Σx)² / (n Σx²); 1 when all are equal."""
    square_sum = sum(v * v for v in values)
    if not values or square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


def span_s(run: Run) -> float:
    first = min((o.request.arrival_s for o in run.outcomes), default=0.0)
    return max(run.end_s - first, 1e-9)


def tenant_stats(run: Run, tier_of: dict[str, str] | None = None) -> dict[str, TenantStats]:
    grouped: dict[str, list[int]] = {}
    for i, outcome in enumerate(run.outcomes):
        grouped.setdefault(outcome.request.tenant, []).append(i)
    span = span_s(run)
    stats = {}
    for tenant in sorted(grouped, key=lambda t: (-len(grouped[t]), t)):
        outcomes = [run.outcomes[i] for i in grouped[tenant]]
        served = [o for o in outcomes if o.seq is not None and o.seq.finish_reason is not None]
        ttfts = [t for o in outcomes if (t := o.ttft_s) is not None]
        tiers = Counter(o.verdict.tier for o in outcomes)
        tier = (tier_of or {}).get(tenant) or tiers.most_common(1)[0][0]
        served_tokens = sum(o.seq.output_tokens for o in served if o.seq is not None)
        stats[tenant] = TenantStats(
            tenant=tenant,
            tier=tier,
            requests=len(outcomes),
            refused=sum(1 for o in outcomes if o.verdict.refused is not None),
            clamped=sum(1 for o in outcomes if o.verdict.clamped),
            preemptions=sum(o.seq.preemptions for o in outcomes if o.seq is not None),
            asked_tokens=sum(o.request.output_tokens for o in outcomes),
            served_tokens=served_tokens,
            goodput=served_tokens / span,
            ttft_p50=percentile(ttfts, 0.50),
            ttft_p99=percentile(ttfts, 0.99),
        )
    return stats


def fairness(stats: dict[str, TenantStats]) -> float:
    return jain([s.served_tokens / s.asked_tokens for s in stats.values() if s.asked_tokens])


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


_PAIR = 17  # "unguarded kvguard": 9 + 1 + 7


def _pair(unguarded: str, guarded: str) -> str:
    return f"{unguarded:>9} {guarded:>7}"


def table(unguarded: Run, guarded: Run, tier_of: dict[str, str]) -> str:
    """The per-tenant comparison (unguarded | kvguard side by side) and each run's totals."""
    before, after = tenant_stats(unguarded, tier_of), tenant_stats(guarded, tier_of)
    width = max([6, *(len(t) for t in before)])
    groups = ["preemptions", "goodput tok/s", "TTFT p50 s", "TTFT p99 s"]
    lines = [
        f"{'':<{width}} {'':<5} {'':>5}  "
        + "  ".join(f"{g:^{_PAIR}}" for g in groups)
        + f"  {'refused':>7}",
        f"{'tenant':<{width}} {'tier':<5} {'reqs':>5}  "
        + "  ".join(_pair("unguarded", "kvguard") for _ in groups)
        + f"  {'kvguard':>7}",
    ]
    for tenant, b in before.items():
        a = after[tenant]
        cells = [
            _pair(str(b.preemptions), str(a.preemptions)),
            _pair(f"{b.goodput:.1f}", f"{a.goodput:.1f}"),
            _pair(_s(b.ttft_p50), _s(a.ttft_p50)),
            _pair(_s(b.ttft_p99), _s(a.ttft_p99)),
        ]
        lines.append(
            f"{tenant:<{width}} {(b.tier or '-'):<5} {b.requests:>5}  "
            + "  ".join(cells)
            + f"  {a.refusal_rate:>7.0%}"
        )
    lines.append("")
    for run, stats in ((unguarded, before), (guarded, after)):
        ttfts = [t for o in run.outcomes if (t := o.ttft_s) is not None]
        refused = sum(s.refused for s in stats.values())
        served = sum(s.served_tokens for s in stats.values())
        clamped = sum(s.clamped for s in stats.values())
        retried = sum(o.attempts - 1 for o in run.outcomes)
        lines.append(
            f"{run.label:<9}: {run.preemptions} preemptions, goodput {served / span_s(run):.1f} "
            f"tok/s, TTFT p50 {_s(percentile(ttfts, 0.5))} s / p99 {_s(percentile(ttfts, 0.99))} "
            f"s, refused {refused} of {len(run.outcomes)}"
            + (f" ({_reasons(run)})" if refused else "")
            + (f", {retried} retries" if retried else "")
            + (f", clamped {clamped}" if clamped else "")
            + f", Jain's fairness {fairness(stats):.3f}, done at {run.end_s:.0f} s"
        )
    return "\n".join(lines)


def _reasons(run: Run) -> str:
    counts = Counter(o.verdict.refused for o in run.outcomes if o.verdict.refused)
    return ", ".join(f"{n} {code}" for code, n in counts.most_common())
