"""Replicas for real: the router's rules, and a fleet of two tiny engines on the CPU behind a router."""
from __future__ import annotations

import pytest

from servecap.engine.fleet import serve_fleet
from servecap.core.routing import ROUTERS, Load, router
from servecap.traces.errors import InputError
from servecap.traces.workload import length_trace


def test_routers_pick_by_their_rule():
    loads = [Load(requests=2, tokens=100), Load(requests=1, tokens=900), Load(requests=1, tokens=50)]
    assert [router("round-robin")(loads, t) for t in range(4)] == [0, 1, 2, 0]
    assert router("least-outstanding")(loads, 0) == 1  # fewest requests; ties go to the lowest index
    assert router("least-tokens")(loads, 0) == 2


def test_an_unknown_router_or_no_replica_is_refused(tmp_path):
    trace = length_trace([(0.0, 10, 2)])
    with pytest.raises(InputError, match="unknown router 'fastest'"):
        serve_fleet(trace, tmp_path / "f", "fastest", ["", ""], {})
    with pytest.raises(InputError, match="at least one replica"):
        serve_fleet(trace, tmp_path / "f", next(iter(ROUTERS)), [], {})


@pytest.mark.slow
def test_two_tiny_engines_behind_a_router_serve_every_request_once(tmp_path, monkeypatch, progress):
    torch = pytest.importorskip("torch")
    import servecap.engine.fleet
    from servecap.core.config import ServingConfig
    from servecap.traces.records import read_run

    from helpers import interpreted_replica

    if not torch.cuda.is_available():  # the replicas' kernels interpreted as the suite's are (spawned: see there)
        monkeypatch.setattr(servecap.engine.fleet, "_replica", interpreted_replica)

    trace = length_trace([(0.05 * i, 8 + 5 * i, 3) for i in range(6)], {"kind": "fleet-test"})
    cfg = dict(serving=ServingConfig(model="tiny", dtype="float32", block_size=16, max_batch=2), device="cpu",
               max_prompt=48, max_budget=4, backends=("paged",))
    progress("starting two replica processes")
    rec = read_run(serve_fleet(trace, tmp_path / "fleet", "round-robin", ["", ""], cfg, log=progress))
    assert rec.meta["status"] == "complete" and rec.meta["router"] == "round-robin" and rec.meta["replicas"] == 2
    req = rec.requests.set_index("request_id").sort_index()
    assert list(req.index) == list(range(6)) and list(req.replica) == [0, 1, 0, 1, 0, 1]
    assert (req.output_tokens == 3).all() and (req.admitted >= req.arrival).all()
    assert set(rec.steps.replica) == {0, 1}
