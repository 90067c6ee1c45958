"""The engine model's invariants, checked after every step of seeded random workloads."""

from __future__ import annotations

import math
import random

import pytest

from kvguard.sim.model.blocks import BlockPool
from kvguard.sim.model.engine import Engine, EngineConfig, Sequence, Status, StepCost

COST = StepCost(base_s=0.01, prefill_token_s=0.0, decode_seq_s=0.0)


def _need_before_step(engine: Engine) -> tuple[int, int]:
    """(blocks the running sequences' next tokens need, in order within the token budget,
    blocks free): the scheduler must preempt exactly when the first exceeds the second."""
    budget = engine.config.max_num_batched_tokens
    need = 0
    for seq in engine.running:
        if budget <= 0:
            break
        new = min(seq.num_tokens - seq.computed, budget)
        need += max(0, math.ceil((seq.computed + new) / engine.config.block_size) - len(seq.blocks))
        budget -= new
        if need > engine.pool.free:
            break
    return need, engine.pool.free


def _check(engine: Engine) -> None:
    config, pool = engine.config, engine.pool
    refs: dict[int, int] = {}
    for seq in engine.running:
        assert seq.status is Status.RUNNING
        assert len(seq.blocks) == math.ceil(seq.computed / config.block_size)
        for block in seq.blocks:
            refs[id(block)] = refs.get(id(block), 0) + 1
    assert len(refs) == pool.used <= pool.usable  # blocks never exceed the pool
    for seq in engine.running:
        for block in seq.blocks:
            assert block.refs == refs[id(block)]
    assert len(engine.running) <= config.max_num_seqs
    for seq in engine.waiting:
        assert seq.blocks == [] and seq.computed == 0
    # Preempted sequences sit ahead of every never-run one; the never-run ones stay FCFS.
    kinds = [seq.status is Status.PREEMPTED for seq in engine.waiting]
    assert kinds == sorted(kinds, reverse=True)
    fresh = [int(s.uid) for s in engine.waiting if s.status is Status.WAITING]
    assert fresh == sorted(fresh)


