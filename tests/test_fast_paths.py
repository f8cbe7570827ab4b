"""The simulator's fast paths against the straightforward code they replace, to the bit.

The simulator prices a stretch of decode steps in plain Python (CostModel.decode_stretch, SimTimer.decode) where
it once called numpy on arrays; the block pool hands out released blocks by slices where it popped them one at
a time; a simulated run's records are kept in memory column by column where they were kept as rows. Each must
give exactly what the reference gives, on many random shapes. And `python -m sim run --help` imports neither
pandas nor SimPy.
"""
from __future__ import annotations

import math
import random
import subprocess
import sys
import warnings
from collections import deque

import numpy as np
import pandas as pd
import pytest
from helpers import T1_REFIT

from servecap.costs.model import CostModel, ExtrapolationWarning, _interp
from servecap.costs.shapes import DecodeShape
from servecap.costs.synthetic import linear_table
from servecap.costs.table import load_cost_table
from servecap.core.block_pool import BlockPool
from servecap.sim.simulator import SimTimer, _Noise
from servecap.traces.records import TABLES, RunWriter, _frame


@pytest.fixture(scope="module", params=["t1-refit-h200", "synthetic-linear"])
def cost(request) -> CostModel:
    return CostModel(load_cost_table(T1_REFIT) if request.param == "t1-refit-h200" else linear_table())


def _shapes(cost: CostModel, n: int, seed: int):
    """(rows, kv_tokens, kv_max, k): every row count the table allows and a few beyond it, longest rows from one
    token to past the table's range, the other rows from one token each to as long as the longest, and stretches
    from one step to a whole budget."""
    rng = random.Random(seed)
    t = cost.table
    for _ in range(n):
        rows = rng.randint(1, t.max_batch + 4)
        kv_max = rng.choice([rng.randint(1, 200), rng.randint(1, t.max_tokens), rng.randint(t.max_tokens, 2 * t.max_tokens)])
        kv_tokens = rng.randint(kv_max + rows - 1, rows * kv_max)
        yield rows, kv_tokens, kv_max, rng.choice([1, 2, rng.randint(1, 16), rng.randint(1, 300)])


def _numpy_decode(cost: CostModel, backend: str, rows: int, kv_tokens, kv_max):
    """The decode cost as servecap/costs/model.py first wrote it, on numpy arrays: the reference the one implementation
    (CostModel.decode_stretch) is held to, bit for bit."""
    d = cost._decode[backend]
    r = d.rows
    kv_tokens, kv_max = np.asarray(kv_tokens, float), np.asarray(kv_max, float)
    short = rows * kv_max - kv_tokens

    def uniform(i: int, length):
        k = d.knots[i]
        return _interp(k.x, k.y, length, k.min_slope, k.floor_from)

    def at(i: int):
        return uniform(i, kv_max) - d.per_token[i] * short
    mean = kv_tokens // rows  # the floor's uniform batch holding as much K/V (tables fitted with it)
    if len(r) == 1:
        return np.maximum(at(0), uniform(0, mean)) if d.floored else at(0)
    i = int(np.clip(np.searchsorted(r, rows), 1, len(r) - 1))
    w = (rows - r[i - 1]) / (r[i] - r[i - 1])
    c = at(i - 1) * (1 - w) + at(i) * w
    c = np.maximum(c, at(len(r) - 1)) if rows > r[-1] else c
    return np.maximum(c, uniform(i - 1, mean) * (1 - w) + uniform(i, mean) * w) if d.floored else c


def test_decode_stretch_equals_the_numpy_decode_to_the_bit(cost):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExtrapolationWarning)
        for backend in cost.backends:
            for rows, kv_tokens, kv_max, k in _shapes(cost, 3000, seed=cost.backends.index(backend)):
                j = np.arange(k)
                want = np.asarray(_numpy_decode(cost, backend, rows, kv_tokens + rows * j, kv_max + j), float)
                got = np.array(cost.decode_stretch(backend, rows, kv_tokens, kv_max, k), float)
                assert got.tobytes() == want.tobytes(), (backend, rows, kv_tokens, kv_max, k)


def _numpy_stretch(cost: CostModel, backend: str, noise: _Noise | None, decodes: int, shape: DecodeShape,
                   start: float, k: int, stop: float) -> list[float]:
    """SimTimer.decode as it was written with numpy: the step ends of a stretch."""
    j = np.arange(k)
    n = shape.rows
    d = _numpy_decode(cost, backend, n, shape.kv_tokens + n * j, shape.kv_max + j)
    if noise is not None:
        d = d * noise.factors(decodes, k)
    ends = np.cumsum(np.concatenate(([start], np.broadcast_to(d, (k,)))))[1:]
    if stop <= ends[-1]:
        ends = ends[:int(np.searchsorted(ends, stop, side="left")) + 1]
    return ends.tolist()


