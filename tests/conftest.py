"""Shared test setup. The engine's kernels must be imported before anything else imports triton, so that
on a CPU machine they run under Triton's interpreter (servecap.engine.kernels sets TRITON_INTERPRET; the
checkout's engine/ is only the shim for `python -m engine`, which imports nothing)."""
import importlib.util
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import pytest

try:
    import servecap.engine.kernels  # noqa: F401
    HAVE_TORCH = True
except ImportError:  # the simulator's own tests run without torch
    HAVE_TORCH = False
else:
    import fast_interpreter
    fast_interpreter.install()  # half the interpreter's time computed nothing (tests/fast_interpreter.py)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: see slow_first
        items[:] = slow_first(items)
    if HAVE_TORCH:
        import torch
        if torch.cuda.is_available():
            return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def slow_first(items: list) -> list:
    """The tests marked slow (some seconds to a minute or two each under the interpreter) ahead of the rest, each
    group in its own order. Under pytest-xdist with `--dist load --maxschedchunk 2` (scripts/test.sh) the workers
    take the tests two at a time in this order, so the long ones start first, spread over both workers, and the
    many short ones even the workers out at the end. In collection order one worker could be left with a long test
    to run alone at the end."""
    slow = [i.get_closest_marker("slow") is not None for i in items]
    return [i for i, s in zip(items, slow) if s] + [i for i, s in zip(items, slow) if not s]


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def script(monkeypatch) -> Callable[[str], object]:
    """A script of scripts/ loaded as a module by its name, run from the repository's root (the committed
    validations' plans name their tables by paths from there)."""
    monkeypatch.chdir(ROOT)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


@pytest.fixture
def progress(request) -> Callable[[str], None]:
    """Writes a line to the terminal at once, past pytest's output capture: a test that runs for minutes under
    Triton's interpreter says where it is instead of sitting silent. A pytest-xdist worker's terminal reporter
    writes nowhere anyone sees, so there the line goes to the worker's stderr, which is the terminal's, with the
    worker's name."""
    config = request.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    worker = getattr(config, "workerinput", {}).get("workerid")

    def line(text: str) -> None:
        if reporter is None and worker is None:
            return
        with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
            if worker is None:
                reporter.write_line(f"  {request.node.name}: {text}")
            else:  # on a line of its own: the main process's dots have none after them
                sys.stderr.write(f"\n  [{worker}] {request.node.name}: {text}\n")
                sys.stderr.flush()
    return line
