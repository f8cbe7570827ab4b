"""How a fleet's router picks the replica for each arrival: one set of rules for the simulator's router
(servecap/sim/fleet.py) and the real one (servecap/engine/fleet.py). Torch-free.

round-robin        the i-th arrival goes to replica i mod N, whatever the replicas hold;
least-outstanding  the replica with the fewest outstanding requests;
least-tokens       the replica with the fewest outstanding prompt + budget tokens: a long prompt or a large budget
                   weighs what it will cost the replica, not 1.
A request is outstanding at a replica from the moment it is routed there until the replica retires it (after its
last token, once its records are written; the real router hears of it when the replica reports it finished) or, in
the simulator, refuses it: waiting in the inbox or the queue, or running. Ties go to the lowest replica index, so
a run is deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from servecap.traces.errors import InputError
from servecap.traces.workload import Request


@dataclass
class Load:
    """What one replica has outstanding."""

    requests: int = 0
    tokens: int = 0

    def add(self, req: Request) -> None:
        self.requests += 1
        self.tokens += req.prompt_tokens + req.budget

    def remove(self, req: Request) -> None:
        self.requests -= 1
        self.tokens -= req.prompt_tokens + req.budget


Router = Callable[[Sequence[Load], int], int]  # (each replica's load, the arrival's index) -> replica


def _round_robin(loads: Sequence[Load], i: int) -> int:
    return i % len(loads)


def _least_outstanding(loads: Sequence[Load], i: int) -> int:
    return min(range(len(loads)), key=lambda j: loads[j].requests)  # min keeps the first of equals


def _least_tokens(loads: Sequence[Load], i: int) -> int:
    return min(range(len(loads)), key=lambda j: loads[j].tokens)


ROUTERS: dict[str, Router] = {"round-robin": _round_robin, "least-outstanding": _least_outstanding,
                              "least-tokens": _least_tokens}


def router(name: str) -> Router:
    if name not in ROUTERS:
        raise InputError(f"unknown router {name!r}; choose {', '.join(ROUTERS)}")
    return ROUTERS[name]
