"""Per point of a validation: the fresh repeats' TTFT p50 and served rate, their spread, and the plan's prediction
and 90% band beside them (the numbers results/validation-v2/README.md quotes).
Usage: python scripts/repeat_spread.py results/validation-v2"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from servecap.traces.command import Parser, command
from servecap.traces.metrics import summary
from servecap.traces.records import read_run


@command("repeat_spread")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("validation", type=Path)
    out = p.parse_args(argv).validation
    plan = json.loads((out / "plan.json").read_text())
    for point in sorted(p.name for p in (out / "real").iterdir()):
        runs = sorted((out / "real" / point).glob("run-*"))
        s = [summary(read_run(r), None) for r in runs]
        t = np.array([x["ttft_p50"] for x in s])
        r = np.array([x["served_rate"] for x in s])
        pred, band = plan["predictions"][point], plan["intervals"]["bands"][point]["ttft_p50"]
        print(f"{point:32s} TTFT p50 ms: runs {np.round(t * 1e3, 1).tolist()} mean {t.mean() * 1e3:.1f}, "
              f"predicted {pred['ttft_p50'] * 1e3:.1f} ({(pred['ttft_p50'] - t.mean()) / t.mean():+.1%}), "
              f"spread (max-min)/mean {(t.max() - t.min()) / t.mean():.1%}, band [{band['lo'] * 1e3:.1f}, "
              f"{band['hi'] * 1e3:.1f}] width/spread {(band['hi'] - band['lo']) / (t.max() - t.min()):.2f} | "
              f"served {np.round(r, 2).tolist()} predicted {pred['served_rate']:.2f} "
              f"({(pred['served_rate'] - r.mean()) / r.mean():+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
