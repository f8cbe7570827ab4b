"""A sweep's calls run elsewhere (Modal containers, servecap/sim/modal_app.py): what is sent, what runs there, and how
the results come back: each as it finishes, with the index of its call, so that the sweep keeps it in its points
store at once (servecap/sim/sweep.py), as it keeps a local worker's.

Every input carries the sweep's worker setup (sim.sweep._init's arguments: the cost table, the workload, the noise
seed, the SLOs), pickled and compressed once (a few tens of kB for the shipped table and a generated workload; a
trace file adds its requests), with one call: a capacity estimate, a point or a point's bands. A worker sets the
setup up once per distinct setup and then makes the call with sim.sweep's own functions, so a remote point is the row
a local one is.
"""
from __future__ import annotations

import hashlib
import pickle
import zlib
from typing import Callable, Iterator, Protocol

from . import sweep

CALLS: dict[str, Callable] = {"estimate": sweep._estimate, "point": sweep._point, "band": sweep._band}
_ready: bytes | None = None  # the digest of the setup this worker has


class Mappable(Protocol):
    def map(self, *inputs, kwargs: dict = ..., order_outputs: bool = ...): ...


def pack(init: tuple) -> bytes:
    return zlib.compress(pickle.dumps(init, protocol=pickle.HIGHEST_PROTOCOL))


def run_call(index: int, call: str, args: tuple, setup: bytes) -> tuple[int, object]:
    """What a remote worker runs for one input: (index, CALLS[call](*args)) after setting up from `setup`."""
    global _ready
    digest = hashlib.sha256(setup).digest()
    if digest != _ready:
        sweep._init(*pickle.loads(zlib.decompress(setup)))
        _ready = digest
    return index, CALLS[call](*args)


def map_with(function: Mappable) -> sweep.RemoteMap:
    """A sim.sweep.RemoteMap that maps the calls over `function`'s workers (function.map with run_call's
    inputs), yielding each (index, result) as it finishes."""
    def remote_map(init: tuple, fn: Callable, args: list[tuple]) -> Iterator[tuple[int, object]]:
        call = next(name for name, f in CALLS.items() if f is fn)
        yield from function.map(range(len(args)), [call] * len(args), args, kwargs={"setup": pack(init)},
                                order_outputs=False)
    return remote_map
