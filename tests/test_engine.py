"""The engine on the CPU: token parity with HF transformers in float32 at small shapes, with the Triton kernels
under the interpreter, and its refusals of bad input."""
import json
import time

import pytest

torch = pytest.importorskip("torch")

from servecap.core.block_pool import PoolSize  # noqa: E402
from servecap.core.config import ServingConfig  # noqa: E402
from servecap.engine.engine import Engine, EngineConfig  # noqa: E402
from servecap.engine.parity import reference, run_gate, scenarios  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.records import read_run  # noqa: E402
from servecap.traces.workload import Request, Trace, length_trace  # noqa: E402

from helpers import StepReplay, interpreter_buckets  # noqa: E402

TINY = ServingConfig(model="tiny", dtype="float32", block_size=16)


def cpu(max_batch: int = 32, **serving) -> dict:
    """EngineConfig arguments for the tiny model on the CPU."""
    return dict(serving=TINY.but(max_batch=max_batch, **serving), device="cpu")


ENGINE = dict(max_prompt=80, max_budget=16, **cpu(8))
GATE_BUDGET = 6
GATE = scenarios(ENGINE["max_prompt"], GATE_BUDGET)
# Chunks of two and a half blocks: prefixes that end inside a block, and under half the interpreted steps of the
# default 16-token chunks (each chunk runs in a 48-token bucket under the interpreter).
GATE_PREFILL = ("packed", "chunked:40")


def _interpreted_engine(**kwargs) -> Engine:
    """An engine whose prefill steps round up to the interpreter's 16-token tile, each distinct step run once
    (tests/helpers.py: interpreter_buckets, StepReplay)."""
    with pytest.MonkeyPatch.context() as mp:
        interpreter_buckets(mp)
        e = Engine(EngineConfig(**ENGINE, **kwargs), log=lambda *a: None)
    e.replay = StepReplay(e)
    return e


@pytest.fixture(scope="module")
def engine():
    return _interpreted_engine()


@pytest.fixture(scope="module")
def paged_engine():
    """The same model (seeded weights) with the paged decode backend only."""
    return _interpreted_engine(backends=("paged",))


def _same_lengths_throughout(trace, rows: int) -> bool:
    """Every row as long as every other at every decode step (one group of equal requests): the padded backend's
    span is each row's own length, so it runs the paged backend's arithmetic exactly, which the interpreter need
    not run twice (the kernel tests compare the two on ragged rows)."""
    return len(trace) <= rows and len({(r.prompt_tokens, r.budget) for r in trace.requests}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(GATE))
def test_paged_engine_matches_hf_generate_token_for_token(engine, paged_engine, scenario, progress, monkeypatch):
    trace, rows = GATE[scenario]
    on = paged_engine if _same_lengths_throughout(trace, rows) else engine
    run = on.run

    def said(*args, **kwargs):  # a line per engine run: some take a minute under the interpreter
        t, before = time.process_time(), on.replay.counts()
        rec = run(*args, **kwargs)
        (ran, replayed), (ran0, replayed0) = on.replay.counts(), before
        backend = kwargs.get("backend", args[2] if len(args) > 2 else "paged")
        progress(f"{backend} backend, {kwargs.get('policy', 'padded')} prefill, "
                 f"{kwargs.get('admission', 'reserve')} admission: {time.process_time() - t:.0f} s CPU "
                 f"({ran - ran0} steps interpreted, {replayed - replayed0} replayed)")
        return rec
    monkeypatch.setattr(on, "run", said)
    mismatches, compared = run_gate(on, budget=GATE_BUDGET, log=progress, only={scenario}, prefill=GATE_PREFILL,
                                    on_demand=False)  # on-demand and fused steps: tests/test_engine_mechanisms.py
    # Each request's tokens against the reference on each backend, paged against padded (where both run), and
    # packed and chunked prefill against padded.
    pairs = len(on.cfg.backends) + (len(on.cfg.backends) == 2) + 2
    assert compared == pairs * sum(r.budget for r in trace.requests)
    assert mismatches == []


def test_reference_tokens_depend_on_the_context(engine):
    # A model that echoed its last token would make parity meaningless; this one does not.
    ref = reference(engine, 40, 8)
    assert len(set(ref.tokens)) > 2
    assert ref.diff < 1e-4 and min(ref.margins) > 0 and min(ref.scales) > 0


def test_gate_covers_the_writeups_scenarios():
    names = scenarios(80, 6)
    assert {"uniform-4", "mixed-batch", "8-through-4"} <= set(names)
    trace, rows = names["8-through-4"]
    assert len(trace) == 8 and rows == 4


