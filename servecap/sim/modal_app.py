"""Simulator sweeps on Modal: every point of a `sim sweep` grid in a Modal container (Function.map), from any
machine with the modal package and a Modal token:

    python -m sim sweep --on modal --replicas 1,2,3,4 --router round-robin,least-outstanding --rates 40,80,120 \
        --slo ttft_p99=2,tpot_p99=0.05

The image holds the simulator's dependencies only (no torch: the simulator never imports it), pinned as the
calibration's image pins its own, and this checkout's packages that the simulator imports. Results come back as
points finish and go into the sweep's points file as a local sweep's do, so `--resume` completes an interrupted
sweep (on Modal or locally: the points are the same), and the sweep writes the same files a local sweep writes
(servecap/sim/remote.py says what travels).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import modal

from servecap.traces.errors import InputError

from .remote import map_with, run_call
from .sweep import RemoteMap

PACKAGES = ("simpy==4.1.2", "numpy==2.4.6", "pandas==3.1.1", "scipy==1.17.1", "matplotlib==3.11.2", "tqdm==4.70.1")
SOURCES = ("servecap",)  # one package; the simulator's modules never import its engine (no torch in the image)
CPU = 1.0  # a point is one single-threaded simulation

image = (modal.Image.debian_slim(python_version="3.11")
         .pip_install(*PACKAGES)
         .add_local_python_source(*SOURCES))
app = modal.App("servecap-sweep", image=image)


@app.function(cpu=CPU, timeout=3600)
def sweep_call(index: int, call: str, args: tuple, setup: bytes) -> tuple[int, object]:
    """One estimate or point of a sweep (sim.remote.run_call)."""
    return run_call(index, call, args, setup)


@contextmanager
def mapper() -> Iterator[RemoteMap]:
    """The app running (its image built on first use), and a RemoteMap onto its containers. A machine that cannot
    reach Modal (no token, no network) is told so in one line before anything runs."""
    with ExitStack() as stack:
        try:
            stack.enter_context(modal.enable_output())
            stack.enter_context(app.run())
        except (modal.exception.AuthError, modal.exception.ConnectionError) as e:
            raise InputError(f"cannot start the sweep on Modal: {str(e).splitlines()[0]} (or run it with --on local)") \
                from None
        yield map_with(sweep_call)
