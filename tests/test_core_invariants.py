"""The serving core's invariants (docs/READING.md lists them), held over random workloads: the block pool, the
scheduler's admission and retirement, the pass plan, and the step loop's records."""
from __future__ import annotations


import pytest
from helpers import constant_table, linear_table, sim_config

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from servecap.core.block_pool import BlockPool, PoolSize, blocks_for  # noqa: E402
from servecap.core.config import ServingConfig  # noqa: E402
from servecap.core.policies import PREFILL, STUDIED, PrefillPolicy  # noqa: E402
from servecap.core.scheduler import Scheduler  # noqa: E402
from servecap.costs.model import CostModel  # noqa: E402
from servecap.sim.simulator import simulate  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.workload import Request, length_trace  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # derived-cost notices of the synthetic tables


@SETTINGS
@given(num_blocks=st.integers(1, 64), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 64)), max_size=80))
def test_pool_never_hands_out_a_block_twice_and_free_plus_held_is_the_total(num_blocks, ops):
    pool = BlockPool(num_blocks, 16)
    held: list[list[int]] = []
    for allocate, n in ops:
        if allocate:
            if n > pool.free:
                with pytest.raises(RuntimeError):
                    pool.allocate(n)
                continue
            held.append(pool.allocate(n))
        elif held:
            pool.release(held.pop(n % len(held)))
        ids = [b for blocks in held for b in blocks]
        assert len(ids) == len(set(ids)), "a block is held twice"
        assert all(0 <= b < num_blocks for b in ids)
        assert pool.free + len(ids) == num_blocks


@SETTINGS
@given(gib=st.floats(0.01, 64), block_size=st.sampled_from([16, 32, 64]), tokens=st.integers(1, 10**6))
def test_the_block_arithmetic(gib, block_size, tokens):
    serving = ServingConfig(block_size=block_size, pool=PoolSize(gib=gib))
    n = serving.pool_blocks(0)
    assert n * block_size * serving.kv_bytes_per_token <= gib * 2**30 < (n + 1) * block_size * serving.kv_bytes_per_token
    b = blocks_for(tokens, block_size)
    assert (b - 1) * block_size < tokens <= b * block_size
    assert ServingConfig(max_batch=3, block_size=block_size).pool_blocks(tokens) == 3 * b  # unbounded: 3 of them


requests_st = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=40)


@SETTINGS
@given(reqs=requests_st, max_batch=st.integers(1, 8), pool_blocks=st.integers(5, 60),
       policy=st.sampled_from(STUDIED[:2] + ("chunked:7", "chunked:64")))
def test_the_scheduler_admits_in_order_reserves_and_retires_each_request_once(reqs, max_batch, pool_blocks, policy):
    """Driven pass by pass as the step loop drives it (one decode step a pass): admission is FIFO and stops at a
    head that does not fit; rows never exceed max batch; a running request holds its whole reservation, and the
    pool's free blocks are what the running requests do not hold; every admitted request retires exactly once."""
    pool = BlockPool(pool_blocks, 16)
    sched = Scheduler(max_batch, pool, None, PrefillPolicy.parse(policy))
    accepted = []
    for i, (prompt, budget) in enumerate(reqs):
        try:
            accepted.append(sched.submit(Request(i, 0.0, prompt, budget)))
        except InputError:  # larger than the whole pool
            assert blocks_for(prompt + budget, 16) > pool_blocks
    admitted, retired, step = [], [], 0
    while not sched.idle:
        head_before = sched.queue[0] if sched.queue else None
        plan = sched.schedule(float(step), step)
        admitted += plan.group
        for s in plan.first_tokens:  # the prefill step ran, as the loop records it
            s.first_token = s.last_token = step + 0.5
        if plan.group:
            assert plan.group[0] is head_before
        if sched.queue:  # admission stopped at a head that waits for a row or for its blocks
            assert len(sched.running) == max_batch or sched.queue[0].blocks_needed > pool.free
        assert len(sched.running) <= max_batch
        assert pool.free + sum(len(s.block_table) for s in sched.running) == pool_blocks
        assert all(len(s.block_table) == s.blocks_needed == blocks_for(s.req.prompt_tokens + s.budget, 16)
                   for s in sched.running)
        assert all(0 < s.generated < s.budget for s in plan.rows) and plan.max_steps >= (1 if plan.rows else 0)
        assert plan.prefill is not None or plan.rows, "a pass that is not idle does some work"
        if plan.rows:
            sched.advance(plan.rows, step + 1.0, 1)
        retired += sched.retire()
        step += 1
    assert [s.req.request_id for s in admitted] == [s.req.request_id for s in accepted]  # FIFO
    assert sorted(s.req.request_id for s in retired) == [s.req.request_id for s in accepted]  # each once
    assert all(s.generated == s.budget and s.finished >= s.first_token >= s.admitted for s in retired)
    assert pool.free == pool_blocks


