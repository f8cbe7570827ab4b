"""Shared test setup. The engine's kernels must be imported before anything else imports triton, so that
on a CPU machine they run under Triton's interpreter (servecap.engine.kernels sets TRITON_INTERPRET; the
checkout's engine/ is only the shim for `python -m engine`, which imports nothing)."""
from contextlib import nullcontext
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
    if HAVE_TORCH:
        import torch
        if torch.cuda.is_available():
            return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def progress(request) -> Callable[[str], None]:
    """Writes a line to the terminal at once, past pytest's output capture: a test that runs for minutes under
    Triton's interpreter says where it is instead of sitting silent."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def line(text: str) -> None:
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
            reporter.write_line(f"  {request.node.name}: {text}")
    return line
