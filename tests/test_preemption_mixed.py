"""On-demand admission with preemption by recompute, and fused (mixed) steps: the scheduler's invariants over
random workloads (docs/READING.md lists them), and the simulator's records for both."""
from __future__ import annotations

import pytest
from helpers import constant_table, linear_table, sim_config

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from servecap.core.block_pool import BlockPool, blocks_for  # noqa: E402
from servecap.core.config import ServingConfig  # noqa: E402
from servecap.core.policies import ON_DEMAND, OnDemand, PrefillPolicy  # noqa: E402
from servecap.core.scheduler import Scheduler  # noqa: E402
from servecap.costs.model import CostModel  # noqa: E402
from servecap.sim.simulator import simulate  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.workload import Request, length_trace  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

requests_st = st.lists(st.tuples(st.integers(1, 200), st.integers(1, 60)), min_size=1, max_size=30)
POLICIES = ("padded", "packed", "chunked:16", "mixed:24")


def _drive(sched: Scheduler, pool: BlockPool, check) -> list:
    """The step loop's bookkeeping, one decode step a pass; `check(plan)` after each plan."""
    retired, step = [], 0
    while not sched.idle:
        plan = sched.schedule(float(step), step)
        for s in plan.first_tokens:
            s.last_token = step + 0.5
            if s.generated == 1:
                s.first_token = step + 0.5
        check(plan)
        if plan.rows:
            sched.advance(plan.rows, step + 1.0, 1)
        retired += sched.retire()
        step += 1
        assert step < 100_000, "the scheduler makes no progress"
    return retired


@SETTINGS
@given(reqs=requests_st, max_batch=st.integers(1, 8), pool_blocks=st.integers(4, 40),
       policy=st.sampled_from(POLICIES))
def test_on_demand_holds_only_written_blocks_preempts_the_newest_and_serves_every_request(reqs, max_batch,
                                                                                         pool_blocks, policy):
    """Every running row holds the blocks of the positions it has written, and at most one more (a decode row's
    next write, or a prompt's first decode token); free plus held is the pool; a preempted request is the most
    recently admitted, goes back to the head of the queue with nothing held, and is served in the end with its
    whole budget; a pass that preempts admits no one."""
    pool = BlockPool(pool_blocks, 16)
    sched = Scheduler(max_batch, pool, None, PrefillPolicy.parse(policy), ON_DEMAND)
    accepted = []
    for i, (prompt, budget) in enumerate(reqs):
        try:
            accepted.append(sched.submit(Request(i, 0.0, prompt, budget)))
        except InputError:
            assert blocks_for(prompt + budget, 16) + OnDemand().watermark(pool) > pool_blocks

    def check(plan):
        assert pool.free + sum(len(s.block_table) for s in sched.running) == pool_blocks
        for s in sched.running:
            written = s.kv_len + 1 if s in plan.rows else s.kv_len  # a decode row's next write has its block
            most = max(s.kv_len, s.target) + 1
            assert blocks_for(written, 16) <= len(s.block_table) <= blocks_for(most, 16)
        if plan.preempted:
            assert not plan.group
            assert all(not s.block_table and s.kv_len == 0 for s in plan.preempted)
            assert list(sched.queue)[:len(plan.preempted)] == plan.preempted[::-1]  # oldest preempted first
        assert len(sched.running) <= max_batch

    retired = _drive(sched, pool, check)
    assert sorted(s.req.request_id for s in retired) == [s.req.request_id for s in accepted]
    assert all(s.generated == s.budget and s.finished >= s.first_token for s in retired)
    assert sum(s.preemptions for s in retired) == sched.preemptions
    assert all((s.recomputed > 0) <= (s.preemptions > 0) and s.recomputed <= s.preemptions * s.peak
               for s in retired)
    assert pool.free == pool_blocks


