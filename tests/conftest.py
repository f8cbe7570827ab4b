"""Shared test setup. The engine's kernels must be imported before anything else imports triton, so that
on a CPU machine they run under Triton's interpreter (engine.kernels sets TRITON_INTERPRET)."""
import pytest

try:
    import engine.kernels  # noqa: F401
    HAVE_TORCH = True
except ImportError:  # the simulator's own tests run without torch
    HAVE_TORCH = False


def pytest_collection_modifyitems(config, items):
    if HAVE_TORCH:
        import torch
        if torch.cuda.is_available():
            return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
