"""The admission policies `kvguard simulate` replays side by side, by name.

- `vllm`: no gate. vLLM alone applies the client's `max_tokens`, or its own default when the
  client sent none (max_model_len less the prompt), and allocates KV blocks as tokens come.
- `worst_case`: kvguard as `serve` runs it. Each request reserves its prompt plus its whole
  clamped output limit, the tier default when the client sent none.
- `calibrated`: kvguard with `pools[].reservation.mode: calibrated`. Each request reserves the
  learnt quantile of what its tier (or tenant) produces, worst case until enough samples exist;
  leases grow as requests decode, and preemptions push reservations back towards the worst case.
- `oracle`: kvguard's gate reserving each request's true output, min(real, limit): the upper
  bound of any estimate of output lengths.

A policy that gates says how many output tokens each request reserves; `admission.decide.plan`
caps that by the limit, so every policy is sized by the one decision `serve` makes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvguard.sim.model.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    summary: str
    gated: bool  # decided by kvguard's gate; False: straight to the engine
    # Output tokens a request reserves; None reserves the whole limit, or the calibrated
    # estimate when `calibrated`.
    reserve: Callable[[TraceRequest], int | None]
    calibrated: bool = False


def _whole_limit(_request: TraceRequest) -> int | None:
    return None


def _true_output(request: TraceRequest) -> int | None:
    return request.output_tokens


POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        Policy("vllm", "vLLM alone, no admission", gated=False, reserve=_whole_limit),
        Policy("worst_case", "kvguard: prompt + the whole clamped limit", True, _whole_limit),
        Policy(
            "calibrated",
            "kvguard: prompt + the learnt quantile, growing, backing off on preemptions",
            True,
            _whole_limit,
            calibrated=True,
        ),
        Policy("oracle", "kvguard reserving each request's true output", True, _true_output),
    )
}


def by_names(text: str) -> list[Policy]:
    """The policies a comma-separated list names, in its order. Raises ValueError naming an
    unknown one and the known ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        shown = ", ".join(unknown) if unknown else repr(text)
        raise ValueError(f"unknown policy {shown}: expected some of {', '.join(POLICIES)}")
    return [POLICIES[name] for name in dict.fromkeys(names)]
