"""Cost tables: the step costs measured on one GPU, the simulator's only input about the hardware.

A table (JSON) holds the measured points (median and spread), the fitted model that prices shapes between them
(servecap/costs/model.py), the stationarity check that says a step's cost depended on its shape alone, and where it was
measured: device and GPU UUID, software, model, git commit, date. `load_cost_table` checks all of it once and
returns a CostTable; nothing downstream re-reads the file or re-checks a field.

Versions: 1 measured padded prefill groups only (points keyed by width x padded length); 2 keys every prefill
point by its shape (rows, tokens, attention work; servecap/costs/shapes.py) and the prefill policy that made it, and adds
the stationarity check; 3 may add a serving-context correction (servecap/costs/context.py: factors fitted from real runs by
`python -m calibrate --from-runs`). Version-1 tables are still read: their points and fit are seen through version
2's shape; a table without a correction prices every step as version 2 did.
"""
from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

from servecap.traces.csvio import atomic_write_text, read_text
from servecap.traces.errors import InputError

from .context import check_correction
from .shapes import BACKENDS, RENAMED_BACKENDS, PrefillShape, backend_named

SCHEMA = "cost-table"
VERSION = 2  # what a calibration writes; a table with a correction is CORRECTED_VERSION
CORRECTED_VERSION = 3
READS = (1, 2, 3)
STATIONARITY_LIMIT = 1.15  # the p95 of first-run / repeat step times a table may show and still be used
_POINT_KEYS = {1: {"prefill": ("width", "padded_len")}, 2: {"prefill": ("rows", "tokens", "attn")},
               3: {"prefill": ("rows", "tokens", "attn")}}
_DECODE_KEYS = ("rows", "kv_tokens", "kv_max", "kv_read")
_STAT_KEYS = ("median_s", "p10_s", "p90_s", "n")
# A measured table's sizes are far below these. Past them, checking the fit (which prices every batch size up to
# max_batch) would take minutes, and token counts would leave int64.
SIZE_LIMITS = {"block_size": 2 ** 16, "max_batch": 1024, "max_tokens": 2 ** 24}
PREFILL_PARAMS = ("floor_s", "floor_per_row_s", "base_s", "per_token_s", "per_token2_s", "sharpness")
PREFIX_PARAM = "per_prefix_token2_s"  # optional: attention over pool K/V priced apart (servecap/costs/model.py)
PATH_PARAM = "per_path_key_s"  # optional: the longest attention program's keys (tables with fused steps; same)
# optional, where the engine attends a fused step's decode rows with its decode kernel: per K/V token they hold, and
# fixed (servecap/costs/model.py mixed_decode_terms)
MIXED_PER_TOKEN_PARAM, MIXED_FIXED_PARAM = "mixed_decode_per_token_s", "mixed_decode_s"
# The engine section's word for how a fused step's decode rows attend: "paged" (the decode kernel); absent, an engine
# that ran them through the prefill kernel.
MIXED_DECODE_KEY = "mixed_decode_attention"


def decode_rows_apart(engine: dict | None) -> bool:
    """Whether a table's engine attends a fused step's decode rows with its paged decode kernel."""
    return (engine or {}).get(MIXED_DECODE_KEY) == "paged"


class StationarityWarning(UserWarning):
    pass


def table_id(table: dict) -> str:
    body = {k: v for k, v in table.items() if k != "table_id"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _need(d: dict, key: str, where: str, path, kind=None):
    if not isinstance(d, dict) or key not in d:
        raise InputError(f"missing {where}{key!r}", path=path)
    if kind is not None and not isinstance(d[key], kind):
        raise InputError(f"{where}{key!r} should be {getattr(kind, '__name__', kind)}, got {type(d[key]).__name__}", path=path)
    return d[key]


def _number(v, where: str, path, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise InputError(f"{where} must be a {'positive' if positive else 'non-negative'} finite number, got {v!r}",
                         path=path)
    return float(v)


def _check_points(points: list, keys: tuple[str, ...], where: str, path) -> None:
    if not points:
        raise InputError(f"{where} has no measured points", path=path)
    for i, p in enumerate(points):
        here = f"{where}[{i}]."
        for k in keys:
            v = _need(p, k, here, path)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InputError(f"{here}{k} must be a positive integer, got {v!r}", path=path)
        for k in _STAT_KEYS:
            _number(_need(p, k, here, path), f"{here}{k}", path, positive=True)
        if not p["p10_s"] <= p["median_s"] <= p["p90_s"]:
            raise InputError(f"{here} needs p10_s <= median_s <= p90_s, got {p['p10_s']}, {p['median_s']}, {p['p90_s']}",
                             path=path)


def _check_range(r, where: str, path) -> None:
    if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                        and math.isfinite(x) and x > 0 for x in r) and r[0] <= r[1]):
        raise InputError(f"{where} must be [low, high] with 0 < low <= high, got {r!r}", path=path)