triples_st = st.lists(st.tuples(st.floats(0, 5), st.integers(1, 2000), st.integers(1, 60)), min_size=1, max_size=40)


@SETTINGS
@given(triples=triples_st, max_batch=st.integers(1, 8), pool_blocks=st.sampled_from([None, 40, 120]),
       policy=st.sampled_from(list(STUDIED)), replicas=st.integers(1, 3))
def test_the_loop_records_every_request_once_and_numbers_steps_in_order(triples, max_batch, pool_blocks, policy,
                                                                        replicas):
    """Every request is in exactly one of requests (retired) and rejected; per replica, decode steps take
    consecutive numbers from their pass's number, a pass's prefill step carries its first decode step's number,
    and steps end in order, each at or after its start."""
    from servecap.sim.fleet import simulate_fleet
    cfg = sim_config(detail="steps", max_batch=max_batch, pool_blocks=pool_blocks, prefill=policy,
                     replicas=replicas)
    trace = length_trace(triples)
    cost = CostModel(linear_table())
    rec = (simulate(trace, cost, cfg) if replicas == 1 else simulate_fleet(trace, cost, cfg)).record
    ids = sorted(rec.requests["request_id"].tolist() + rec.rejected["request_id"].tolist())
    assert ids == sorted(r.request_id for r in trace.requests)
    for _, steps in rec.steps.groupby("replica"):
        assert (steps["end"] >= steps["start"]).all()
        decode = steps[steps["kind"] == "decode"]
        assert decode["step"].is_monotonic_increasing and decode["step"].is_unique
        assert (decode["end"].diff().dropna() >= 0).all()
        prefill = steps[steps["kind"] == "prefill"]
        assert prefill["step"].is_unique
        assert (prefill["n_admitted"] >= 0).all()
    if len(rec.requests):
        r = rec.requests
        assert (r["admitted"] >= r["arrival"]).all() and (r["first_token"] > r["admitted"]).all()
        assert (r["finished"] >= r["first_token"]).all()


@SETTINGS
@given(triples=triples_st, max_batch=st.integers(1, 8), policy=st.sampled_from(list(STUDIED)))
def test_fast_forward_writes_what_stepping_one_decode_step_a_pass_writes(triples, max_batch, policy):
    """The plan's fast-forward bound (Scheduler.schedule) is exact: a stretch priced at once ends where single
    steps end, so every record is the same."""
    trace = length_trace(triples)
    cost = CostModel(constant_table())
    runs = [simulate(trace, cost, sim_config(detail="tokens", max_batch=max_batch, prefill=policy, fast_forward=ff))
            for ff in (True, False)]
    for table in ("requests", "steps", "tokens", "rejected"):
        assert getattr(runs[0].record, table).equals(getattr(runs[1].record, table)), table


