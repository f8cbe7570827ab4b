"""Fused (mixed:N) steps of this tree's engine against another checkout's, measured side by side on one GPU: a closed
mixed run of 32 requests per policy, each tree in turn, alternating, each on a freshly started engine after one
warm-up pass. Prints every run's wall time and fused steps' summed time and, per policy, the ratios of the medians
(this tree / the other).

  PYTHONPATH=. python scripts/bench_mixed_side_by_side.py OTHER_TREE --out DIR [--rounds R] [--policies P1,P2]
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from servecap.traces.command import Parser, command
from servecap.traces.records import read_run

HERE = Path(__file__).resolve().parents[1]


def measure(tree: Path, policy: str, out: Path) -> tuple[float, float, int]:
    """(wall seconds, fused steps' seconds, fused steps) of one closed run on a fresh engine of `tree`."""
    path = [str(tree), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-m", "servecap.engine", "run", "--closed-mixed", "32", "--prefill", policy,
           "--warmup", "1", "--no-tokens", "--out", str(out)]
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    rec = read_run(out)
    s = rec.steps
    fused = s[s.kind == "mixed"]
    wall = float(rec.requests.finished.max() - rec.requests.arrival.min())
    return wall, float((fused.end - fused.start).sum()), len(fused)


@command("bench_mixed_side_by_side")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("other", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", default="mixed:512,mixed:2048")
    args = p.parse_args(argv)
    trees = {"this": HERE, "other": args.other.resolve()}
    got: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for r in range(args.rounds):
        for policy in args.policies.split(","):
            for name, tree in trees.items():
                m = measure(tree, policy, args.out / f"{name}-{policy.replace(':', '')}-{r}")
                got.setdefault((name, policy), []).append(m)
                print(f"round {r} {policy:11s} {name:5s} wall {m[0] * 1e3:8.1f} ms  fused steps {m[2]:4d} "
                      f"{m[1] * 1e3:8.1f} ms", flush=True)
    for policy in args.policies.split(","):
        this, other = got["this", policy], got["other", policy]
        wall = statistics.median(x[0] for x in this) / statistics.median(x[0] for x in other)
        fused = statistics.median(x[1] / x[2] for x in this) / statistics.median(x[1] / x[2] for x in other)
        print(f"{policy}: wall this/other {wall:.3f}; mean fused step this/other {fused:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
