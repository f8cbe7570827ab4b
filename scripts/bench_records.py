"""Run-record formats side by side on one large simulated run: file size, write time and read time.

    PYTHONPATH=. python scripts/bench_records.py --n 1000000

Simulates N requests (seeded Poisson at --rate, paged decode, 32 rows, the shipped H200 table), keeping what
`sim run --out` writes (requests, steps, rejected), then writes and reads that one record in each format, in one
process, one after another:
  csv       the record as RunWriter writes it (plain CSV, row by row, meta.json beside it); read by read_run and
            by pandas.read_csv alone
  csv.gz    the same CSV gzipped after the run (how committed records keep their large tables); read by read_run
  parquet   each table by DataFrame.to_parquet (pyarrow, snappy); read by pandas.read_parquet (skipped when
            pyarrow is not installed: it is no dependency of the project)
Each number is the best of --repeats runs. Reads are checked to give back the frames that were written.
"""
from __future__ import annotations

import gzip
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd

from servecap.core.config import ServingConfig
from servecap.costs.model import CostModel
from servecap.sim.inputs import load_table
from servecap.sim.simulator import SimConfig, simulate
from servecap.traces.command import Parser, command
from servecap.traces.records import RunWriter, read_run
from servecap.traces.workload import poisson_trace

TABLES = ("requests", "steps", "rejected")


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def _write_csv(rec, d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    w = RunWriter(d, rec.meta, TABLES)
    for t in TABLES:
        w.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    w.close()


def _gzip(src: Path, d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    for t in TABLES:
        p = d / f"{t}.csv"
        p.with_name(f"{t}.csv.gz").write_bytes(gzip.compress(p.read_bytes(), compresslevel=6))
        p.unlink()


def _write_parquet(rec, d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    for t in TABLES:
        getattr(rec, t).to_parquet(d / f"{t}.parquet", index=False)


@command("bench_records")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="requests (default %(default)s)")
    p.add_argument("--rate", type=float, default=30.0, help="arrival rate, req/s (default %(default)s: stable)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each write and read; the best is kept")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    rec = simulate(poisson_trace(args.rate, args.n, 0), CostModel(load_table(None)),
                   SimConfig(ServingConfig(max_batch=32), detail="steps")).record
    rows = {t: len(getattr(rec, t)) for t in TABLES}
    print(f"simulated {args.n:,} requests in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{t} {n:,} rows" for t, n in rows.items()))
    try:
        import pyarrow  # noqa: F401
        parquet = True
    except ModuleNotFoundError:
        parquet = False
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        csv_dir, gz_dir, pq_dir = tmp / "csv", tmp / "gz", tmp / "parquet"
        write_s, _ = _best(lambda: _write_csv(rec, csv_dir), args.repeats)
        read_s, back = _best(lambda: read_run(csv_dir), args.repeats)
        assert all(getattr(back, t).equals(getattr(rec, t)) for t in TABLES), "csv did not read back as written"
        pandas_s, frames = _best(lambda: {t: pd.read_csv(csv_dir / f"{t}.csv") for t in TABLES}, args.repeats)
        assert frames["steps"].columns.tolist() == rec.steps.columns.tolist()
        results.append(("csv (RunWriter / read_run)", _size(csv_dir), write_s, read_s))
        results.append(("csv (pandas.read_csv alone)", _size(csv_dir), float("nan"), pandas_s))
        gz_s, _ = _best(lambda: _gzip(csv_dir, gz_dir), args.repeats)
        read_gz_s, back = _best(lambda: read_run(gz_dir), args.repeats)
        assert back.steps.equals(rec.steps), "csv.gz did not read back as written"
        results.append(("csv.gz (gzip -6 after the run)", _size(gz_dir), write_s + gz_s, read_gz_s))
        if parquet:
            pq_write_s, _ = _best(lambda: _write_parquet(rec, pq_dir), args.repeats)
            pq_read_s, frames = _best(lambda: {t: pd.read_parquet(pq_dir / f"{t}.parquet") for t in TABLES},
                                      args.repeats)
            assert frames["steps"].equals(rec.steps), "parquet did not read back as written"
            results.append((f"parquet (pyarrow {pyarrow.__version__}, snappy)", _size(pq_dir), pq_write_s,
                            pq_read_s))
    base = results[0]
    print(f"\n{'format':<36}{'size MB':>9}{'x csv':>7}{'write s':>9}{'x csv':>7}{'read s':>8}{'x csv':>7}")
    for name, size, w, r in results:
        print(f"{name:<36}{size / 1e6:>9.1f}{size / base[1]:>7.2f}{w:>9.2f}{w / base[2]:>7.2f}{r:>8.2f}"
              f"{r / base[3]:>7.2f}")
    if not parquet:
        print("\nparquet: skipped (pyarrow is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