def test_policies_come_from_one_registry_and_parse_in_one_place():
    assert [str(PrefillPolicy.parse(p)) for p in STUDIED] == list(STUDIED)
    assert set(PREFILL) == {"padded", "packed", "chunked", "mixed"}
    for bad, why in (("chunked", "chunked:N"), ("padded:3", "only chunked"), ("zigzag", "unknown prefill policy"),
                     ("chunked:0", "whole number")):
        with pytest.raises(InputError, match=why):
            PrefillPolicy.parse(bad)
    assert ServingConfig(prefill="chunked:64").prefill == PREFILL["chunked"](64)


def test_the_decode_backend_padded_is_now_dense_and_its_old_name_still_works(tmp_path, capsys):
    from pathlib import Path

    from servecap.costs.table import load_cost_table
    from helpers import run_cli, write_table
    from servecap.sim.cli import main

    assert ServingConfig(backend="padded").backend == "dense"
    old = load_cost_table(Path(__file__).parent / "data" / "h200-v1-59e02847ee9daee8.json")  # keyed `padded`
    assert set(old.backends) == {"paged", "dense"} and old.table_id == "59e02847ee9daee8"
    cost = CostModel(old)
    assert cost.decode("padded", 8, 800, 100) == cost.decode("dense", 8, 800, 100)  # an old record's name
    table = write_table(linear_table(), tmp_path / "t.json")
    code, out, err = run_cli(main, capsys, "run", "--table", table, "--rate", 2, "--n", 20, "--backend", "padded")
    assert code == 0 and "engine   dense," in out and "'padded' is now called 'dense'" in err


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_records_of_every_version_read_with_the_current_names(tmp_path, version):
    """Version 5 is written (4 plus the preemption, cache and fused-step columns, read as 0 from older records); 4
    (plain CSV, n_admitted); 3 (plain CSV, the schema in meta.json, steps' `admitted`: real engine runs recorded before the
    rename), 2 (a '# {schema}' line atop each table, `admitted`) and 1 (that line, and no tokens, attn or replica
    columns) are read with the current names."""
    import csv
    import json

    from servecap.sim.run_cli import _write_record
    from servecap.traces import records
    from servecap.traces.records import read_run

    cfg = sim_config(detail="steps", max_batch=4)
    rec = simulate(length_trace([(0.0, 16, 3), (0.0, 40, 2), (0.5, 8, 4)]), CostModel(constant_table()), cfg).record
    run = tmp_path / "run"
    _write_record(rec, run, False, {}, {})
    meta = json.loads((run / "meta.json").read_text())
    assert meta["version"] == records.VERSION == 5
    assert (run / "steps.csv").read_text().splitlines()[0].split(",")[13] == "n_admitted"  # plain CSV: names first
    if version < 5:  # the same record as that version wrote it
        (run / "meta.json").write_text(json.dumps({**meta, "version": version}))
        for t in records.TABLES:
            path = run / f"{t}.csv"
            if not path.exists():
                continue
            rows = list(csv.reader(path.read_text().splitlines()))
            keep = [i for i, c in enumerate(rows[0]) if (version > 1 or c not in records._ADDED.get(t, ()))
                    and c not in records._ADDED_V5.get(t, ())]
            rows = [[r[i] for i in keep] for r in rows]
            if t == "steps" and version < 4:
                rows[0] = ["admitted" if c == "n_admitted" else c for c in rows[0]]
            text = "".join(",".join(r) + "\n" for r in rows)
            if version < 3:
                text = "# " + json.dumps({"schema": f"run-record/{t}", "version": version}) + "\n" + text
            path.write_text(text)
        if version < 4:
            assert "admitted" in (run / "steps.csv").read_text() and "n_admitted" not in (run / "steps.csv").read_text()
    again = read_run(run)
    assert again.meta["version"] == version
    assert again.steps["n_admitted"].tolist() == rec.steps["n_admitted"].tolist() and rec.steps["n_admitted"].max() == 2
    assert again.requests["admitted"].tolist() == rec.requests["admitted"].tolist()  # the time keeps its name
    assert list(again.steps.columns) == list(records.STEP_COLUMNS)
