"""The engine on the CPU (float32, kernels under the interpreter) with the scheduler's newer mechanisms: the
greedy tokens of a request are the same whatever the scheduler did with it. Preempted and recomputed (on-demand
admission on a pool that binds) against reserve-on-admit; decoded inside fused steps (mixed) against padded
prefill's separate steps; with its prompt's prefix read from cached blocks against computed whole."""
import pytest

torch = pytest.importorskip("torch")

from servecap.core.config import ServingConfig  # noqa: E402
from servecap.engine.engine import Engine, EngineConfig  # noqa: E402
from servecap.traces.workload import Request, Trace, length_trace  # noqa: E402

from helpers import StepReplay, interpreter_buckets  # noqa: E402

TINY = ServingConfig(model="tiny", dtype="float32", block_size=16, max_batch=4)


@pytest.fixture(scope="module")
def engine():
    """Prefill steps in the interpreter's 16-token buckets, each distinct step run once: the two runs of a test
    share their steps up to where the mechanism changes what the scheduler does (tests/helpers.py)."""
    with pytest.MonkeyPatch.context() as mp:
        interpreter_buckets(mp)
        e = Engine(EngineConfig(serving=TINY, max_prompt=80, max_budget=24, backends=("paged",), device="cpu"),
                   log=lambda *a: None)
    StepReplay(e)
    return e


def _tokens(rec) -> dict[int, list[int]]:
    return {rid: g.sort_values("index")["token_id"].tolist() for rid, g in rec.tokens.groupby("request_id")}


@pytest.mark.slow
def test_a_preempted_request_recomputes_to_the_same_tokens(engine, progress):
    trace = length_trace([(0.0, 40, 12), (0.0, 33, 12), (0.0, 20, 12)])
    progress("reserve-on-admit, a pool that never binds")
    want = engine.run(trace, None, tokens=True, progress=False, telemetry=False)
    progress("on-demand on 8 blocks of 16 tokens")
    got = engine.run(trace, None, tokens=True, progress=False, telemetry=False, pool_blocks=8,
                     admission="on-demand")
    assert got.requests.preemptions.sum() >= 1 and got.steps.recomputed.sum() > 0
    assert _tokens(got) == _tokens(want)


@pytest.mark.slow
def test_fused_steps_decode_the_same_tokens_as_separate_ones(engine, progress):
    trace = length_trace([(0.0, 9, 6), (0.0, 70, 6), (0.0, 33, 6)])
    progress("padded prefill")
    want = engine.run(trace, None, tokens=True, progress=False, telemetry=False)
    progress("mixed:24: chunks of prompts fused with decode rows")
    got = engine.run(trace, None, tokens=True, progress=False, telemetry=False, policy="mixed:24")
    assert (got.steps.kind == "mixed").any()
    assert _tokens(got) == _tokens(want)


@pytest.mark.slow
def test_a_cached_prefix_gives_the_same_tokens_as_computing_it(engine, progress):
    reqs = [Request(i, 0.05 * i, p, 5, hash_ids=h, hash_block=32)
            for i, (p, h) in enumerate([(70, (1, 2, 3)), (66, (1, 2, 4)), (70, (1, 2, 3))])]
    trace = Trace(reqs, {"kind": "test"})
    progress("prefix cache off")
    want = engine.run(trace, None, tokens=True, progress=False, telemetry=False)
    progress("prefix cache on")
    got = engine.run(trace, None, tokens=True, progress=False, telemetry=False, prefix_cache=True)
    assert got.requests.cached_tokens.sum() > 0
    assert _tokens(got) == _tokens(want)
