"""What the notebooks share: where the data and the figures live, one look, and saving a figure with its caption.

Paths resolve against the repository root (this file's parent's parent), never the working directory:

    SERVECAP_TABLE       the cost table the simulator-only notebooks use (default servecap/costs/data/h200.json, the
                         shipped H200 table)
    SERVECAP_VALIDATION  the validation folder (default results/validation: plan.json, real/<point>/run-<k>/)
    SERVECAP_SAG         the sag search (default results/sag: search.json)
    SERVECAP_REQUESTS    requests per simulated trace in the notebooks' own sweeps (default 400, the seeded
                         workload's; fewer for a quick run)
    FIGURES_DIR          where the PNGs go (default notebooks/figures; notebooks/figures/scratch, which git
                         ignores, when any of the variables above points elsewhere)

A notebook that compares with real runs uses the cost table the validation plan names (its id is in plan.json),
not SERVECAP_TABLE: the predictions were made from it. That table is looked for where the plan says it was, then
beside the validation folder, then under results/calibration/.

A relative value is taken relative to the repository root too. Missing data stops a notebook with one line
naming the missing file and the command that makes it, and exit status MISSING_DATA (3).
"""
from __future__ import annotations

import json
import os
import sys
import textwrap
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's packages, whatever the working directory
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

IN_JUPYTER = "ipykernel" in sys.modules
if not IN_JUPYTER:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from servecap.traces.errors import InputError  # noqa: E402

TABLE_ENV, VALIDATION_ENV, SAG_ENV, FIGURES_ENV = "SERVECAP_TABLE", "SERVECAP_VALIDATION", "SERVECAP_SAG", "FIGURES_DIR"
REQUESTS_ENV = "SERVECAP_REQUESTS"
DEFAULT_TABLE = Path("servecap/costs/data/h200.json")
DEFAULT_VALIDATION = Path("results/validation")
DEFAULT_SAG = Path("results/sag")
DEFAULT_FIGURES = Path("notebooks/figures")
DEFAULT_REQUESTS = 400
CALIBRATIONS = Path("results/calibration")  # where a plan's table is looked for by its id
MISSING_DATA = 3

MAKE_TABLE = ("it is written by the GPU calibration: `python -m calibrate --out servecap/costs/data/h200.json "
              "--expect-gpu 'NVIDIA H200'` (or set SERVECAP_TABLE to a cost table you have)")
MAKE_PLAN = ("make it with `python -m validate plan --out results/validation` (CPU), then run the points with "
             "`python -m validate real --out results/validation` (GPU); or set SERVECAP_VALIDATION")
MAKE_REAL = ("run the plan's points on the engine: `python -m validate real --out results/validation` (GPU); "
             "or set SERVECAP_VALIDATION")
MAKE_SAG = "make it with `python -m validate sag --out results/sag` (CPU); or set SERVECAP_SAG"

# One look for every figure. Simulated: lines and open markers; measured on the engine: filled markers.
COLORS = {"paged": "tab:blue", "dense": "tab:orange", "padded": "tab:orange"}  # decode backends (padded: dense's old name)
POLICY_COLORS = {"padded": "tab:orange", "packed": "tab:green", "chunked": "tab:purple"}  # prefill policies
ROUTER_COLORS = {"round-robin": "tab:blue", "least-outstanding": "tab:green", "least-tokens": "tab:red"}
ROLE_COLORS = {"below": "tab:green", "near": "tab:olive", "past": "tab:red", "small-pool": "tab:purple",
               "backend": "tab:orange", "closed": "tab:gray", "public": "tab:cyan", "policy": "tab:brown",
               "sag": "tab:pink", "fleet": "tab:blue"}
SIM = dict(ls="-", lw=1.6)
SIM_POINT = dict(ls="none", marker="s", mfc="none", ms=8, mew=1.2)
REAL = dict(fmt="o", ms=6, capsize=3, elinewidth=1.2, mec="black", mew=0.5)
plt.rcParams.update({
    "figure.dpi": 100, "savefig.dpi": 120, "font.size": 9.5, "axes.titlesize": 10, "figure.titlesize": 12,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
    "legend.fontsize": 8, "legend.frameon": False,
})


def policy_color(policy: str) -> str:
    """A prefill policy's colour (chunked:N shares chunked's)."""
    return POLICY_COLORS.get(str(policy).partition(":")[0], "black")


