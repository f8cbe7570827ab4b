"""The real runs of a validation plan, on the GPU engine.

Points are run in plan order; a point marked `fresh` starts a new engine and runs first on it, so that its trace
is the first thing that engine ever serves. Points with complete records are kept, not re-run; an interrupted
point is run again from its start (`pending`, `validate real --pending`, says which are left, without a GPU).
`--shard i/n` runs the i-th of n shares of the engines' points, shares of about equal predicted GPU time (one
process per GPU).
"""
from __future__ import annotations

from pathlib import Path

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.traces.errors import InputError

from .points import Point, build_trace, is_complete, load_plan, run_dir, select

NOTHING_LEFT = "every point of this shard already has its real records"


def engine_batches(points: list[Point]) -> list[list[Point]]:
    """Points grouped by the engine that runs them: each fresh point opens a new engine (one per repeat, so that
    every repeat is the first thing its engine serves: engine_runs); the rest share one, or are spread over the
    fresh engines (each after its own first pass), so no engine starts only for them."""
    fresh = [[p] for p in points if p.fresh]
    rest = [p for p in points if not p.fresh]
    if not fresh:
        return [rest] if rest else []
    for i, p in enumerate(rest):
        fresh[i % len(fresh)].append(p)
    return fresh


def engine_runs(batch: list[Point], out: Path) -> list[list[tuple[Point, int]]]:
    """The (point, repeat) runs still to make, one list per engine: a fresh point's repeats each on an engine of its
    own (with the points that share it after its first repeat), the others together."""
    todo = [(p, k) for p in batch for k in range(1, p.repeats + 1) if not is_complete(run_dir(out, p, k))]
    if not batch[0].fresh:
        return [todo]
    first = [(p, k) for p, k in todo if p is batch[0]]
    rest = [(p, k) for p, k in todo if p is not batch[0]]
    engines = [[run] for run in first] or [[]]
    engines[0] += rest
    return [e for e in engines if e]


