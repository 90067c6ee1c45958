"""`kvguard sim-server`: the vLLM simulator as an OpenAI-compatible upstream, for trials by hand.

It serves until SIGTERM or SIGINT: POST /v1/chat/completions and /v1/completions, GET /metrics
(with `vllm:cache_config_info`, so kvguard can discover its capacity), /health and /v1/models.
Prompt tokens come from kvguard's `x-kvguard-prompt-tokens` when it is in front, else an
approximation (see prompts.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import signal
import sys

from kvguard.sim.model.engine import EngineConfig

DEFAULT_MAX_MODEL_LEN = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        help="host:port to serve on (port 0: a free one; default %(default)s)",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=512,
        help="KV-cache blocks, as vLLM's --num-gpu-blocks-override (its null block included: "
        "kvguard discovers one fewer as usable; default %(default)s)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help="sequences running at once (default %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="tokens per engine step (default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help=f"context length (default {DEFAULT_MAX_MODEL_LEN}, or what the "
        "blocks hold when that is less)",
    )
    parser.add_argument(
        "--model", default="qwen", help="model name in /metrics and /v1/models; any model is served"
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="simulated seconds per real second (default %(default)s)",
    )


def _listen(address: str) -> tuple[str, int]:
    match = re.fullmatch(r"\[?([^\[\]]*?)\]?:([0-9]{1,5})", address)
    if not match or int(match.group(2)) > 65535:
        raise ValueError(f"--listen {address!r}: expected host:port, the port from 0 to 65535")
    return match.group(1), int(match.group(2))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine the options describe; ValueError names the option that is wrong."""
    for option, least in (("blocks", 2), ("block_size", 1), ("max_num_seqs", 1),
                          ("max_num_batched_tokens", 1)):  # fmt: skip
        if getattr(args, option) < least:
            raise ValueError(f"--{option.replace('_', '-')} must be at least {least}")
    held = (args.blocks - 1) * args.block_size  # one full-length sequence must fit, as in vLLM
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, held)
    elif not 2 <= max_model_len <= held:
        raise ValueError(
            f"--max-model-len must be from 2 to {held}, what {args.blocks} blocks of "
            f"{args.block_size} tokens hold (one of them vLLM's null block)"
        )
    return EngineConfig(
        num_gpu_blocks=args.blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
    )


def options(args: argparse.Namespace) -> tuple[str, int, EngineConfig]:
    """The host, port and engine the options describe; ValueError names the option that is
    wrong."""
    host, port = _listen(args.listen)
    if not (args.speed > 0 and math.isfinite(args.speed)):
        raise ValueError("--speed must be a number above 0")
    return host, port, engine_config(args)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        host, port, config = options(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(_serve(config, args.listen, host, port, args.model, args.speed))


async def _serve(
    config: EngineConfig, listen: str, host: str, port: int, model: str, speed: float
) -> int:
    from kvguard.sim.server import SimServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = SimServer(config, model=model, speed=speed)
    try:
        await server.start(port, host)
    except OSError as exc:
        print(f"error: cannot listen on {listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        print(
            f"vLLM simulator on {server.url}: {config.num_gpu_blocks} KV blocks of "
            f"{config.block_size} tokens ({config.usable_blocks} usable), max_num_seqs "
            f"{config.max_num_seqs}, max_model_len {config.max_model_len}, model {model}",
            flush=True,
        )
        await stop.wait()
    finally:
        await server.stop()
    return 0