def _check_fit(table: dict, path) -> None:
    """The fitted model's parameters: present, finite, non-negative (positive where a zero would be unphysical),
    and shaped like the points they were fitted to."""
    fit = _need(table, "fit", "", path, dict)
    p = _need(fit, "prefill", "fit.", path, dict)
    if p.get("method") != "smooth-max":
        raise InputError(f"fit.prefill has method {p.get('method')!r}; this version reads 'smooth-max': calibrate "
                         f"again with python -m calibrate", path=path)
    for k in PREFILL_PARAMS:
        _number(_need(p, k, "fit.prefill.", path), f"fit.prefill.{k}", path,
                positive=k == "sharpness")
    for k in (PREFIX_PARAM, PATH_PARAM, MIXED_PER_TOKEN_PARAM, MIXED_FIXED_PARAM):
        if k in p:
            _number(p[k], f"fit.prefill.{k}", path)
    if PATH_PARAM in p and PREFIX_PARAM not in p:
        raise InputError(f"fit.prefill.{PATH_PARAM} comes with {PREFIX_PARAM}", path=path)
    for k in (("widths", "lengths") if table["version"] == 1 else ("rows", "tokens", "span")):
        _check_range(_need(p, k, "fit.prefill.", path), f"fit.prefill.{k}", path)
    _number(_need(p, "sigma", "fit.prefill.", path), "fit.prefill.sigma", path)
    decode = _need(fit, "decode", "fit.", path, dict)
    if set(decode) != set(table["decode"]):
        raise InputError(f"fit.decode covers backends {sorted(decode)}, the points {sorted(table['decode'])}", path=path)
    for b, d in decode.items():
        where = f"fit.decode.{b}."
        rows = _need(d, "rows", where, path, list)
        knots = _need(d, "knots", where, path, list)
        per_token = _need(d, "per_token_s", where, path, list)
        if not rows or any(isinstance(r, bool) or not isinstance(r, int) or r <= 0 for r in rows) or rows != sorted(set(rows)):
            raise InputError(f"{where}rows must be increasing positive integers, got {rows!r}", path=path)
        if len(knots) != len(rows) or len(per_token) != len(rows):
            raise InputError(f"{where}knots and per_token_s need one entry per row count ({len(rows)}), got "
                             f"{len(knots)} and {len(per_token)}", path=path)
        for i, ks in enumerate(knots):
            if not isinstance(ks, list) or not ks or any(not isinstance(k, list) or len(k) != 2 for k in ks):
                raise InputError(f"{where}knots[{i}] must be a non-empty list of [length, seconds]", path=path)
            lengths = [_number(k[0], f"{where}knots[{i}] length", path, positive=True) for k in ks]
            for k in ks:
                _number(k[1], f"{where}knots[{i}] seconds", path, positive=True)
            if lengths != sorted(set(lengths)):
                raise InputError(f"{where}knots[{i}] lengths must increase, got {lengths}", path=path)
        for i, v in enumerate(per_token):
            _number(v, f"{where}per_token_s[{i}]", path)
        _number(_need(d, "sigma", where, path), f"{where}sigma", path)
    overhead = table.get("overhead", {})
    if not isinstance(overhead, dict):
        raise InputError("overhead must be an object", path=path)
    if "retire_s" in overhead:
        _number(overhead["retire_s"], "overhead.retire_s", path)


def _check_stationarity(s, path) -> None:
    if not isinstance(s, dict):
        raise InputError("stationarity must be an object", path=path)
    _number(_need(s, "limit", "stationarity.", path), "stationarity.limit", path, positive=True)
    if not isinstance(_need(s, "passed", "stationarity.", path), bool):
        raise InputError("stationarity.passed must be true or false", path=path)
    for kind in ("prefill", "decode"):
        summary = _need(s, kind, "stationarity.", path, dict)
        for k in ("median", "p95", "max"):
            _number(_need(summary, k, f"stationarity.{kind}.", path), f"stationarity.{kind}.{k}", path, positive=True)


