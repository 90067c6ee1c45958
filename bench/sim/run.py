"""The simulator's published figures (docs/simulator.md): every admission policy replayed on
vtc_lmsys and a slice of azure2023 conv, at rate scales 1, 2, 4 and 8, with a quiet tenant.

Clients send no max_tokens (the traces carry none), so kvguard injects the tier default of 1024
(bench/sim/*.yaml); answers stop at the trace's output length. Prints each trace's setting and
table, and writes them to bench-results/sim_policies.txt and, as numbers, .json. Figures, not a
test: `make bench-sim` (a few minutes on two cores).

    .venv/bin/python bench/sim/run.py [--traces DIR]

DIR holds the shared traces (azure2023/, vtc_lmsys/; see their README): by default shared/traces
in the repository or beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvguard import config as configs  # noqa: E402
from kvguard.sim.model.report import policy_table  # noqa: E402
from kvguard.sim.model.trace import load  # noqa: E402
from kvguard.sim.simulate import (  # noqa: E402
    Options,
    describe,
    engine_config,
    measure,
    pool_capacity,
)

HERE = Path(__file__).resolve().parent
RESULTS = ROOT / "bench-results"
SCALES = (1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class Figure:
    name: str
    trace: str  # under the traces folder
    config: str  # beside this file
    limit: int | None = None  # the first N requests: a slice that keeps the run short


FIGURES = [
    Figure("vtc_lmsys", "vtc_lmsys/real_trace.csv", "vtc_lmsys.yaml"),
    # The first 6,000 requests: about 20 minutes of the hour.
    Figure("azure2023", "azure2023/AzureLLMInferenceTrace_conv.csv", "azure2023.yaml", 6000),
]


def traces_folder(given: str | None) -> Path:
    candidates = [Path(given)] if given else [ROOT / "shared" / "traces",
                                              ROOT.parent / "shared" / "traces"]  # fmt: skip
    for folder in candidates:
        if (folder / "vtc_lmsys").is_dir() and (folder / "azure2023").is_dir():
            return folder
    raise SystemExit(f"error: no shared traces in {', '.join(map(str, candidates))}: "
                     "give --traces DIR")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="the folder of the shared traces")
    folder = traces_folder(parser.parse_args().traces)
    texts: list[str] = []
    numbers: dict[str, object] = {}
    for figure in FIGURES:
        options = Options(str(folder / figure.trace), str(HERE / figure.config),
                          limit=figure.limit, sweep=SCALES, quiet_tenant=True)  # fmt: skip
        config = configs.load(options.config)
        capacity = pool_capacity(config, options)
        trace = load(options.trace, limit=options.limit)
        engine = engine_config(config, capacity, options)
        rows, _ = asyncio.run(measure(trace, config, capacity, engine, options))
        setting = describe(trace, options, capacity, config, engine).replace(str(folder), "…")
        text = f"## {figure.name}\n\n{setting}\n\n{policy_table(rows, options.ttft_slo_s)}\n"
        print(text, flush=True)
        texts.append(text)
        numbers[figure.name] = {
            "trace": figure.trace,
            "config": f"bench/sim/{figure.config}",
            "limit": figure.limit,
            "blocks": capacity.blocks,
            "block_size": capacity.block_size,
            "ttft_slo_s": options.ttft_slo_s,
            "rows": [asdict(row) for row in rows],
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_policies.txt").write_text("\n".join(texts))
    (RESULTS / "sim_policies.json").write_text(json.dumps(numbers, indent=2) + "\n")
    print(f"written: {RESULTS / 'sim_policies.txt'}, {RESULTS / 'sim_policies.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
