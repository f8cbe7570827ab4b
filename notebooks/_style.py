"""What the notebooks share: where the data and the figures live, one look, and saving a figure with its caption.

Paths resolve against the repository root (this file's parent's parent), never the working directory:

    SERVECAP_TABLE       the cost table         (default sim/data/h200.json, the shipped H200 table)
    SERVECAP_VALIDATION  the validation folder  (default results/validation: plan.json, real/<point>/run-<k>/)
    FIGURES_DIR          where the PNGs go      (default notebooks/figures; notebooks/figures/scratch, which
                                                 git ignores, when either data variable points elsewhere)

A relative value is taken relative to the repository root too. Missing data stops a notebook with one line
naming the missing file and the command that makes it, and exit status MISSING_DATA (3).
"""
from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's packages, whatever the working directory
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

IN_JUPYTER = "ipykernel" in sys.modules
if not IN_JUPYTER:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from traces.errors import InputError  # noqa: E402

TABLE_ENV, VALIDATION_ENV, FIGURES_ENV = "SERVECAP_TABLE", "SERVECAP_VALIDATION", "FIGURES_DIR"
DEFAULT_TABLE = Path("sim/data/h200.json")
DEFAULT_VALIDATION = Path("results/validation")
DEFAULT_FIGURES = Path("notebooks/figures")
MISSING_DATA = 3
BLOCK_SIZE = 64

MAKE_TABLE = ("it is written by the GPU calibration: `python -m calibrate --out sim/data/h200.json "
              "--expect-gpu 'NVIDIA H200'` (or set SERVECAP_TABLE to a cost table you have)")
MAKE_PLAN = ("make it with `python -m sim validate plan --out results/validation` (CPU), then run the points with "
             "`python -m sim validate real --out results/validation` (GPU); or set SERVECAP_VALIDATION")
MAKE_REAL = ("run the plan's points on the engine: `python -m sim validate real --out results/validation` (GPU); "
             "or set SERVECAP_VALIDATION")

# One look for every figure. Simulated: lines and open markers; measured on the engine: filled markers.
COLORS = {"paged": "tab:blue", "padded": "tab:orange"}
ROLE_COLORS = {"below": "tab:green", "near": "tab:olive", "past": "tab:red", "small-pool": "tab:purple",
               "backend": "tab:orange", "closed": "tab:gray", "azure": "tab:cyan"}
SIM = dict(ls="-", lw=1.6)
REAL = dict(fmt="o", ms=6, capsize=3, elinewidth=1.2, mec="black", mew=0.5)
plt.rcParams.update({
    "figure.dpi": 100, "savefig.dpi": 120, "font.size": 9.5, "axes.titlesize": 10, "figure.titlesize": 12,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
    "legend.fontsize": 8, "legend.frameon": False,
})


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


def table_path() -> Path:
    path = _env_path(TABLE_ENV, DEFAULT_TABLE)
    if not path.exists():
        missing(path, MAKE_TABLE)
    return path


def load_table() -> tuple[dict, Path]:
    """The cost table (SERVECAP_TABLE or the shipped one), checked for this model and block size."""
    from sim.inputs import load_table as _load

    path = table_path()
    try:
        table = _load(path, BLOCK_SIZE)
    except InputError as e:
        bad_input(e)
    print(f"cost table {table['table_id']} ({table.get('name', '?')}; device: {table['device']['name']}) "
          f"from {rel(path)}")
    return table, path


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


def _other_data() -> bool:
    """Whether the notebook reads data other than the committed defaults (a stand-in, another GPU's table)."""
    return any(os.environ.get(var) and _env_path(var, default).resolve() != (ROOT / default).resolve()
               for var, default in ((TABLE_ENV, DEFAULT_TABLE), (VALIDATION_ENV, DEFAULT_VALIDATION)))


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
    lines = textwrap.wrap(caption, int(width * 72 / (0.52 * size)))
    room = (len(lines) * size * 1.35 + 8) / 72 / height
    fig.text(0.5, 0.008, "\n".join(lines), ha="center", va="bottom", fontsize=size, style="italic", color="0.25")
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


def gib_of_blocks(blocks: int, block_size: int = BLOCK_SIZE) -> float:
    """A pool of `blocks` blocks in GiB of Qwen2.5-1.5B K/V."""
    from traces.model_spec import QWEN25_1P5B, kv_bytes_per_token

    return blocks * block_size * kv_bytes_per_token(QWEN25_1P5B) / 2**30


def fmt_rate(x) -> str:
    return "-" if x is None or x != x else f"{x:.3g}"


def capacity_sweep(table: dict, configs: list, workload, fine: int = 4) -> tuple[list, list[str]]:
    """sim.sweep.run_sweep with automatic rates (0.3x to 2x each configuration's saturated estimate), then `fine`
    more rates inside each capacity bracket. Worker processes only where they fork: a spawned worker would
    re-run the notebook."""
    import multiprocessing

    import numpy as np

    from sim.sweep import run_sweep

    jobs = (os.cpu_count() or 1) if multiprocessing.get_start_method() == "fork" else 1
    results, warned = run_sweep(table, configs, None, workload, jobs=jobs, progress=False)
    for res in results:
        lo, hi = res.bracket
        if fine and lo is not None and hi is not None:
            rates = [float(f"{r:.4g}") for r in np.geomspace(lo, hi, fine + 2)[1:-1]]
            extra, w = run_sweep(table, [res.config], rates, workload, jobs=1, progress=False)
            res.rows = sorted(res.rows + extra[0].rows, key=lambda r: r["rate"])
            warned += w
    for w in dict.fromkeys(warned):
        print("cost model:", w)
    return results, list(dict.fromkeys(warned))
