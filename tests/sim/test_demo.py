"""`kvguard demo` end to end, as a user runs it: a real Envoy, kvguard, and the simulator."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

pytestmark = pytest.mark.integration


async def test_a_small_demo_shows_preemptions_unguarded_and_none_guarded() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvguard", "demo", "--requests", "8",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out_bytes, err_bytes = await asyncio.wait_for(process.communicate(), timeout=120)
    out, err = out_bytes.decode(), err_bytes.decode()
    assert process.returncode == 0, out + err
    assert "unguarded  [##############################] 16/16 answered" in out
    assert "kvguard    [##############################] 16/16 answered" in out
    assert "capacity from http://127.0.0.1:" in out and "512 blocks of 16 tokens" in out
    found = re.search(r"num_preemptions_total\): (\d+) unguarded, (\d+) guarded", out)
    assert found, out
    assert int(found.group(1)) > 0 and int(found.group(2)) == 0
    acme = next(line for line in out.splitlines() if re.match(r"acme +pro +8 ", line))
    hobbyist = next(line for line in out.splitlines() if re.match(r"hobbyist +free +8 ", line))
    # Guarded, acme's 1200-token asks are clamped to the pro cap (512: 51 blocks each), and
    # its quota (320 blocks) holds 6 of them: the other 2 wait in the queue, or retry once when
    # their 429 says when; all are served, none preempted.
    guarded = re.compile(
        r"(?P<p50>[\d.]+) / (?P<p99>[\d.]+) s +(?P<served>\d+) +(?P<retried>\d+) +"
        r"(?P<clamped>\d+)  (?P<refused>.+)$"
    )
    mine, theirs = guarded.search(acme), guarded.search(hobbyist)
    assert mine and theirs, (acme, hobbyist)
    assert (mine["served"], mine["clamped"], mine["refused"]) == ("8", "8", "-"), acme
    assert int(mine["retried"]) <= 2, acme
    assert (theirs["served"], theirs["retried"], theirs["refused"]) == ("8", "0", "-"), hobbyist
    # The hobbyist, holding fewer blocks, is served first: its slowest before acme's median.
    assert float(theirs["p99"]) < float(mine["p50"]), (acme, hobbyist)
    peak = re.search(
        r"ledger peak: (\d+) of 512 blocks reserved \(limit 435\); after the burst: 0", out
    )
    assert peak, out
    assert 0 < int(peak.group(1)) <= 435