@pytest.mark.parametrize("noise_seed", [None, 5])
def test_sim_timer_stretch_ends_equal_the_numpy_ones_to_the_bit(cost, noise_seed):
    backend = "paged"
    timer = SimTimer(cost, backend, noise_seed=noise_seed)
    reference = _Noise(noise_seed, 1, cost.decode_sigma[backend]) if noise_seed is not None else None
    rng = random.Random(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExtrapolationWarning)
        for rows, kv_tokens, kv_max, k in _shapes(cost, 2000, seed=2):
            shape = DecodeShape(rows, kv_tokens, kv_max)
            start = rng.uniform(0, 1e4)
            # No stop, one inside the stretch, one on a step's end, one before the first end.
            stop = rng.choice([float("inf"), start + rng.uniform(0, k * 0.05), start, start - 1.0])
            decodes = timer.decodes
            want = _numpy_stretch(cost, backend, reference, decodes, shape, start, k, stop)
            if rng.random() < 0.1 and len(want) > 1:
                stop = want[len(want) // 2]
                want = _numpy_stretch(cost, backend, reference, decodes, shape, start, k, stop)
            _, ends = timer.decode([], shape, start, k, stop)
            assert np.array(ends).tobytes() == np.array(want).tobytes(), (rows, kv_tokens, kv_max, k, start, stop)
            assert timer.decodes == decodes + len(want) and timer.t == want[-1]


def test_block_pool_hands_out_released_blocks_oldest_first_as_a_queue():
    rng = random.Random(3)
    for num_blocks in (1, 7, 300):
        pool, free, fresh, held = BlockPool(num_blocks, 16), deque(), 0, []
        for _ in range(3000):
            if held and (pool.free == 0 or rng.random() < 0.45):
                blocks = held.pop(rng.randrange(len(held)))
                pool.release(blocks)
                free.extend(blocks)
                continue
            n = rng.randint(1, pool.free)
            new = min(n, num_blocks - fresh)
            want = list(range(fresh, fresh + new)) + [free.popleft() for _ in range(n - new)]
            fresh += new
            got = pool.allocate(n)
            assert got == want and pool.free == num_blocks - fresh + len(free)
            held.append(got)


def _rows(table: str, n: int, rng: random.Random, odd: str | None) -> list[tuple]:
    """n rows of a table as the recorder writes them, with one odd column of some other kind when asked."""
    ncols = len(TABLES[table])
    rows = []
    for i in range(n):
        row = [rng.choice([i, rng.randint(-5, 10**6)]) if c % 2 else rng.choice([rng.random() * 1e3, math.nan])
               for c in range(ncols)]
        if table == "steps":
            row[1] = rng.choice(["prefill", "decode"])
        if table == "rejected":
            row[2] = f"request {i}: empty prompt"
        if odd is not None and i == n // 2:  # one value of another kind in the middle of an int or a float column
            row[(2 if odd == "int-in-floats" else 3) % ncols] = {"float-in-ints": 2.5, "int-in-floats": 7, "none": None, "bool": True, "numpy": np.int64(4),
                      "huge": 2**70, "str": "x"}[odd]
        rows.append(tuple(row))
    return rows


@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 10_000])
@pytest.mark.parametrize("odd", [None, "float-in-ints", "int-in-floats", "none", "bool", "numpy", "huge", "str"])
def test_in_memory_records_make_the_frame_pandas_makes_of_the_rows(table, n, odd):
    rows = _rows(table, n, random.Random(n), odd)
    writer = RunWriter(None, {}, (table,))
    half = len(rows) // 3
    for row in rows[:half]:
        writer.add(table, row)
    writer.add_many(table, iter(rows[half:]))
    try:
        want = _frame(table, rows)
    except ValueError as e:  # a string in a numeric column: refused either way
        with pytest.raises(type(e)):
            writer.record()
        return
    got = getattr(writer.record(), table)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert list(got.dtypes) == list(want.dtypes)


def test_the_cli_answers_help_without_pandas_or_simpy():
    # Importing pandas takes longer than a 400-request point takes to simulate: the commands import it when they run.
    code = ("import runpy, sys; sys.argv = ['sim', 'run', '--help']\n"
            "try:\n    runpy.run_module('servecap.sim', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "sys.exit(('pandas' in sys.modules) or ('simpy' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("sigma", [math.nan, math.inf, -0.01])
def test_seeded_noise_refuses_a_step_time_sigma_that_would_stop_the_clock(sigma):
    from servecap.traces.errors import InputError

    with pytest.raises(InputError, match="step-time sigma"):
        _Noise(5, 0, sigma)
