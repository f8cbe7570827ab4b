"""Calibration and the engine's arrival runs on Modal's A10, from a machine without a GPU.

    modal run servecap/calibrate/modal_app.py --out a10.json                # calibrate; the table (and its points) land here
    modal run servecap/calibrate/modal_app.py --out a10-quick.json --quick  # a smoke test of the path
    modal run servecap/calibrate/modal_app.py --rate 2 --out runs/a10-r2    # one seeded arrival run; its record lands here

(from the repository root, with the project installed: `pip install -e .`, so that Modal finds its packages.)

The container checks its card before any work and refuses anything but an NVIDIA A10 (an A10G is another card
with other speeds); this machine checks the name again before it writes what came back. The points file of a
calibration lives on the Modal volume `servecap-calibration`, so re-running an interrupted one resumes it.
"""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import modal

from servecap.traces.errors import InputError
from servecap.traces.provenance import gpu_matches

GPU = "A10"
VOLUME = "servecap-calibration"
STATE = "/state"
COMMIT_EVERY_S = 60
# torch pinned, with the rest of the engine's stack: a cost table describes the software that measured it too.
PACKAGES = ("torch==2.13.0", "triton==3.7.1", "transformers==5.17.0", "safetensors==0.8.0", "numpy==2.4.6",
            "scipy==1.17.1", "pandas==3.1.1", "tqdm==4.70.1")

image = (modal.Image.debian_slim(python_version="3.11")
         .pip_install(*PACKAGES)
         .add_local_python_source("servecap"))
app = modal.App("servecap-calibrate", image=image)
volume = modal.Volume.from_name(VOLUME, create_if_missing=True)


def check_gpu(name: str, expected: str = GPU) -> str:
    """The card's name, if it is the expected one (exactly: an 'NVIDIA A10G' is not an 'A10')."""
    if not gpu_matches(name, expected):
        raise InputError(f"the job ran on {name!r}, not an {expected}; refusing it (costs measured on one card "
                         f"do not describe another)")
    return name


def _this_gpu() -> str:
    import torch

    return check_gpu(torch.cuda.get_device_name())


@app.function(gpu=GPU, timeout=3 * 3600, volumes={STATE: volume})
def calibrate_remote(name: str, options: list[str]) -> dict:
    """`python -m calibrate --out /state/NAME OPTIONS` on the A10; returns the table and its points file."""
    device = _this_gpu()
    from servecap.calibrate.cli import main
    from servecap.calibrate.store import points_path

    out = Path(STATE) / name
    stop = threading.Event()

    def commit() -> None:  # the points file must outlive a container that dies mid-calibration
        while not stop.wait(COMMIT_EVERY_S):
            volume.commit()

    threading.Thread(target=commit, daemon=True).start()
    try:
        rc = main(["--out", str(out), "--expect-gpu", GPU, *options])
    finally:
        stop.set()
        volume.commit()
    if rc:
        raise RuntimeError(f"calibration failed (exit status {rc}); the reason is in the log above")
    return {"device": device, "files": {p.name: p.read_bytes() for p in (out, points_path(out))}}


@app.function(gpu=GPU, timeout=2 * 3600)
def arrival_remote(rate: float, n: int, seed: int, backend: str, max_batch: int, pool_gib: float | None) -> dict:
    """One seeded Poisson arrival run (rate, n, seed) on the engine; returns its run-record files."""
    device = _this_gpu()
    from servecap.engine.engine import Engine, EngineConfig
    from servecap.traces.workload import poisson_trace

    from servecap.core.block_pool import PoolSize
    from servecap.core.config import ServingConfig

    engine = Engine(EngineConfig(ServingConfig(max_batch=max_batch, pool=PoolSize(gib=pool_gib)), expect_gpu=GPU))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        engine.run(poisson_trace(rate, n, seed), out, backend=backend, progress=False)
        return {"device": device, "files": {p.name: p.read_bytes() for p in sorted(out.iterdir())}}


def save_result(result: dict, directory: Path) -> list[Path]:
    """Write what a remote job returned under `directory`, once its card is known to be the right one."""
    check_gpu(result["device"])
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in result["files"].items():
        (directory / name).write_bytes(data)
        paths.append(directory / name)
    return paths


@app.local_entrypoint()
def main(out: str, quick: bool = False, backend: str = "", max_batch: int = 32, rate: float = 0.0, n: int = 400,
         seed: int = 0, pool_gib: float = 0.0) -> None:
    """Calibrate on an A10 and write the cost table to OUT (backends default paged,dense); with --rate, make
    one seeded arrival run (backend default paged) and write its run record into the directory OUT."""
    if rate > 0:
        result = arrival_remote.remote(rate, n, seed, backend or "paged", max_batch, pool_gib or None)
        paths = save_result(result, Path(out))
    else:
        options = ["--backend", backend or "paged,dense", "--max-batch", str(max_batch)]
        options += ["--quick"] if quick else []
        result = calibrate_remote.remote(Path(out).name, options)
        paths = save_result(result, Path(out).parent)
    print(f"{result['device']}: wrote " + ", ".join(map(str, paths)))