def _run(engine: Engine, arrivals: list[tuple[float, Sequence]]) -> list[Sequence]:
    pending, now, done = list(arrivals), 0.0, []
    first_run: list[int] = []
    while pending or not engine.idle:
        if engine.idle:
            now = max(now, pending[0][0])
        while pending and pending[0][0] <= now:
            engine.add(pending.pop(0)[1])
        need, free = _need_before_step(engine)
        newest = engine.running[-1] if engine.running else None
        front = list(engine.waiting)
        result = engine.step(now)
        assert result is not None
        if result.preempted:
            assert need > free, "preempted although the running sequences fit"
            assert result.preempted[0] is newest, "the victim must be the newest running"
            assert not any(s.status is Status.RUNNING for s in front), (
                "a step that preempts admits no waiting sequence"
            )
        else:
            assert need <= free, "the running sequences needed more blocks than were free"
        admitted = [s for s in front if s.status is Status.RUNNING or s in result.finished]
        assert admitted == front[: len(admitted)], "admission skipped ahead in the queue"
        first_run += [int(s.uid) for s in admitted if int(s.uid) not in first_run]
        _check(engine)
        now = result.end
        done += result.finished
    assert first_run == sorted(first_run), "first come, first served"
    return done


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    blocks, block_size = rng.choice([9, 17, 33]), rng.choice([4, 8, 16])
    config = EngineConfig(
        num_gpu_blocks=blocks,
        block_size=block_size,
        max_num_seqs=rng.choice([2, 4, 64]),
        max_num_batched_tokens=rng.choice([16, 64, 512]),
        max_model_len=(blocks - 1) * block_size,
        enable_prefix_caching=seed % 2 == 0,
        cost=COST,
    )
    engine = Engine(config)
    usable_tokens = config.usable_blocks * config.block_size
    shared = tuple(range(100 + seed, 105 + seed))  # some prompts share their first blocks
    arrivals = []
    for i in range(40):
        prompt = rng.randint(1, usable_tokens // 3)
        keys = shared if rng.random() < 0.3 else ()
        seq = Sequence(
            str(i),
            prompt,
            rng.randint(1, usable_tokens // 2),
            tenant=rng.choice("ab"),
            prompt_keys=keys,
            stop_after=rng.choice([None, rng.randint(1, 30)]),
        )
        arrivals.append((rng.random() * 2, seq))
    arrivals.sort(key=lambda a: a[0])
    for index, (_, seq) in enumerate(arrivals):
        seq.uid = str(index)  # uid order = arrival order, for the FCFS checks
    done = _run(engine, arrivals)
    assert sorted(int(s.uid) for s in done) == list(range(40))
    for seq in done:
        assert seq.status is Status.FINISHED
        assert seq.output_tokens == seq.target  # every request completes with its full output
        assert seq.finish_reason == ("length" if seq.target == seq.max_tokens else "stop")
    assert engine.pool.used == 0
    assert engine.preemptions_total == sum(s.preemptions for s in done)


def test_preemption_frees_the_newest_and_it_resumes_first() -> None:
    # 4 usable blocks of 4 tokens; two sequences of 4 prompt tokens that want 8 output tokens.
    engine = Engine(
        EngineConfig(num_gpu_blocks=5, block_size=4, max_model_len=16, enable_prefix_caching=False)
    )
    old = Sequence("0", 4, 8)
    new = Sequence("1", 4, 8)
    late = Sequence("2", 1, 1)
    engine.add(old)
    engine.add(new)
    now, preempted_at = 0.0, None
    while preempted_at is None:
        result = engine.step(now)
        assert result is not None
        now = result.end
        if result.preempted:
            preempted_at = now
            assert result.preempted == [new]
    assert new.status is Status.PREEMPTED and new.blocks == [] and new.computed == 0
    assert new.output_tokens > 0  # kept: the recompute covers prompt + output so far
    engine.add(late)
    assert list(engine.waiting) == [new, late]  # the preempted one resumes first
    while not engine.idle:
        result = engine.step(now)
        assert result is not None
        now = result.end
    assert new.finished_at is not None and late.finished_at is not None
    assert old.output_tokens == new.output_tokens == 8
    assert engine.preemptions_total >= 1


def test_prefix_caching_spares_a_resumed_requests_own_blocks() -> None:
    engine = Engine(
        EngineConfig(num_gpu_blocks=9, block_size=4, max_num_batched_tokens=64, max_model_len=32)
    )
    seq = Sequence("0", 12, 20)
    engine.add(seq)
    engine.step(0.0)
    assert engine.pool.free == 8 - 3 and seq.computed == 12 and seq.output_tokens == 1
    engine.running.remove(seq)
    engine._preempt(seq)  # as the scheduler would
    assert engine.pool.free == 8  # freed, but its 3 full blocks stay cached
    result = engine.step(1.0)
    assert result is not None and result.scheduled == {"0": 1}  # only the sampled token
    assert seq.status is Status.RUNNING and seq.computed == 13 and len(seq.blocks) == 4
    assert engine.prompt_tokens_total == 12  # counted once


def test_siblings_share_full_prompt_blocks() -> None:
    engine = Engine(EngineConfig(num_gpu_blocks=33, block_size=4, max_model_len=128))
    keys = (1, 2, 3)
    a = Sequence("a", 12, 4, prompt_keys=keys)
    b = Sequence("b", 12, 4, prompt_keys=keys)
    engine.add(a)
    engine.add(b)
    engine.step(0.0)
    shared = [x for x in a.blocks if x in b.blocks]
    assert len(shared) == 2  # a hit leaves the last block to compute: 2 of the 3 are shared
    assert engine.pool.used == len(a.blocks) + len(b.blocks) - 2


def test_block_pool_evicts_least_recently_freed_cached_blocks() -> None:
    pool = BlockPool(3, caching=True)
    first, second = pool.allocate(1), pool.allocate(1)
    pool.cache(first[0], "x")
    pool.cache(second[0], "y")
    pool.release(first)
    pool.release(second)
    assert pool.free == 3 and pool.lookup(["x"]) == first
    pool.allocate(2)  # the anonymous block first, then the oldest cached one ("x")
    assert pool.lookup(["x"]) == [] and pool.lookup(["y"]) == second


@pytest.mark.parametrize("reserve_full_input", [True, False])
def test_admission_waits_until_the_whole_input_fits(reserve_full_input: bool) -> None:
    engine = Engine(
        EngineConfig(
            num_gpu_blocks=9,
            block_size=4,
            max_num_batched_tokens=6,
            max_model_len=32,
            enable_prefix_caching=False,
            reserve_full_input=reserve_full_input,
        )
    )
    first = Sequence("0", 20, 10)  # 5 of the 8 blocks once prefilled, 6 at its next decode
    second = Sequence("1", 16, 2)  # 4 blocks for its input; its first chunk (5 tokens) 2
    engine.add(first)
    now = 0.0
    while first.computed < 20:
        result = engine.step(now)
        assert result is not None
        now = result.end
    engine.add(second)
    engine.step(now)
    assert engine.pool.free == (2 if reserve_full_input else 0)
    assert second.status is (Status.WAITING if reserve_full_input else Status.RUNNING)


def test_watermark_and_budget_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        EngineConfig(num_gpu_blocks=1)
    with pytest.raises(ValueError, match="does not fit"):
        EngineConfig(num_gpu_blocks=5, block_size=4, max_model_len=17)
    engine = Engine(EngineConfig(num_gpu_blocks=5, block_size=4, max_model_len=8))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(Sequence("0", 5, 4))
