"""Full-length shapes (issue #25): the engine at prompts and decode contexts up to the model's 32768 positions, and
the cost table's accuracy there, where it was never measured (its fit extrapolated).

  python scripts/long_shapes.py run OUT_DIR        # on the GPU: closed runs of long requests, one record each
  python scripts/long_shapes.py report OUT_DIR --table TABLE   # anywhere: each step's real time over the model's
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from servecap.traces.command import Parser, command

RUNS = {  # name: [(prompt, budget), ...], all arriving at t=0
    "p8192": [(8192, 64)], "p16384": [(16384, 64)], "p32000": [(32000, 256)],
    "2x-p8192": [(8192, 128)] * 2, "4x-p4096-b512": [(4096, 512)] * 4,
}


def run(out: Path) -> None:
    from servecap.core.config import ServingConfig
    from servecap.engine.engine import Engine, EngineConfig
    from servecap.traces.workload import length_trace

    engine = Engine(EngineConfig(ServingConfig(max_batch=4), max_prompt=32256, max_budget=512, backends=("paged",)))
    for name, reqs in RUNS.items():
        trace = length_trace([(0.0, p, b) for p, b in reqs])
        engine.run(trace, None, progress=False, telemetry=False)  # warm-up: the shapes' first run
        engine.run(trace, out / name, progress=False, extra_meta={"long_shapes": name})
        print(name, "done", flush=True)


def report(out: Path, table: Path | None) -> None:
    import numpy as np

    from servecap.costs.model import CostModel
    from servecap.costs.shapes import PrefillShape
    from servecap.sim import inputs
    from servecap.traces.records import read_run

    cost = CostModel(inputs.load_table(table))
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in RUNS:
            rec = read_run(out / name)
            s = rec.steps
            for r in s[s.kind == "prefill"].itertuples():
                per = r.tokens // r.rows
                model = cost.prefill(PrefillShape.padded(r.rows, per))
                rows.append(("prefill", name, f"{r.rows} x {per}", (r.end - r.start) / model))
            d = s[s.kind == "decode"]
            ratio = (d.end - d.start).to_numpy() / np.array([cost.decode("paged", x.rows, x.kv_tokens, x.kv_max)
                                                           for x in d.itertuples()])
            rows.append(("decode", name, f"{int(d.rows.max())} rows to {int(d.kv_max.max())} K/V",
                         float(np.median(ratio))))
    print(f"table {cost.table.table_id} (measured to {cost.table.max_tokens} tokens); real / model at long shapes:")
    for kind, name, shape, r in rows:
        print(f"  {kind:8s} {name:14s} {shape:24s} {r:.3f}")
    doc = {"table_id": cost.table.table_id, "rows": [dict(zip(("kind", "run", "shape", "real_over_model"), x))
                                                     for x in rows]}
    (out / "long_shapes.json").write_text(json.dumps(doc, indent=1) + "\n")


@command("long_shapes")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("run", "report"))
    p.add_argument("out", type=Path)
    p.add_argument("--table", type=Path)
    a = p.parse_args(argv)
    run(a.out) if a.mode == "run" else report(a.out, a.table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