def check_table(table: dict, path: str | Path | None = None) -> dict:
    """Check a cost table's structure and values; raise InputError naming the first bad field."""
    if not isinstance(table, dict):
        raise InputError("a cost table is a JSON object", path=path)
    if table.get("schema") != SCHEMA:
        raise InputError(f"is a {table.get('schema')!r} file, expected {SCHEMA!r}", path=path)
    version = table.get("version")
    if version not in READS:
        raise InputError(f"cost-table version {version!r} is not one this reader knows ({', '.join(map(str, READS))})",
                         path=path)
    device = _need(table, "device", "", path, dict)
    _need(device, "name", "device.", path, str)
    model = _need(table, "model", "", path, dict)
    for k in ("name", "config_hash", "dtype"):
        _need(model, k, "model.", path, str)
    for k in ("block_size", "max_batch", "max_tokens"):
        v = _need(table, k, "", path, int)
        if isinstance(v, bool) or not 0 < v <= SIZE_LIMITS[k]:
            raise InputError(f"{k} must be a positive integer up to {SIZE_LIMITS[k]}, got {v}", path=path)
    points = _need(_need(table, "prefill", "", path, dict), "points", "prefill.", path, list)
    _check_points(points, _POINT_KEYS[version]["prefill"], "prefill.points", path)
    if version >= 2:
        for i, p in enumerate(points):
            # The name of the policy whose step it measured; which names exist is core.policies' registry's to say.
            if not (isinstance(p.get("policy"), str) and p["policy"].isidentifier()):
                raise InputError(f"prefill.points[{i}].policy must name a prefill policy, got {p.get('policy')!r}",
                                 path=path)
    decode = _need(table, "decode", "", path, dict)
    if not decode:
        raise InputError("decode has no backends", path=path)
    for backend, d in decode.items():
        if backend_named(backend) not in BACKENDS:
            raise InputError(f"decode has an unknown backend {backend!r} (known: {', '.join(BACKENDS)})", path=path)
        _check_points(_need(d, "points", f"decode.{backend}.", path, list), _DECODE_KEYS, f"decode.{backend}.points", path)
        too_wide = [p["rows"] for p in d["points"] if p["rows"] > table["max_batch"]]
        if too_wide:
            raise InputError(f"decode.{backend} has points with rows {too_wide} above max_batch {table['max_batch']}",
                             path=path)
    engine = table.get("engine") if isinstance(table.get("engine"), dict) else {}
    mixed = engine.get(MIXED_DECODE_KEY)
    if mixed is not None and not decode_rows_apart(engine):  # the one way besides the prefill kernel
        raise InputError(f"engine.{MIXED_DECODE_KEY} must be 'paged' or absent, got {mixed!r}", path=path)
    _check_fit(table, path)
    if version >= 2 and "stationarity" in table:
        _check_stationarity(table["stationarity"], path)
    if "correction" in table:
        if version < 3:
            raise InputError(f"a version-{version} table has no correction section; version 3 adds it", path=path)

        def error(message: str):
            raise InputError(message, path=path)
        check_correction(table["correction"], path, error)
    tid = _need(table, "table_id", "", path, str)
    if tid != table_id(table):
        raise InputError("table_id does not match the content (edited by hand?)", path=path)
    return table


