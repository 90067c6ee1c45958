"""Command line: `kvguard serve | check-config | ledger status | demo | simulate | sim-server`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvguard import __version__
from kvguard import config as configs
from kvguard.config.schema import LedgerSettings
from kvguard.ops import logs

log = logging.getLogger(__name__)


def _load(path: str) -> configs.Config | None:
    """The configuration at `path`, or None once every problem is printed, one a line."""
    try:
        return configs.load(path)
    except configs.ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return None


def _check_config(path: str) -> int:
    config = _load(path)
    if config is None:
        return 1
    from kvguard.admission import policy
    from kvguard.config.redact import redact

    try:
        built = policy.build(config)
    except (OSError, ValueError) as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 1
    for warning in policy.warnings(config):
        print(f"warning: {path}: {warning}", file=sys.stderr)
    print(f"{path}: ok")
    print(
        f"  ledger: {redact(config.ledger.url)} (lease {config.ledger.lease_seconds}s, "
        f"on_unavailable={config.ledger.on_unavailable}{_replicas(config.ledger)})"
    )
    tiers = ", ".join(
        f"{name} (cap {t.max_tokens_cap}, default {t.default_max_tokens}, {t.max_blocks} blocks)"
        for name, t in config.tenancy.tiers.items()
    )
    print(
        f"  tenancy: identity={config.tenancy.identity}, default tier "
        f"{config.tenancy.default_tier or '(none: unknown tenants get 401)'}"
    )
    print(f"  tiers: {tiers}")
    for pool in built.pools.values():
        cap = pool.static_capacity
        capacity = (
            f"{cap.blocks} blocks of {cap.block_size} tokens, "
            f"admits up to {cap.limit(pool.config.watermark)}"
            if cap
            else "discovered from "
            + (
                f"the pods of Service {pool.config.capacity.service}"
                if pool.config.capacity.service is not None
                else ", ".join(redact(url) for url in pool.config.capacity.endpoints or [])
            )
        )
        print(
            f"  pool {pool.name}: models {', '.join(pool.config.models)}; {capacity}; "
            f"watermark {pool.config.watermark}"
        )
    if config.shadow:
        print("  shadow mode: decisions are recorded, nothing is refused for capacity")
    return 0


def _replicas(ledger: LedgerSettings) -> str:
    """What `local` divides the pool by, as check-config states it."""
    if ledger.on_unavailable != "local" or ledger.url.startswith("memory://"):
        return ""
    sources = ["the processes alive in Redis"]
    if ledger.replica_service is not None:
        sources.append(f"the ready pods of Service {ledger.replica_service} x server.workers")
    if isinstance(ledger.replicas, int):
        sources.append(str(ledger.replicas))
    return "; local shares: pool / the largest of " + ", ".join(sources)


def _serve(path: str) -> int:
    config = _load(path)
    if config is None:
        return 1
    logs.configure(config.server.log_level)
    from kvguard.admission.policy import warnings

    for warning in warnings(config):
        log.warning("%s: %s", path, warning)
    if config.server.workers == 1:
        return _serve_worker(config, Path(path))
    from kvguard.ops.workers import supervise

    try:
        # The supervisor serves metrics_listen for the pod; each worker, loopback only.
        return supervise(
            config.server.workers,
            lambda _, report_fd: _serve_worker(config, Path(path), report_fd),
            config.server.metrics_listen,
        )
    except OSError as exc:  # metrics_listen taken
        print(f"error: {path}: server.metrics_listen: {exc}", file=sys.stderr)
        return 1


def _serve_worker(config: configs.Config, path: Path, report_fd: int | None = None) -> int:
    # Imported here, after any fork: gRPC, its threads and the tokenizers must start fresh.
    from kvguard.ops.grpc_io import io_on_polling_thread

    io_on_polling_thread()
    import uvloop

    from kvguard.app import serve

    try:
        uvloop.run(serve(config, path, report_fd))
    except (OSError, ValueError) as exc:  # a port taken, a tokenizer or ledger URL unusable
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 1
    return 0


def _ledger_status(path: str) -> int:
    """Per pool: capacity, reserved and free blocks, and each tenant's reserved blocks."""
    config = _load(path)
    if config is None:
        return 1
    if config.ledger.url.startswith("memory://"):
        return _ledger_status_via_admin(config)
    import asyncio

    from kvguard.admin.status import PoolSpec, read_status, render
    from kvguard.config.redact import redact
    from kvguard.ledger import LedgerUnavailable

    pools = [PoolSpec(p.name, p.capacity.blocks, p.watermark) for p in config.pools]
    try:
        statuses = asyncio.run(read_status(config.ledger.url, config.ledger.cluster, pools))
    except LedgerUnavailable as exc:
        print(f"error: {path}: ledger {redact(config.ledger.url)}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a URL the Redis client refuses (check-config lets most through)
        print(f"error: {path}: ledger.url: {exc}", file=sys.stderr)
        return 1
    print(render(config.ledger.url, config.ledger.cluster, statuses))
    return 0


def _ledger_status_via_admin(config: configs.Config) -> int:
    """`ledger status` for a memory:// ledger: it lives inside the running kvguard process, so
    that process's admin API (kvguard.v1.AdminService/GetUsage) answers."""
    import asyncio

    from kvguard.admin.service import read_usage
    from kvguard.admin.status import PoolSpec, PoolStatus, render

    host, _, port = config.server.grpc_listen.rpartition(":")
    address = f"{'127.0.0.1' if host in ('', '0.0.0.0', '[::]') else host}:{port}"
    try:
        pools = asyncio.run(read_usage(address))
    except OSError as exc:
        print(
            f"error: cannot read the admin API of the kvguard at {address} ({exc}); the memory "
            "ledger lives inside that process: it must run with server.admin: true",
            file=sys.stderr,
        )
        return 1
    watermarks = {p.name: p.watermark for p in config.pools}
    statuses = [
        PoolStatus(
            PoolSpec(p.pool, p.capacity_blocks or None, watermarks.get(p.pool, 0.0)),
            p.reserved_blocks,
            p.leases,
            dict(p.reserved_blocks_by_tenant),
            dict(p.reserved_blocks_by_pod),
        )
        for p in pools
    ]
    print(render(config.ledger.url, config.ledger.cluster, statuses))
    return 0


def _config_argument(command: argparse.ArgumentParser) -> None:
    command.add_argument("file", nargs="?", help="YAML configuration file (or --config FILE)")
    command.add_argument("--config", help="YAML configuration file")


def _config_path(command: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The one configuration file given, as --config FILE or as FILE."""
    if args.file is not None and args.config is not None:
        command.error("give the configuration file once: --config FILE or FILE, not both")
    path: str | None = args.config if args.file is None else args.file
    if path is None:
        command.error("the configuration file is required: --config FILE (or FILE)")
    return path


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a reader gone away can still be caught
    except BrokenPipeError:
        # The reader left (`| head`): say nothing more. Python flushes stdout again at exit,
        # so point it at devnull (the recipe of Python's signal module docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="kvguard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the ext_proc service")
    _config_argument(serve)
    check = commands.add_parser("check-config", help="validate a configuration file")
    _config_argument(check)
    demo = commands.add_parser(
        "demo", help="one burst on a simulated vLLM, unguarded and behind Envoy + kvguard"
    )
    demo.add_argument("--requests", type=int, default=16, help="requests per tenant")
    demo.add_argument(
        "--tokenizer",
        type=Path,
        default=Path(".cache", "models", "qwen"),
        metavar="DIR",
        help="Qwen2.5's tokenizer files (default: %(default)s, where `make demo` puts them)",
    )
    from kvguard.sim import standalone
    from kvguard.sim.simulate import add_arguments

    add_arguments(
        commands.add_parser("simulate", help="replay a trace under admission policies side by side")
    )
    standalone.add_arguments(
        commands.add_parser(
            "sim-server",
            help="the vLLM simulator as an OpenAI-compatible upstream, for trials by hand",
        )
    )
    ledger = commands.add_parser("ledger", help="inspect the admission ledger")
    ledger_commands = ledger.add_subparsers(dest="ledger_command", required=True)
    status = ledger_commands.add_parser(
        "status",
        help="capacity, reserved and free blocks per pool and tenant: a Redis ledger read "
        "directly, memory:// through the running kvguard's admin API (server.admin: true)",
        description="Capacity, reserved and free blocks per pool and tenant. A Redis ledger "
        "is read directly; a memory:// ledger lives in the running kvguard, whose admin API "
        "(server.admin: true, on server.grpc_listen) is asked.",
    )
    _config_argument(status)
    args = parser.parse_args(argv)
    logs.configure("info", json=False)  # `serve` switches to JSON at its configured level
    if args.command == "serve":
        return _serve(_config_path(serve, args))
    if args.command == "check-config":
        return _check_config(_config_path(check, args))
    if args.command == "ledger":
        return _ledger_status(_config_path(status, args))
    if args.command == "simulate":
        from kvguard.sim.simulate import run_from_args

        return run_from_args(args)
    if args.command == "sim-server":
        return standalone.run_from_args(args)
    from kvguard.sim.demo import run_demo

    return run_demo(requests_per_tenant=args.requests, tokenizer=args.tokenizer)


if __name__ == "__main__":
    sys.exit(main())