def rel(path: Path) -> str:
    """A path as the user would type it: relative to the repository root when it is inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _env_path(var: str, default: Path) -> Path:
    value = os.environ.get(var)
    path = Path(value).expanduser() if value else default
    return path if path.is_absolute() else ROOT / path


def missing(path: Path, how: str):
    """Stop the notebook: `path` is not there, and `how` says what makes it."""
    print(f"missing data: {rel(path)} does not exist; {how}", file=sys.stderr, flush=True)
    raise SystemExit(MISSING_DATA)


def bad_input(err: Exception):
    print(f"bad input: {err}", file=sys.stderr, flush=True)
    raise SystemExit(MISSING_DATA)


# ---- cost tables -------------------------------------------------------------------------------------------
def stationarity_note(table) -> str:
    """'' for a table that passed its stationarity check; else what failed, for titles and captions."""
    s = table.stationarity
    if s is None:
        return "no stationarity check"
    if s["passed"]:
        return ""
    return (f"its stationarity check failed (first-run / repeat p95 "
            f"{max(s['prefill']['p95'], s['decode']['p95']):.2f} > {s['limit']:g})")


def table_label(table) -> str:
    """'cost table <id>' with its stationarity caveat, short, for every figure that uses it."""
    s = table.stationarity
    if s is not None and not s["passed"]:
        return (f"cost table {table.table_id} (stationarity check FAILED: p95 "
                f"{max(s['prefill']['p95'], s['decode']['p95']):.2f} > {s['limit']:g})")
    return f"cost table {table.table_id}"


def _load(path: Path, allow_nonstationary: bool):
    from servecap.sim.inputs import load_table as _load_table

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a missing stationarity check is said below, once
            return _load_table(path, allow_nonstationary=allow_nonstationary)
    except InputError as e:
        bad_input(e)


def _describe(table, path: Path, what: str, use: str = "") -> None:
    note = stationarity_note(table)
    print(f"{what}: {table.summary()}, {table.raw.get('name', '?')}, from {rel(path)}"
          + (f"\n  NOTE: {note}{use}" if note else ""))


def table_path() -> Path:
    path = _env_path(TABLE_ENV, DEFAULT_TABLE)
    if not path.exists():
        missing(path, MAKE_TABLE)
    return path


def load_table(allow_nonstationary: bool = False):
    """The cost table (SERVECAP_TABLE or the shipped one), checked for this model and block size: (CostTable, path).
    A table whose stationarity check failed is refused, as the simulator's CLI refuses it, unless allowed."""
    path = table_path()
    table = _load(path, allow_nonstationary)
    _describe(table, path, "cost table")
    return table, path


# ---- the validation ----------------------------------------------------------------------------------------
def validation_dir() -> Path:
    """The validation folder, with its plan and at least one complete real run."""
    out = _env_path(VALIDATION_ENV, DEFAULT_VALIDATION)
    if not (out / "plan.json").exists():
        missing(out / "plan.json", MAKE_PLAN)
    if not any(p.exists() for p in (out / "real").glob("*/run-*/meta.json")):
        missing(out / "real", MAKE_REAL)
    return out


def has_validation() -> bool:
    out = _env_path(VALIDATION_ENV, DEFAULT_VALIDATION)
    return (out / "plan.json").exists() and any((out / "real").glob("*/run-*/meta.json"))


