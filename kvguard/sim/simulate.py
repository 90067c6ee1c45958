"""`kvguard simulate`: replay a trace under several admission policies side by side.

The simulated pool is the configuration's pools[0]: its static capacity (usable blocks and
block size; a discovered pool needs --blocks and --block-size), its watermark and
max_model_len, and the tenancy's tiers. The engine's scheduling settings and step costs are
options (defaults: vLLM's OpenAI-server defaults on GPUs under 70 GiB, max_num_seqs 256 and
max_num_batched_tokens 2048 (H100/H200: 1024 and 8192), and rough 7-8B step costs). Every
policy (policies.py) replays the same trace on the same engine model, at each rate scale
(sweep.py); report.py makes the tables. With --pods N the pool's blocks are N engines' caches,
each its own scheduler; --routing says how requests reach them: in turn (Envoy's round robin)
while the ledger counts the pool, or to the pod the ledger reserved them on (pick).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from kvguard import config as configs
from kvguard.admission.capacity import PoolCapacity
from kvguard.sim.model import sweep
from kvguard.sim.model.engine import EngineConfig, StepCost
from kvguard.sim.model.policies import POLICIES, by_names
from kvguard.sim.model.replay import Run
from kvguard.sim.model.report import DEFAULT_TTFT_SLO_S, PolicyStats, policy_table, tenant_table
from kvguard.sim.model.sweep import QUIET_RATE, QUIET_TENANT, ROUTINGS
from kvguard.sim.model.trace import Trace, TraceError, load

DEFAULT_COST = StepCost()


@dataclass(frozen=True)
class Options:
    trace: str
    config: str
    plot: str | None = None
    rate_scale: float = 1.0
    limit: int | None = None
    blocks: int | None = None
    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    cost: StepCost = DEFAULT_COST
    prefix_caching: bool = False  # trace prompts share nothing
    retries: int = 0  # times a request refused with a 429 comes back after retry-after
    policies: tuple[str, ...] = tuple(POLICIES)
    sweep: tuple[float, ...] = ()  # rate scales, in place of rate_scale
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    quiet_tenant: bool = False
    pods: int = 1  # the pool's blocks split over this many engines
    routings: tuple[str, ...] = ("round_robin",)  # how requests reach them (sweep.ROUTINGS)

    @property
    def scales(self) -> tuple[float, ...]:
        return self.sweep or (self.rate_scale,)


def pool_capacity(config: configs.Config, options: Options) -> PoolCapacity:
    capacity = config.pools[0].capacity
    blocks = options.blocks or capacity.blocks
    block_size = options.block_size or capacity.block_size
    if blocks is None or block_size is None:
        raise ValueError(
            f"pools[0] ({config.pools[0].name}) discovers its capacity: give --blocks and "
            "--block-size (vLLM's num_gpu_blocks - 1 and block_size)"
        )
    return PoolCapacity(blocks, block_size)


def per_pod(capacity: PoolCapacity, pods: int) -> PoolCapacity:
    """One pod's share of the pool's blocks (what is left over, less than a block a pod, is
    dropped: the pool is then what its pods' caches sum to)."""
    if capacity.blocks < pods:
        raise ValueError(f"{capacity.blocks} blocks cannot be split over {pods} pods")
    return PoolCapacity(capacity.blocks // pods, capacity.block_size)


def engine_config(config: configs.Config, capacity: PoolCapacity, options: Options) -> EngineConfig:
    # vLLM refuses to start when max_model_len does not fit the cache: do the same here.
    max_model_len = min(config.pools[0].max_model_len, capacity.blocks * capacity.block_size)
    return EngineConfig(
        num_gpu_blocks=capacity.blocks + 1,
        block_size=capacity.block_size,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=options.prefix_caching,
        cost=options.cost,
    )


async def measure(
    trace: Trace,
    config: configs.Config,
    capacity: PoolCapacity,
    engine: EngineConfig,
    options: Options,
) -> tuple[list[PolicyStats], list[Run]]:
    """Each of the options' policies at each of its rate scales (sweep.measure)."""
    return await sweep.measure(
        trace,
        config,
        capacity,
        engine,
        policies=by_names(",".join(options.policies)),
        scales=options.scales,
        retries=options.retries,
        slo_s=options.ttft_slo_s,
        quiet_tenant=options.quiet_tenant,
        pods=options.pods,
        routings=options.routings,
    )


def describe(trace: Trace, options: Options, capacity: PoolCapacity, config: configs.Config,
             engine: EngineConfig) -> str:  # fmt: skip
    """The replay's setting. `trace` is scaled when there is one rate scale, else as read."""
    pool = config.pools[0]
    cost = engine.cost
    rate = len(trace.requests) / max(trace.duration_s, 1e-9)
    if options.sweep:
        scaling = ", rate scales " + ", ".join(f"{s:g}" for s in options.sweep)
    else:
        scaling = f", rate scale {options.rate_scale:g}" if options.rate_scale != 1 else ""
    tiers = ", ".join(
        f"{name} (cap {t.max_tokens_cap}, default {t.default_max_tokens}, {t.max_blocks} blocks)"
        for name, t in config.tenancy.tiers.items()
    )
    limits = sum(1 for r in trace.requests if r.max_tokens is not None)
    lines = [
        f"trace {options.trace}: {trace.format}, {len(trace.requests)} requests from "
        f"{len(trace.tenants)} tenant(s) over {trace.duration_s:.0f} s ({rate:.2f} req/s"
        f"{scaling}); {limits} send max_tokens, the others the tier default",
        f"pool {pool.name}: {capacity.blocks} blocks of {capacity.block_size} tokens"
        + (
            f" on {options.pods} pods of {capacity.blocks // options.pods}, routed "
            + " and ".join(r.replace("_", " ") for r in options.routings)
            if options.pods > 1
            else ""
        )
        + f", watermark {pool.watermark} (kvguard admits up to "
        f"{capacity.limit(pool.watermark)} blocks), max_model_len {engine.max_model_len}",
        f"tiers: {tiers}",
        f"engine: max_num_seqs {engine.max_num_seqs}, max_num_batched_tokens "
        f"{engine.max_num_batched_tokens}, step {cost.base_s * 1e3:g} ms + "
        f"{cost.prefill_token_s * 1e3:g} ms/prefill token + "
        f"{cost.decode_seq_s * 1e3:g} ms/decoding sequence",
        "policies: " + "; ".join(f"{n} ({POLICIES[n].summary})" for n in options.policies),
    ]
    if options.quiet_tenant:
        tier = config.tenancy.tier_of(QUIET_TENANT) or "none: refused when gated"
        lines.append(
            f"quiet tenant {QUIET_TENANT!r} (tier {tier}): {QUIET_RATE:g} req/s of the trace's "
            "median prompt and output, its p99 TTFT beside the trace and alone"
        )
    return "\n".join(lines)


def _numbers(text: str, option: str) -> tuple[float, ...]:
    try:
        numbers = tuple(float(v) for v in text.split(","))
    except ValueError:
        numbers = ()
    if not numbers or not all(n > 0 for n in numbers):
        raise ValueError(f"{option} {text!r}: expected positive numbers separated by commas")
    return numbers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Options("", "")
    parser.add_argument("--trace", required=True, help="azure2023 / vtc_lmsys CSV, or CSV/JSONL "
                        "with arrival_s,[tenant,]prompt_tokens,output_tokens; any may add "
                        "max_tokens (empty or absent: the client sent none)")  # fmt: skip
    parser.add_argument("--config", required=True, help="kvguard YAML configuration")
    parser.add_argument(
        "--policies",
        default=",".join(defaults.policies),
        help=f"policies to replay side by side, of {', '.join(POLICIES)} (default: all)",
    )
    parser.add_argument("--plot", help="write a PNG of KV usage and admissions over time")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="compress arrivals by this factor (2: twice the rate)")  # fmt: skip
    parser.add_argument("--sweep", help="rate scales to run, e.g. 1,2,4,8 (in place of "
                        "--rate-scale): one table of every policy at each")  # fmt: skip
    parser.add_argument("--ttft-slo", type=float, default=defaults.ttft_slo_s,
                        help="goodput counts requests whose TTFT is within this, in seconds "
                        "(default %(default)g)")  # fmt: skip
    parser.add_argument("--quiet-tenant", action="store_true",
                        help=f"add a tenant {QUIET_TENANT!r} sending {QUIET_RATE:g} req/s and "
                        "report its p99 TTFT against it replayed alone")  # fmt: skip
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--pods", type=int, default=1, help="the pool's blocks split over N "
                        "engines (vLLM pods), each its own cache (default 1)")  # fmt: skip
    parser.add_argument("--routing", default="round_robin",
                        help="how requests reach the pods, one or both of round_robin (the "
                        "gateway balances) and pick (kvguard reserves on a pod and names it), "
                        "comma-separated: each gated policy runs once per routing (default "
                        "%(default)s)")  # fmt: skip
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        help="a request refused with a 429 comes back after retry-after (1 s), N times at most",
    )
    parser.add_argument("--blocks", type=int, help="usable KV blocks (default: pools[0])")
    parser.add_argument("--block-size", type=int, help="tokens per block (default: pools[0])")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.max_num_batched_tokens)  # fmt: skip
    parser.add_argument(
        "--step-cost",
        default=",".join(
            f"{v * 1e3:g}"
            for v in (
                defaults.cost.base_s,
                defaults.cost.prefill_token_s,
                defaults.cost.decode_seq_s,
            )
        ),
        help="engine step cost in ms: BASE,PER_PREFILL_TOKEN,PER_DECODING_SEQUENCE",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="simulate vLLM's prefix caching (trace prompts share nothing)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    try:
        base, prefill, decode = (float(v) / 1e3 for v in args.step_cost.split(","))
    except ValueError:
        print(
            f"error: --step-cost {args.step_cost!r}: expected three numbers (ms)", file=sys.stderr
        )
        return 2
    try:
        policies = tuple(p.name for p in by_names(args.policies))
        sweep = _numbers(args.sweep, "--sweep") if args.sweep else ()
        if args.ttft_slo <= 0:
            raise ValueError(f"--ttft-slo {args.ttft_slo:g}: expected seconds above 0")
        if args.pods < 1:
            raise ValueError(f"--pods {args.pods}: expected 1 or more")
        routings = tuple(r.strip() for r in args.routing.split(","))
        unknown = [r for r in routings if r not in ROUTINGS]
        if unknown or not routings or len(set(routings)) < len(routings):
            raise ValueError(f"--routing {args.routing}: expected one or both of "
                             f"{', '.join(ROUTINGS)}, each once")  # fmt: skip
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run(
        Options(
            trace=args.trace,
            config=args.config,
            plot=args.plot,
            rate_scale=args.rate_scale,
            limit=args.limit,
            blocks=args.blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cost=StepCost(base, prefill, decode),
            prefix_caching=args.prefix_caching,
            retries=args.retries,
            policies=policies,
            sweep=sweep,
            ttft_slo_s=args.ttft_slo,
            quiet_tenant=args.quiet_tenant,
            pods=args.pods,
            routings=routings,
        )
    )


def run(options: Options) -> int:
    try:
        config = configs.load(options.config)
        pod = per_pod(pool_capacity(config, options), options.pods)
        # The ledger's: what discovery would sum over the pods.
        capacity = PoolCapacity(pod.blocks * options.pods, pod.block_size)
        trace = load(options.trace, limit=options.limit)
        shown = trace if options.sweep else trace.scaled(options.rate_scale)
        engine = engine_config(config, pod, options)
        if options.quiet_tenant and QUIET_TENANT in trace.tenants:
            raise TraceError(f"{options.trace}: has a tenant {QUIET_TENANT!r} already, the "
                             "name --quiet-tenant gives its own")  # fmt: skip
    except configs.ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {options.config}: {exc}", file=sys.stderr)
        return 1
    print(describe(shown, options, capacity, config, engine) + "\n")
    rows, runs = asyncio.run(measure(trace, config, capacity, engine, options))
    if not options.sweep:
        tier_of = {t: config.tenancy.tier_of(t) or "" for t in shown.tenants}
        print(tenant_table(runs, tier_of, options.ttft_slo_s) + "\n")
    print(policy_table(rows, options.ttft_slo_s))
    if options.plot:
        try:
            from kvguard.sim.plot import plot
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'kvguard[plot]'", file=sys.stderr)
            return 1
        plot(Path(options.plot), runs, capacity, config.pools[0].watermark)
        print(f"\nplot: {options.plot}")
    return 0