@SETTINGS
@given(reqs=requests_st, max_batch=st.integers(1, 8), budget=st.integers(8, 64))
def test_a_mixed_step_holds_every_decode_row_and_at_most_its_budget(reqs, max_batch, budget):
    """Each fused step carries every row that has its first token and budget left (one position each, first),
    then prompt positions oldest first, within the budget; a pass with a fused step runs no separate decode step;
    prompts never wait while the budget has room."""
    budget = max(budget, max_batch)
    pool = BlockPool(10_000, 16)
    sched = Scheduler(max_batch, pool, None, PrefillPolicy.parse(f"mixed:{budget}"))
    for i, (prompt, b) in enumerate(reqs):
        sched.submit(Request(i, 0.0, prompt, b))

    def check(plan):
        w = plan.prefill
        if w is None:
            return
        assert not plan.rows
        assert sum(w.computed) <= budget
        assert w.new[:w.decode] == [1] * w.decode and all(w.done[:w.decode])
        if sum(w.computed) < budget:  # room left: every prompt that waited got what it needed
            assert all(w.done[w.decode:])

    retired = _drive(sched, pool, check)
    assert sorted(s.req.request_id for s in retired) == list(range(len(reqs)))
    assert all(s.generated == s.budget for s in retired)


def test_mixed_refuses_a_budget_below_the_batch_and_on_demand_parses():
    with pytest.raises(InputError, match="at least the max batch"):
        ServingConfig(prefill="mixed:16", max_batch=32)
    assert str(ServingConfig(admission="on-demand").admission) == "on-demand"
    with pytest.raises(InputError, match="unknown admission policy"):
        ServingConfig(admission="lazy")


triples_st = st.lists(st.tuples(st.floats(0, 3), st.integers(1, 600), st.integers(1, 150)), min_size=1, max_size=40)


@SETTINGS
@given(triples=triples_st, max_batch=st.integers(1, 8), pool_blocks=st.sampled_from([6, 12, 30]),
       policy=st.sampled_from(("padded", "chunked:64", "mixed:64")))
def test_fast_forward_is_exact_under_on_demand_and_mixed(triples, max_batch, pool_blocks, policy):
    """A stretch of decode steps priced at once ends where single steps end, preemptions included: every record
    is the same (Scheduler.max_decode_steps bounds a stretch by the free blocks the rows grow into)."""
    trace = length_trace(triples)
    cost = CostModel(constant_table())
    runs = [simulate(trace, cost, sim_config(detail="tokens", max_batch=max_batch, prefill=policy, fast_forward=ff,
                                             pool_blocks=pool_blocks, admission="on-demand"))
            for ff in (True, False)]
    for table in ("requests", "steps", "tokens", "rejected"):
        assert getattr(runs[0].record, table).equals(getattr(runs[1].record, table)), table


def test_on_demand_with_a_pool_that_never_binds_serves_as_reserve_does():
    """With blocks to spare, on-demand admits the same groups at the same times: only the blocks held differ."""
    trace = length_trace([(0.01 * i, 50 + 37 * i % 400, 10 + 13 * i % 80) for i in range(60)])
    cost = CostModel(linear_table())
    runs = [simulate(trace, cost, sim_config(detail="tokens", max_batch=8, admission=a)).record
            for a in ("reserve", "on-demand")]
    cols = [c for c in runs[0].requests.columns if c != "blocks"]
    assert runs[0].requests[cols].equals(runs[1].requests[cols])
    assert runs[0].tokens.equals(runs[1].tokens)
    assert (runs[1].requests.preemptions == 0).all()
    assert (runs[1].requests.blocks <= runs[0].requests.blocks).all()


def test_a_binding_pool_preempts_and_records_the_recompute():
    """A pool that holds two requests' prompts but not their outputs: on-demand admits both, preempts the newer,
    recomputes it, and records the preemption per request and per step; reserve admits one at a time."""
    trace = length_trace([(0.0, 64, 200), (0.0, 64, 200)])
    cost = CostModel(linear_table())
    rec = {a: simulate(trace, cost, sim_config(detail="tokens", max_batch=4, pool_blocks=8, block_size=64,
                                               admission=a)).record for a in ("reserve", "on-demand")}
    od, rs = rec["on-demand"], rec["reserve"]
    assert (rs.requests.preemptions == 0).all() and rs.requests.admitted.iloc[1] > rs.requests.admitted.iloc[0]
    r = od.requests.set_index("request_id")
    assert r.loc[1, "preemptions"] >= 1 and r.loc[0, "preemptions"] == 0
    assert r.loc[1, "recomputed_tokens"] > 64
    assert od.steps.preempted.sum() == r.preemptions.sum()
    assert od.steps.recomputed.sum() == r.recomputed_tokens.sum()
    assert (r.output_tokens == 200).all()
    assert len(od.tokens[od.tokens.request_id == 1]) == 200  # every token once, the recompute's included