@dataclass(frozen=True)
class CostTable:
    """A checked cost table. `raw` is the JSON object as stored; the properties read it in version 2's terms."""

    raw: dict
    path: Path | None = None

    @property
    def table_id(self) -> str:
        return self.raw["table_id"]

    @property
    def version(self) -> int:
        return self.raw["version"]

    @property
    def device(self) -> dict:
        return self.raw["device"]

    @property
    def device_name(self) -> str:
        return self.raw["device"]["name"]

    @property
    def gpu_uuid(self) -> str | None:
        return self.raw["device"].get("uuid")

    @property
    def model(self) -> dict:
        return self.raw["model"]

    @property
    def block_size(self) -> int:
        return self.raw["block_size"]

    @property
    def max_batch(self) -> int:
        return self.raw["max_batch"]

    @property
    def max_tokens(self) -> int:
        return self.raw["max_tokens"]

    @property
    def created_at(self) -> str | None:
        return self.raw.get("created_at")

    @property
    def backends(self) -> tuple[str, ...]:
        """The decode backends it prices, in BACKENDS' order (paged first), whatever the file's."""
        return tuple(b for b in BACKENDS if b in self.raw["decode"])

    @property
    def fit(self) -> dict:
        return self.raw["fit"]

    @property
    def retire_s(self) -> float:
        return float(self.raw.get("overhead", {}).get("retire_s", 0.0))

    @property
    def correction(self) -> dict | None:
        """The serving-context correction (servecap/costs/context.py), where the table has one."""
        return self.raw.get("correction")

    @property
    def stationarity(self) -> dict | None:
        return self.raw.get("stationarity")

    def prefill_points(self) -> list[dict]:
        """Every prefill point with its shape (rows, tokens, attn) and policy, whatever the table's version."""
        if self.version >= 2:
            return list(self.raw["prefill"]["points"])
        out = []
        for p in self.raw["prefill"]["points"]:
            s = PrefillShape.padded(p["width"], p["padded_len"])
            out.append({**p, "policy": "padded", "rows": s.rows, "tokens": s.tokens, "attn": s.attn})
        return out

    @property
    def policies(self) -> tuple[str, ...]:
        """The prefill policies whose step shapes the table measured."""
        return tuple(dict.fromkeys(p["policy"] for p in self.prefill_points()))

    def summary(self) -> str:
        return f"cost table {self.table_id} ({self.device_name}{', GPU ' + self.gpu_uuid if self.gpu_uuid else ''})"


def save_cost_table(table: dict, path: str | Path) -> str:
    table = dict(table, schema=SCHEMA, version=table.get("version", VERSION))
    table["table_id"] = table_id(table)
    check_table(table, path)
    atomic_write_text(Path(path), json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table["table_id"]


def as_cost_table(table: dict, path: str | Path | None = None, *, allow_nonstationary: bool = False) -> CostTable:
    """A checked CostTable from a table's JSON object: structure, fit, and its stationarity check (missing: a warning
    naming it; failed: refused unless allow_nonstationary). That its fitted steps are positive over its own range
    is the cost model's check, made when a model is first built on the table."""
    ct = CostTable(_current_names(check_table(table, path)), Path(path) if path is not None else None)
    s = ct.stationarity
    if s is None:
        warnings.warn(f"cost table {ct.table_id} has no stationarity check (first run of a new shape against a "
                      f"repeat): it cannot show that its step costs depended on the shape alone", StationarityWarning,
                      stacklevel=2)
    elif not s["passed"] and not allow_nonstationary:
        raise InputError(f"cost table {ct.table_id} failed its stationarity check (first-run / repeat p95 "
                         f"{max(s['prefill']['p95'], s['decode']['p95']):.2f} > {s['limit']}): a step's cost depended "
                         f"on what ran before. Calibrate again, or pass --allow-nonstationary to use it anyway",
                         path=path)
    return ct


def _current_names(table: dict) -> dict:
    """The table with its decode backends under their current names (an older table's `padded` is `dense`); its
    table_id stays the one its content was checked against."""
    if not any(b in RENAMED_BACKENDS for b in table["decode"]):
        return table

    def renamed(d: dict) -> dict:
        return {backend_named(b): v for b, v in d.items()}
    return {**table, "decode": renamed(table["decode"]), "fit": {**table["fit"], "decode": renamed(table["fit"]["decode"])}}


def load_cost_table(path: str | Path, *, allow_nonstationary: bool = False) -> CostTable:
    path = Path(path)
    try:
        table = json.loads(read_text(path))
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: brackets nested thousands deep
        raise InputError(f"not valid JSON ({e})", path=path) from None
    return as_cost_table(table, path, allow_nonstationary=allow_nonstationary)


def check_compatible(table: CostTable, config_hash: str, block_size: int) -> None:
    """Refuse a table measured for another model or block size than the one being simulated."""
    m = table.model
    if m["config_hash"] != config_hash:
        raise InputError(f"cost table {table.table_id} was measured on model {m['name']} (config {m['config_hash']}), "
                         f"not the model asked for (config {config_hash})")
    if table.block_size != block_size:
        raise InputError(f"cost table {table.table_id} was measured with {table.block_size}-token blocks, "
                         f"not {block_size}")
