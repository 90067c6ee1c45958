"""`kvguard serve`'s admission as the admission tests drive it, without a tokenizer: one pool of
the config for model MODEL, a memory ledger, and a counter that is handed each prompt's count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from kvguard.admission.admit import Admission, AdmissionSettings
from kvguard.admission.calibration import Calibration
from kvguard.admission.capacity import Capacities, PoolCapacity
from kvguard.admission.policy import Policy, PoolPolicy
from kvguard.config.schema import Config
from kvguard.ledger.memory import MemoryLedger
from kvguard.tokens.counting import PromptCounter
from kvguard.tokens.tokenizer import PoolTokenizer

MODEL = "m"


class GivenCount:
    """A counter that returns the prompt count it is handed: traces carry counts, not text."""

    def __init__(self) -> None:
        self.prompt_tokens = 0

    async def count(self, *_args: Any, **_kwargs: Any) -> list[int]:
        return [self.prompt_tokens]


def serve(
    config: Config,
    *,
    calibration: Calibration | None = None,
    clock: Callable[[], float] = lambda: 0.0,
) -> tuple[Admission, Policy, MemoryLedger, GivenCount]:
    """Serve's admission of `config`'s first pool (model MODEL) on a memory ledger: the
    admission, its policy, the ledger and the counter (set its `prompt_tokens` per request)."""
    pool = config.pools[0]
    assert pool.capacity.blocks is not None and pool.capacity.block_size is not None
    capacity = PoolCapacity(pool.capacity.blocks, pool.capacity.block_size)
    # The counter is given the counts, so no tokenizer is loaded.
    policy_pool = PoolPolicy(pool, cast(PoolTokenizer, None), capacity)
    policy = Policy(config.tenancy, config.shadow, {pool.name: policy_pool}, {MODEL: policy_pool})
    capacities = Capacities()
    capacities.set(pool.name, capacity)
    ledger = MemoryLedger(clock=lambda: 0.0)
    counter = GivenCount()
    settings_ = AdmissionSettings(max_body_bytes=1 << 20, lease_seconds=60.0)
    admission = Admission(
        ledger, cast(PromptCounter, counter), capacities, settings_, calibration, clock
    )
    return admission, policy, ledger, counter
