"""The figures of a replay, per tenant and per policy, and the tables `kvguard simulate` prints.

- served: requests that ran to their end; refused: requests refused in the end (429, after any
  retries, or 400 when they can never fit), by refusal code;
- preemptions: recompute preemptions of the requests (in a pool of several pods, also each
  pod's: vLLM preempts per pod);
- goodput: output tokens of served requests whose TTFT is within the SLO, per second of the
  run's span (the arrival window plus the drain: first arrival to last completion), tokens/s.
  A refused request counts zero, so refusing never adds to it;
- TTFT p50/p99: arrival (the first attempt) to first output token of admitted requests
  (nearest rank), seconds;
- KV used against reserved: blocks the engine holds and blocks the ledger reserves after each
  step, their mean over the time the engine is busy and their peak (several pods: each pod's
  blocks over its own steps, the peak the fullest pod; the ledger's, the pool's);
- Jain's fairness index over tenants of x = output tokens served ÷ the output tokens of the
  tenant's trace requests, its demand (1: every tenant got the same share of its demand; 1/n:
  one tenant got everything).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvguard.sim.model.replay import Outcome, Run

DEFAULT_TTFT_SLO_S = 2.0


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


@dataclass(frozen=True, slots=True)
class PolicyStats:
    """One policy's replay of a trace at one rate scale."""

    policy: str
    rate_scale: float
    requests: int
    served: int
    refused: dict[str, int]  # refusal code -> requests
    preemptions: int
    goodput: float
    ttft_p50: float | None
    ttft_p99: float | None
    used_mean: float
    used_peak: int
    reserved_mean: float | None  # None without a ledger (vLLM alone)
    reserved_peak: int | None
    fairness: float
    quiet_p99: float | None = None  # the quiet tenant's TTFT p99 beside the trace
    quiet_alone_p99: float | None = None  # and replayed alone
    pod_preemptions: tuple[int, ...] = ()  # each pod's, in a pool of several

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


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
    """The arrival window plus the drain: first arrival to the run's end."""
    first = min((o.request.arrival_s for o in run.outcomes), default=0.0)
    return max(run.end_s - first, 1e-9)


def _served_tokens(outcomes: Iterable[Outcome]) -> int:
    return sum(o.seq.output_tokens for o in outcomes if o.seq and o.seq.finish_reason)


def _good_tokens(outcomes: Iterable[Outcome], slo_s: float) -> int:
    """Output tokens of served requests whose TTFT is within `slo_s`."""
    return _served_tokens(o for o in outcomes if (t := o.ttft_s) is not None and t <= slo_s)


def tenant_stats(
    run: Run, tier_of: dict[str, str] | None = None, slo_s: float = DEFAULT_TTFT_SLO_S
) -> dict[str, TenantStats]:
    grouped: dict[str, list[Outcome]] = {}
    for outcome in run.outcomes:
        grouped.setdefault(outcome.request.tenant, []).append(outcome)
    span = span_s(run)
    stats = {}
    for tenant in sorted(grouped, key=lambda t: (-len(grouped[t]), t)):
        outcomes = grouped[tenant]
        ttfts = [t for o in outcomes if (t := o.ttft_s) is not None]
        tiers = Counter(o.verdict.tier for o in outcomes)
        tier = (tier_of or {}).get(tenant) or tiers.most_common(1)[0][0]
        stats[tenant] = TenantStats(
            tenant=tenant,
            tier=tier,
            requests=len(outcomes),
            refused=sum(1 for o in outcomes if o.verdict.refused is not None),
            clamped=sum(1 for o in outcomes if o.verdict.clamped),
            preemptions=sum(o.seq.preemptions for o in outcomes if o.seq is not None),
            asked_tokens=sum(o.request.output_tokens for o in outcomes),
            served_tokens=_served_tokens(outcomes),
            goodput=_good_tokens(outcomes, slo_s) / span,
            ttft_p50=percentile(ttfts, 0.50),
            ttft_p99=percentile(ttfts, 0.99),
        )
    return stats


def fairness(stats: dict[str, TenantStats]) -> float:
    return jain([s.served_tokens / s.asked_tokens for s in stats.values() if s.asked_tokens])


def tenant_p99(run: Run, tenant: str) -> float | None:
    return percentile((t for o in run.outcomes if o.request.tenant == tenant
                       and (t := o.ttft_s) is not None), 0.99)  # fmt: skip