def test_bad_requests_are_refused_at_submit_and_the_rest_served(engine, tmp_path):
    reqs = [Request(0, 0.0, 20, 4), Request(1, 0.0, 0, 4), Request(2, 0.0, 10, 0), Request(0, 0.0, 12, 3),
            Request(3, 0.0, 95, 4), Request(4, 0.001, 30, 5)]
    rec = engine.run(Trace(reqs, {"kind": "bad-input"}), tmp_path / "run", "paged", progress=False)
    reasons = dict(zip(rec.rejected.request_id, rec.rejected.reason))
    assert sorted(rec.requests.request_id) == [0, 4]
    assert len(rec.rejected) == 4
    text = " ".join(rec.rejected.reason)
    for words in ("empty prompt", "budget must be at least 1", "submitted twice", "beyond the model's 96 positions"):
        assert words in text
    assert reasons[1].startswith("request 1")
    assert (rec.requests.output_tokens == [4, 5]).all()
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["model"]["weights"] == "random(seed=0)"
    assert meta["device"]["name"] == "cpu" and meta["trace_id"] == Trace(reqs).trace_id


def test_a_request_larger_than_the_run_pool_is_refused_at_submit(engine):
    rec = engine.run(length_trace([(0.0, 70, 16), (0.0, 10, 4)]), None, "paged", pool_blocks=5, progress=False)
    assert rec.requests.request_id.tolist() == [1]
    assert "needs 6 blocks" in rec.rejected.reason[0] and "the pool has 5" in rec.rejected.reason[0]


def test_records_are_written_as_rows_complete(engine, tmp_path):
    rec = engine.run(length_trace([(0.0, 17, 5), (0.0, 33, 3)]), tmp_path / "r", "dense", progress=False)
    again = read_run(tmp_path / "r")
    assert len(again.tokens) == 8 and set(again.steps.kind) == {"prefill", "decode"}
    assert (again.requests.finished >= again.requests.first_token).all()
    assert again.tokens.token_id.ge(0).all()
    assert rec.meta["backend"] == "dense"


def test_a_pool_that_cannot_hold_the_largest_request_is_refused_at_start():
    with pytest.raises(InputError, match="cannot hold the largest request"):
        Engine(EngineConfig(max_prompt=80, max_budget=16, **cpu(2, pool=PoolSize(blocks=3))), log=lambda *a: None)


def test_another_gpu_than_the_named_one_is_refused_before_any_work():
    with pytest.raises(InputError, match="not the expected 'NVIDIA H200'"):
        Engine(EngineConfig(expect_gpu="NVIDIA H200", **cpu()), log=lambda *a: None)


def test_a_prefill_bucket_longer_than_the_models_positions_stays_inside_them(monkeypatch):
    """Steps round up to a token bucket, whose padding is computed too: its positions must still index the RoPE
    table (max prompt 32 + budget 5 = 37 positions; a 21-token prompt runs in a 64-token bucket)."""
    import servecap.engine.qwen2 as qwen2

    seen = []
    real = qwen2.rope_kv

    def rope_kv(qkv, positions, *args, **kwargs):
        seen.append(int(positions.max()))
        return real(qkv, positions, *args, **kwargs)

    monkeypatch.setattr(qwen2, "rope_kv", rope_kv)
    small = Engine(EngineConfig(max_prompt=32, max_budget=5, **cpu(2, block_size=64)),
                   log=lambda *a: None)
    assert small.runner.bucket(21) == 64
    small.run(length_trace([(0.0, 21, 2)]), None, "paged", progress=False)
    assert seen and max(seen) < 37


def test_a_decode_step_launched_before_the_prefill_tokens_are_read_takes_them_on_the_device(engine, monkeypatch):
    """On a GPU the pass's first decode step is launched right behind its prefill step, before the host has read
    that step's tokens (EngineTimer.prefill): the rows it completes take their token on the device (the runner's
    feed). The CPU's runner is synchronous and launches after the read, with the host's tokens and no feed; here
    the GPU's order is forced, and the tokens must be the same. Without the feed the decode step would read what
    its input buffer last held."""
    from servecap.engine.serve import EngineTimer

    trace = length_trace([(0.0, 20, 5), (0.0, 33, 4), (0.0, 9, 6)])
    runner, feeds = engine.runner, []
    feed = runner._feed
    monkeypatch.setattr(runner, "_feed", lambda n: (feeds.append(n), feed(n)))

    def tokens():
        rec = engine.run(trace, None, "paged", policy="packed", progress=False, telemetry=False)
        return rec.tokens.sort_values(["request_id", "index"]).token_id.tolist(), len(feeds)
    after, fed_after = tokens()

    def behind(self, work, start, then=None):  # the asynchronous runner's order, on the synchronous one
        self.runner.launch_prefill(work)
        if then:
            self.runner.launch_decode(then, self.backend)
        tokens = self.runner.prefill_result()
        self._first = then
        return tokens, self.clock.now()
    monkeypatch.setattr(EngineTimer, "prefill", behind)
    before, fed_before = tokens()
    assert fed_after == 0 and fed_before > fed_after
    assert before == after and len(after) == 15
