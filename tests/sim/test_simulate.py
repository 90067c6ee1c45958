"""`kvguard simulate` as users run it, on slices of the real traces."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

TRACES = Path(__file__).parents[1] / "data" / "traces"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_config(folder: Path, capacity: dict[str, object]) -> Path:
    config = {
        "tenancy": {
            "default_tier": "free",
            "tiers": {
                "free": {"max_tokens_cap": 256, "default_max_tokens": 64, "max_blocks": 60},
                "pro": {"max_tokens_cap": 1024, "default_max_tokens": 256, "max_blocks": 200},
            },
            "tenants": {"dummy-lora-7b-rank-8-0": "pro"},
        },
        "pools": [
            {
                "name": "qwen",
                "models": ["qwen"],
                "tokenizer": "/models/qwen",  # not read: traces carry token counts
                "max_model_len": 4096,
                "watermark": 0.15,
                "capacity": capacity,
                # The replayed clients never retry: a promise would only hold blocks.
                "retry_after_max_seconds": 0,
            }
        ],
    }
    path = folder / "kvguard.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


async def simulate(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvguard", "simulate", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_vtc_slice_under_overload_with_a_plot(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"blocks": 300, "block_size": 16})
    png = tmp_path / "kv.png"
    code, out, err = await simulate(
        "--trace", str(TRACES / "vtc_lmsys_head80.csv"), "--config", str(config),
        "--rate-scale", "6", "--plot", str(png),
    )  # fmt: skip
    assert code == 0, err
    assert "vtc_lmsys, 80 requests from 14 tenant(s) over 4 s (18.74 req/s" in out
    assert "rate scale 6" in out
    assert "pool qwen: 300 blocks of 16 tokens, watermark 0.15 (kvguard admits up to 255" in out
    row = next(line for line in out.splitlines() if line.startswith("dummy-lora-7b-rank-8-0 "))
    assert row.split()[1:3] == ["pro", "35"]
    # scale, policy, served/requests, refused, preemptions, goodput, ..., Jain
    rows = {m[0]: m for m in re.findall(
        r"^x6 +(\w+) +(\d+)/80 +([\d.]+)% +(\d+) +([\d.]+) .* (0\.\d{3}|1\.000)$", out, re.M
    )}  # fmt: skip
    assert list(rows) == ["vllm", "worst_case", "calibrated", "oracle"], out
    assert int(rows["vllm"][3]) > 0 and rows["vllm"][1] == "80"
    assert int(rows["worst_case"][3]) == int(rows["oracle"][3]) == 0
    assert int(rows["worst_case"][1]) <= int(rows["oracle"][1])  # it reserves more
    # 80 requests teach too little (min_samples 50, read at 10 s scrapes): worst case still.
    assert rows["calibrated"][1:4] == rows["worst_case"][1:4]
    assert "x6: worst_case serves " in out
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000
    assert f"plot: {png}" in out


async def test_azure_slice_is_one_tenant(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"blocks": 2000, "block_size": 16})
    code, out, err = await simulate(
        "--trace", str(TRACES / "azure2023_conv_head40.csv"), "--config", str(config),
        "--limit", "20",
    )  # fmt: skip
    assert code == 0, err
    assert "azure2023, 20 requests from 1 tenant(s)" in out
    rows = [line for line in out.splitlines() if line.startswith("default ")]
    assert len(rows) == 1 and rows[0].split()[1:3] == ["free", "20"]


async def test_errors_name_the_file_and_what_to_do(tmp_path: Path) -> None:
    discovered = write_config(tmp_path, {"endpoints": ["http://127.0.0.1:9"]})
    code, _, err = await simulate(
        "--trace", str(TRACES / "azure2023_conv_head40.csv"), "--config", str(discovered)
    )
    assert code == 1
    assert err.strip() == (
        f"error: {discovered}: pools[0] (qwen) discovers its capacity: give --blocks and "
        "--block-size (vLLM's num_gpu_blocks - 1 and block_size)"
    )
    bad = tmp_path / "bad.csv"
    bad.write_text("when,what\n1,2\n")
    code, _, err = await simulate("--trace", str(bad), "--config", str(discovered),
                                  "--blocks", "100", "--block-size", "16")  # fmt: skip
    assert code == 1 and err.startswith(f"error: {bad}: unknown columns ['what', 'when']")


async def test_a_bad_trace_row_is_one_error_line_naming_the_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"blocks": 300, "block_size": 16})
    cases = {
        "backwards.csv": (
            "arrival_s,prompt_tokens,output_tokens\n0,10,5\n2,10,5\n1,10,5\n",
            "line 4: arrival_s 1 is before the previous row's 2: rows must be in order of arrival",
        ),
        "negative.jsonl": (
            '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": -5}\n',
            "line 1: output_tokens is -5: token counts cannot be negative",
        ),
        "timezones.csv": (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,5\n"
            "2023-11-16 18:15:50Z,10,5\n",
            "line 3: TIMESTAMP 2023-11-16 18:15:50Z has a timezone and the first row's "
            "2023-11-16 18:15:46 has none: give every time a timezone, or none",
        ),
    }
    for name, (text, problem) in cases.items():
        trace = tmp_path / name
        trace.write_text(text)
        code, out, err = await simulate("--trace", str(trace), "--config", str(config))
        assert (code, out, err) == (1, "", f"error: {trace}: {problem}\n")