def shares(batches: list[list[Point]], n: int, predictions: dict) -> list[list[list[Point]]]:
    """The engines' batches in n shares of about equal GPU time (by the plan's own predicted wall times), the
    longest batch first to the least loaded share; each share then runs its batches in plan order, so that a call
    cut short by its deadline has made the plan's first points, not its longest."""
    seconds = [sum((p.warmup + p.repeats) * (predictions[p.id].get("wall_time_s") or 0.0) for p in b)
               for b in batches]
    out: list[list[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    for i in sorted(range(len(batches)), key=seconds.__getitem__, reverse=True):
        j = load.index(min(load))
        out[j].append(i)
        load[j] += seconds[i]
    return [[batches[i] for i in sorted(share)] for share in out]


def pending(out: Path, only: list[str] | None = None,
            shard: tuple[int, int] = (0, 1)) -> tuple[dict, list[Point], list[list[tuple[Point, int]]]]:
    """The plan, this shard's single-engine points, and the (point, repeat) runs it has still to make (missing, or
    interrupted: no complete record), one list per engine. CPU only: what a GPU call has left, before it is made."""
    plan, points = load_plan(out)
    points = [p for p in points if p.serving.replicas == 1]
    if only:
        points, _ = select(points, only)
    i, n = shard
    batches = shares(engine_batches(points), n, plan["predictions"])[i]
    return plan, [p for b in batches for p in b], [runs for b in batches for runs in engine_runs(b, out)]


def describe_pending(plan: dict, points: list[Point], engines: list[list[tuple[Point, int]]]) -> str:
    """`validate real --pending`: how many runs are made, which are left by point, the serving time they will take
    by the plan's predicted wall times (a point's warm-up passes go with its first repeat), and the --only that
    runs them."""
    runs = [run for engine in engines for run in engine]
    if not runs:
        return NOTHING_LEFT
    left: dict[str, list[int]] = {}
    for p, k in runs:
        left.setdefault(p.id, []).append(k)
    seconds = sum((plan["predictions"][p.id].get("wall_time_s") or 0.0) * (1 + (p.warmup if k == 1 else 0))
                  for p, k in runs)
    total = sum(p.repeats for p in points)
    return "\n".join([f"{total - len(runs)} of {total} runs made; {len(runs)} left on {len(engines)} engine(s), about "
                      f"{seconds:.0f} s of serving by the plan's predicted wall times (engine starts not counted):",
                      *(f"  {pid:40s} run {', '.join(map(str, ks))}" for pid, ks in left.items()),
                      "--only " + ",".join(left)])


def run_real(out: Path, expect_gpu: str | None = None, only: list[str] | None = None,
             shard: tuple[int, int] = (0, 1)) -> None:
    """Every point (and repeat) of this shard on the engine."""
    from servecap.engine.engine import Engine, EngineConfig  # the GPU side only
    from tqdm import tqdm

    plan, _, todo = pending(out, only, shard)
    if not todo:
        print(NOTHING_LEFT)
        return
    i, n = shard
    bar = tqdm(total=sum(map(len, todo)), desc=f"real runs (shard {i + 1}/{n})", unit="run")
    for runs in todo:
        traces = {p.id: build_trace(p.trace, out) for p, _ in runs}
        reqs = [r for t in traces.values() for r in t.requests]
        caps = [p.serving.max_num_batched_tokens for p, _ in runs]
        cap = None if None in caps else max(caps)  # the engine's largest step: what its points ask for
        engine = Engine(EngineConfig(ServingConfig(max_batch=max(p.serving.max_batch for p, _ in runs),
                                                   max_num_batched_tokens=cap),
                                     max_prompt=max(4096, *(r.prompt_tokens for r in reqs)),
                                     max_budget=max(256, *(r.budget for r in reqs)), expect_gpu=expect_gpu))
        for p, k in runs:
            trace = traces[p.id]
            memory = dict(admission=str(p.serving.admission), prefix_cache=p.serving.prefix_cache,
                          max_num_batched_tokens=p.serving.max_num_batched_tokens)
            pool = None if p.serving.pool.unbounded else p.serving.pool.num_blocks(
                engine.cfg.serving.block_size, engine.kv_bytes_per_token, p.serving.max_batch, engine.cfg.max_tokens)
            if k == 1:
                for _ in range(p.warmup):
                    engine.run(trace, None, p.serving.backend, tokens=False, pool_blocks=pool,
                               max_batch=p.serving.max_batch, policy=str(p.serving.prefill), progress=False, **memory)
            d = run_dir(out, p, k)
            if d.exists():  # an interrupted run: start the point again
                for f in d.iterdir():
                    f.unlink()
            engine.run(trace, d, p.serving.backend, tokens=p.tokens, pool_blocks=pool, max_batch=p.serving.max_batch,
                       policy=str(p.serving.prefill), progress=False, **memory,
                       extra_meta={"validation_point": p.id, "repeat": k, "warmup_runs": p.warmup,
                                   "plan_table_id": plan["table"]["id"], "fresh_engine": p.fresh and (p, k) == runs[0]})
            bar.update()
        engine.close()
    bar.close()


def run_fleet(out: Path, devices: list[str], expect_gpu: str | None = None, only: list[str] | None = None) -> None:
    """The plan's fleet points, each on fresh replica processes, one per device (servecap/engine/fleet.py). Two replicas on
    one GPU share it: each then gets half of what one engine would size its pool from."""
    from servecap.engine.fleet import serve_fleet

    plan, points = load_plan(out)
    points = [p for p in points if p.serving.replicas > 1]
    if only:
        points, _ = select(points, only)
    shared = len(set(devices)) < len(devices)
    for p in points:
        if len(devices) != p.serving.replicas:
            raise InputError(f"point {p.id} has {p.serving.replicas} replicas; --fleet names {len(devices)} devices")
        d = run_dir(out, p, 1)
        if is_complete(d):
            continue
        if d.exists():  # an interrupted fleet run: start it again
            import shutil
            shutil.rmtree(d)
        cfg = {"expect_gpu": expect_gpu,
               "serving": p.serving.but(pool=PoolSize(gib=24.0) if shared else PoolSize(), replicas=1)}
        serve_fleet(build_trace(p.trace, out), d, p.serving.router, devices, cfg,
                    {"backend": p.serving.backend, "tokens": p.tokens, "policy": str(p.serving.prefill),
                     "extra_meta": {"validation_point": p.id, "repeat": 1, "plan_table_id": plan["table"]["id"],
                                    "shared_gpu": shared}})
