"""Cost tables: the step costs measured on one GPU, the simulator's only input about the hardware.

A table holds the measured points (median and spread), the fitted model that serves shapes between
them (see calibrate/cost_model.py), and where it was measured: device, software, model, date.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from .csvio import atomic_write_text, read_text
from .errors import InputError

SCHEMA = "cost-table"
VERSION = 1
_POINT_KEYS = {"prefill": ("width", "padded_len"), "decode": ("rows", "kv_tokens", "kv_max", "kv_read")}
_STAT_KEYS = ("median_s", "p10_s", "p90_s", "n")


def table_id(table: dict) -> str:
    body = {k: v for k, v in table.items() if k != "table_id"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _need(d: dict, key: str, where: str, path, kind=None):
    if not isinstance(d, dict) or key not in d:
        raise InputError(f"missing {where}{key!r}", path=path)
    if kind is not None and not isinstance(d[key], kind):
        raise InputError(f"{where}{key!r} should be {getattr(kind, '__name__', kind)}, got {type(d[key]).__name__}", path=path)
    return d[key]


def _check_points(points: list, kind: str, where: str, path) -> None:
    if not points:
        raise InputError(f"{where} has no measured points", path=path)
    for i, p in enumerate(points):
        here = f"{where}[{i}]."
        for k in _POINT_KEYS[kind]:
            v = _need(p, k, here, path)
            if not isinstance(v, int) or v <= 0:
                raise InputError(f"{here}{k} must be a positive integer, got {v!r}", path=path)
        for k in _STAT_KEYS:
            v = _need(p, k, here, path, (int, float))
            if not (math.isfinite(v) and v > 0):
                raise InputError(f"{here}{k} must be a positive number, got {v!r}", path=path)
        if not p["p10_s"] <= p["median_s"] <= p["p90_s"]:
            raise InputError(f"{here} needs p10_s <= median_s <= p90_s, got {p['p10_s']}, {p['median_s']}, {p['p90_s']}",
                             path=path)


def validate(table: dict, path: str | Path | None = None) -> dict:
    """Check a cost table's structure and values; raise InputError naming the first bad field."""
    if not isinstance(table, dict):
        raise InputError("a cost table is a JSON object", path=path)
    if table.get("schema") != SCHEMA:
        raise InputError(f"is a {table.get('schema')!r} file, expected {SCHEMA!r}", path=path)
    if table.get("version") != VERSION:
        raise InputError(f"cost-table version {table.get('version')!r} is not one this reader knows ({VERSION})", path=path)
    _need(_need(table, "device", "", path, dict), "name", "device.", path, str)
    model = _need(table, "model", "", path, dict)
    for k in ("name", "config_hash", "dtype"):
        _need(model, k, "model.", path, str)
    for k in ("block_size", "max_batch", "max_tokens"):
        if not isinstance(_need(table, k, "", path, int), int) or table[k] <= 0:
            raise InputError(f"{k} must be a positive integer", path=path)
    _check_points(_need(_need(table, "prefill", "", path, dict), "points", "prefill.", path, list), "prefill",
                  "prefill.points", path)
    decode = _need(table, "decode", "", path, dict)
    if not decode:
        raise InputError("decode has no backends", path=path)
    for backend, d in decode.items():
        _check_points(_need(d, "points", f"decode.{backend}.", path, list), "decode", f"decode.{backend}.points", path)
        too_wide = [p["rows"] for p in d["points"] if p["rows"] > table["max_batch"]]
        if too_wide:
            raise InputError(f"decode.{backend} has points with rows {too_wide} above max_batch {table['max_batch']}",
                             path=path)
    _need(table, "fit", "", path, dict)
    if table.get("table_id") not in (None, table_id(table)):
        raise InputError("table_id does not match the content (edited by hand?)", path=path)
    return table


def save_cost_table(table: dict, path: str | Path) -> str:
    table = dict(table, schema=SCHEMA, version=VERSION)
    table["table_id"] = table_id(table)
    validate(table, path)
    atomic_write_text(Path(path), json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table["table_id"]


def load_cost_table(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise InputError("cost table not found", path=path)
    try:
        table = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON ({e})", path=path) from None
    return validate(table, path)


def check_compatible(table: dict, config_hash: str, block_size: int) -> None:
    """Refuse a table measured for another model or block size than the one being simulated."""
    m = table["model"]
    if m["config_hash"] != config_hash:
        raise InputError(f"cost table {table.get('table_id')} was measured on model {m['name']} (config {m['config_hash']}), "
                         f"not the model asked for (config {config_hash})")
    if table["block_size"] != block_size:
        raise InputError(f"cost table {table.get('table_id')} was measured with {table['block_size']}-token blocks, "
                         f"not {block_size}")
