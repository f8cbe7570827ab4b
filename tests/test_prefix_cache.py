"""Prefix caching (servecap/core/prefix_cache.py): keys from a trace's hash ids, blocks shared by reference count and
evicted least recently released, and the simulator's runs with the cache on and off."""
from __future__ import annotations

import dataclasses

import pytest
from helpers import constant_table, linear_table, sim_config

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from servecap.core.config import ServingConfig  # noqa: E402
from servecap.core.prefix_cache import CachingBlockPool, block_keys  # noqa: E402
from servecap.costs.model import CostModel  # noqa: E402
from servecap.sim.simulator import simulate  # noqa: E402
from servecap.traces.workload import Request, Trace  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_keys_follow_the_prefix_not_the_id_alone():
    a = Request(0, 0.0, 300, 5, hash_ids=(7, 8, 9), hash_block=128)
    b = Request(1, 0.0, 300, 5, hash_ids=(7, 5, 9), hash_block=128)
    ka, kb = block_keys(a, 64), block_keys(b, 64)
    assert len(ka) == 300 // 64 == 4
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]  # block 3 shares id 9 but not what is before it
    assert block_keys(Request(2, 0.0, 300, 5), 64) == []
    assert block_keys(dataclasses.replace(a, hash_block=96), 64) == []  # not whole pool blocks: never cached


def _trace(shared: list[tuple[float, tuple[int, ...], int, int]]) -> Trace:
    return Trace([Request(i, a, p, b, hash_ids=h, hash_block=512) for i, (a, h, p, b) in enumerate(shared)],
                 {"kind": "test"})


def test_a_repeated_prefix_is_computed_once_and_shared():
    """Two requests with the same first two 512-token blocks: the second, admitted after the first's prefill, finds
    16 blocks cached, computes only its own suffix, and holds the shared blocks with the first."""
    trace = _trace([(0.0, (1, 2, 3), 1500, 50), (0.2, (1, 2, 4), 1400, 50)])
    cost = CostModel(linear_table())
    on, off = (simulate(trace, cost, sim_config(detail="steps", max_batch=4, prefix_cache=c)).record
               for c in (True, False))
    r = on.requests.set_index("request_id")
    assert r.loc[0, "cached_tokens"] == 0 and r.loc[1, "cached_tokens"] == 1024
    assert (off.requests.cached_tokens == 0).all()
    pre = on.steps[on.steps.kind == "prefill"]
    assert pre.prompt_tokens.tolist() == [1500, 1400 - 1024]
    assert r.loc[1, "first_token"] - r.loc[1, "admitted"] < \
        off.requests.set_index("request_id").loc[1, "first_token"] - off.requests.set_index("request_id").loc[1, "admitted"]


def test_cache_off_serves_a_hashed_trace_as_the_same_trace_without_hashes():
    trace = _trace([(0.1 * i, (1, 2, 10 + i % 3), 1100 + 7 * i, 20 + i) for i in range(30)])
    bare = Trace([dataclasses.replace(r, hash_ids=(), hash_block=0) for r in trace.requests], trace.meta)
    cost = CostModel(linear_table())
    a, b = (simulate(t, cost, sim_config(detail="tokens", max_batch=4)).record for t in (trace, bare))
    assert a.requests.equals(b.requests) and a.steps.equals(b.steps) and a.tokens.equals(b.tokens)


@SETTINGS
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 6)), max_size=60),
       num_blocks=st.integers(4, 24))
def test_the_caching_pool_never_hands_out_a_held_block_and_counts_evictable_as_free(ops, num_blocks):
    """Random allocate / cache / share / release: no block is held by two owners unless it is a cached block they
    share; free is the never-held, the released plain and the unheld cached blocks; a key finds its block until
    the block is evicted."""
    pool = CachingBlockPool(num_blocks, 16)
    owners: list[list[int]] = []
    for op, who, n in ops:
        if op == 0 and n <= pool.free:
            owners.append(pool.allocate(n))
        elif op == 1 and owners:  # the owner's blocks become cached, keyed by (owner, index)
            o = owners[who % len(owners)]
            for j, b in enumerate(o):
                pool.cache(b, hash((id(o), j)))
        elif op == 2 and owners:  # another owner shares some cached blocks of an existing owner
            o = owners[who % len(owners)]
            hits = pool.match([hash((id(o), j)) for j in range(len(o))], n)
            pool.take(hits, n)
            owners.append(list(hits))
        elif op == 3 and owners:
            pool.release(owners.pop(who % len(owners)))
        held = [b for o in owners for b in o]
        distinct = set(held)
        for b in distinct:
            times = held.count(b)
            assert times == 1 or pool.refs.get(b) == times, "a block shared without being a cached one"
        assert pool.free + len(distinct) == num_blocks
        assert not distinct & set(pool.evictable)
        assert all(pool.key_of[b] == k for k, b in pool.block_of.items())


triples_st = st.lists(st.tuples(st.floats(0, 2), st.integers(0, 3), st.integers(600, 2000), st.integers(1, 80)),
                      min_size=1, max_size=30)


@settings(max_examples=30, deadline=None)
@given(reqs=triples_st, max_batch=st.integers(1, 6), pool_blocks=st.sampled_from([40, 80, None]),
       policy=st.sampled_from(("padded", "chunked:256", "mixed:256")), admission=st.sampled_from(("reserve",
                                                                                                   "on-demand")))
def test_fast_forward_is_exact_with_the_cache_on(reqs, max_batch, pool_blocks, policy, admission):
    trace = _trace([(a, (g, g + 10, g * 7 + i, 1000 + i)[:-(-p // 512)], p, b) for i, (a, g, p, b) in enumerate(reqs)])
    cost = CostModel(constant_table())
    runs = [simulate(trace, cost, sim_config(detail="tokens", max_batch=max_batch, prefill=policy, fast_forward=ff,
                                             pool_blocks=pool_blocks, admission=admission, prefix_cache=True))
            for ff in (True, False)]
    for table in ("requests", "steps", "tokens", "rejected"):
        assert getattr(runs[0].record, table).equals(getattr(runs[1].record, table)), table
    r = runs[0].record.requests
    assert (r.output_tokens == r.output_tokens).all() and (r.cached_tokens % 64 == 0).all()


def test_the_configuration_refuses_a_cache_that_is_not_on_or_off():
    from servecap.traces.errors import InputError
    with pytest.raises(InputError, match="on or off"):
        ServingConfig(prefix_cache="yes")