def policy_stats(run: Run, rate_scale: float, gated: bool, slo_s: float) -> PolicyStats:
    ttfts = [t for o in run.outcomes if (t := o.ttft_s) is not None]
    refused = Counter(o.verdict.refused for o in run.outcomes if o.verdict.refused)
    return PolicyStats(
        policy=run.label,
        rate_scale=rate_scale,
        requests=len(run.outcomes),
        served=sum(1 for o in run.outcomes if o.seq is not None and o.seq.finish_reason),
        refused=dict(refused.most_common()),
        preemptions=run.preemptions,
        goodput=_good_tokens(run.outcomes, slo_s) / span_s(run),
        ttft_p50=percentile(ttfts, 0.50),
        ttft_p99=percentile(ttfts, 0.99),
        used_mean=run.kv.used_mean,
        used_peak=run.kv.used_peak,
        reserved_mean=run.kv.reserved_mean if gated else None,
        reserved_peak=run.kv.reserved_peak if gated else None,
        fairness=fairness(tenant_stats(run, slo_s=slo_s)),
        pod_preemptions=tuple(run.pod_preemptions) if len(run.pod_preemptions) > 1 else (),
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _columns(rows: list[list[str]], right: set[int]) -> list[str]:
    """Rows of cells aligned in columns (those in `right` to the right), two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in rows
    ]


def policy_table(rows: Sequence[PolicyStats], slo_s: float) -> str:
    """One line per rate scale and policy, then each scale's gap between worst_case and the
    oracle, and the refusals by code."""
    quiet = any(r.quiet_p99 is not None or r.quiet_alone_p99 is not None for r in rows)
    header = ["scale", "policy", "served", "refused", "preempt", f"goodput@{slo_s:g}s",
              "TTFT p50", "TTFT p99", "KV used mean/peak", "reserved mean/peak",
              "Jain"]  # fmt: skip
    if quiet:
        header.append("quiet p99 (alone)")
    by_pod = any(r.pod_preemptions for r in rows)
    if by_pod:
        header.append("preempt by pod")
    cells = [header]
    for r in rows:
        line = [
            f"x{r.rate_scale:g}",
            r.policy,
            f"{r.served}/{r.requests}",
            f"{r.refused_total / r.requests:.1%}" if r.requests else "-",
            str(r.preemptions),
            f"{r.goodput:.1f}",
            _s(r.ttft_p50),
            _s(r.ttft_p99),
            f"{r.used_mean:.0f} / {r.used_peak}",
            "-" if r.reserved_mean is None else f"{r.reserved_mean:.0f} / {r.reserved_peak}",
            f"{r.fairness:.3f}",
        ]
        if quiet:
            line.append(f"{_s(r.quiet_p99)} ({_s(r.quiet_alone_p99)})")
        if by_pod:
            line.append("/".join(map(str, r.pod_preemptions)) or "-")
        cells.append(line)
    lines = _columns(cells, right=set(range(2, len(header))))
    lines.append("")
    lines.extend(gaps(rows))
    for r in rows:
        if r.refused:
            codes = ", ".join(f"{n} {code}" for code, n in r.refused.items())
            lines.append(f"refused at x{r.rate_scale:g} by {r.policy}: {codes}")
    return "\n".join(lines).rstrip()


def gaps(rows: Sequence[PolicyStats]) -> list[str]:
    """Per rate scale, what worst-case reservation costs against the oracle's."""
    lines = []
    for scale in dict.fromkeys(r.rate_scale for r in rows):
        by_policy = {r.policy: r for r in rows if r.rate_scale == scale}
        worst, oracle = by_policy.get("worst_case"), by_policy.get("oracle")
        if worst is None or oracle is None:
            continue
        ratio = f"{worst.goodput / oracle.goodput:.2f}" if oracle.goodput else "-"
        lines.append(
            f"x{scale:g}: worst_case serves {worst.served} against the oracle's {oracle.served} "
            f"(refuses {worst.refused_total / worst.requests:.1%} against "
            f"{oracle.refused_total / oracle.requests:.1%}); goodput {worst.goodput:.1f} against "
            f"{oracle.goodput:.1f} tok/s ({ratio} of it)"
        )
    return lines


def tenant_table(runs: Sequence[Run], tier_of: dict[str, str], slo_s: float) -> str:
    """Per tenant, each policy side by side: preemptions, goodput, TTFT p99 and refusals."""
    stats = [tenant_stats(run, tier_of, slo_s) for run in runs]
    groups = ["preemptions", f"goodput@{slo_s:g}s tok/s", "TTFT p99 s", "refused"]
    names = [run.label for run in runs]
    cells = [["tenant", "tier", "reqs"] + names * len(groups)]
    for tenant, ours in stats[0].items():
        per = [s[tenant] for s in stats]
        cells.append(
            [tenant, ours.tier or "-", str(ours.requests)]
            + [str(s.preemptions) for s in per]
            + [f"{s.goodput:.1f}" for s in per]
            + [_s(s.ttft_p99) for s in per]
            + [f"{s.refusal_rate:.0%}" for s in per]
        )
    # The group names go over their policies' columns: a group's first column widens to fit.
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    above = " " * (sum(widths[:3]) + 2 * 3)
    for index, group in enumerate(groups):
        first = 3 + index * len(names)
        span = sum(widths[first : first + len(names)]) + 2 * (len(names) - 1)
        if span < len(group):
            cells[0][first] = cells[0][first].rjust(widths[first] + len(group) - span)
            span = len(group)
        above += group.center(span) + "  "
    lines = _columns(cells, right=set(range(2, len(cells[0]))))
    return "\n".join([above.rstrip(), *lines])