def _table_id_of(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("table_id")
    except (OSError, ValueError, AttributeError):
        return None


def plan_table_path(vdir: Path, plan: dict) -> Path:
    """The cost table the plan was made from, found by its id: where the plan says it was, beside the validation
    folder, or under results/calibration/."""
    want = plan["table"]["id"]
    named = Path(plan["table"].get("path") or "")
    candidates = [named if named.is_absolute() else ROOT / named, vdir / named.name, vdir.parent / named.name]
    candidates += sorted((ROOT / CALIBRATIONS).rglob("*.json"))
    for c in candidates:
        if c.is_file() and c.suffix == ".json" and _table_id_of(c) == want:
            return c
    missing(Path(plan["table"].get("path") or f"cost table {want}"),
            f"the validation plan was made from cost table {want}; put that table under {CALIBRATIONS} (the "
            f"calibration that wrote it: `python -m calibrate --out TABLE.json`) so that its predictions can be "
            f"graded against it")


def validation():
    """The validation folder, its plan and points, and the plan's own cost table (loaded as the validation was
    graded: a failed stationarity check allowed, and said). Returns (vdir, plan, points, table, table_path)."""
    from servecap.validate.points import load_plan

    vdir = validation_dir()
    try:
        plan, points = load_plan(vdir)
    except InputError as e:
        bad_input(e)
    path = plan_table_path(vdir, plan)
    table = _load(path, allow_nonstationary=True)
    _describe(table, path, "the validation plan's cost table", "; used here as the validation was graded with it")
    return vdir, plan, points, table, path


# ---- the sag search ----------------------------------------------------------------------------------------
def sag_search() -> dict | None:
    """The sag search (SERVECAP_SAG/search.json), or None, said, where there is none."""
    path = _env_path(SAG_ENV, DEFAULT_SAG) / "search.json"
    if not path.exists():
        print(f"no sag search: {rel(path)} does not exist; {MAKE_SAG}")
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        bad_input(InputError(f"not valid JSON ({e})", path=path))


# ---- the notebooks' own simulations ------------------------------------------------------------------------
def requests() -> int:
    """Requests per simulated trace in a notebook's own sweeps (SERVECAP_REQUESTS, default 400)."""
    value = os.environ.get(REQUESTS_ENV) or str(DEFAULT_REQUESTS)
    if not value.isdigit() or int(value) < 2:
        bad_input(InputError(f"{REQUESTS_ENV} must be a whole number of requests >= 2, got {value!r}"))
    return int(value)


# ---- figures -----------------------------------------------------------------------------------------------
def _other_data() -> bool:
    """Whether the notebook reads data other than the committed defaults (a stand-in, another GPU's table) or
    simulates other than the default workload."""
    return requests() != DEFAULT_REQUESTS or any(
        os.environ.get(var) and _env_path(var, default).resolve() != (ROOT / default).resolve()
        for var, default in ((TABLE_ENV, DEFAULT_TABLE), (VALIDATION_ENV, DEFAULT_VALIDATION), (SAG_ENV, DEFAULT_SAG)))


def figures_dir() -> Path:
    """FIGURES_DIR; else notebooks/figures, or notebooks/figures/scratch (ignored by git) for other data, so
    that figures of stand-in data never land where the committed ones live."""
    if os.environ.get(FIGURES_ENV):
        d = _env_path(FIGURES_ENV, DEFAULT_FIGURES)
    elif _other_data():
        d = ROOT / DEFAULT_FIGURES / "scratch"
    else:
        d = ROOT / DEFAULT_FIGURES
    d.mkdir(parents=True, exist_ok=True)
    return d


def save(fig, name: str, caption: str) -> Path:
    """Write the figure as FIGURES_DIR/name.png with its caption along the bottom, and print the caption."""
    width, height = fig.get_size_inches()
    size = 9.0
    lines = textwrap.wrap(caption, int(width * 72 / (0.58 * size)))  # italic digits run wide
    room = (len(lines) * size * 1.35 + 8) / 72 / height
    fig.text(0.5, 0.008, "\n".join(lines), ha="center", va="bottom", fontsize=size, style="italic", color="0.25")
    for legend in fig.legends:  # a figure-wide legend (legend_once) goes between the axes and the caption
        legend.set_bbox_to_anchor((0.5, room), transform=fig.transFigure)
        room += legend.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi / height
    fig.tight_layout(rect=(0, room, 1, 1))
    path = figures_dir() / f"{name}.png"
    fig.savefig(path)
    print(f"{rel(path)}: {caption}")
    if IN_JUPYTER:
        from IPython.display import display
        display(fig)
    plt.close(fig)
    return path


def plain_ticks(ax, which: str = "both") -> None:
    """Plain numbers (0.5, 20, 300) on log axes instead of powers of ten; no labels on minor ticks."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for axis in ([ax.xaxis, ax.yaxis] if which == "both" else [getattr(ax, f"{which}axis")]):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def legend_once(fig, axes, **kw) -> None:
    """One legend for the figure from every axis' labelled handles, each label once."""
    seen = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), loc="lower center", **{"ncol": 4, **kw})


def gib_of_blocks(blocks: int) -> float:
    """A pool of `blocks` blocks in GiB of K/V, for the default serving configuration (Qwen2.5-1.5B, fp16)."""
    from servecap.core.block_pool import gib_of
    from servecap.core.config import ServingConfig

    serving = ServingConfig()
    return gib_of(blocks, serving.block_size, serving.kv_bytes_per_token)


def fmt_rate(x) -> str:
    return "-" if x is None or x != x else f"{x:.3g}"


def jobs() -> int:
    """Worker processes for sim.sweep.run_sweep: every core where workers fork; one where they would be spawned
    (a spawned worker would re-run the notebook)."""
    import multiprocessing

    return (os.cpu_count() or 1) if multiprocessing.get_start_method() == "fork" else 1


def capacity_sweep(table, configs: list, workload, fine: int = 4,
                   rates: list[float] | None = None) -> tuple[list, list[str]]:
    """sim.sweep.run_sweep at `rates` (None: automatic, 0.3x to 2x each configuration's saturated estimate), then
    `fine` more rates inside each capacity bracket."""
    import numpy as np

    from servecap.sim.sweep import run_sweep

    results, warned = run_sweep(table, configs, rates, workload, jobs=jobs(), progress=False)
    extra_args = []
    for res in results:
        lo, hi = res.bracket
        if fine and lo is not None and hi is not None:
            extra_args.append((res, [float(f"{r:.4g}") for r in np.geomspace(lo, hi, fine + 2)[1:-1]]))
    for res, more in extra_args:
        extra, w = run_sweep(table, [res.config], more, workload, jobs=1, progress=False)
        res.rows = sorted(res.rows + extra[0].rows, key=lambda r: r["rate"])
        warned += w
    for w in dict.fromkeys(warned):
        print("cost model:", w)
    return results, list(dict.fromkeys(warned))
