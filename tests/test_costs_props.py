"""Property tests of the cost-table loader: whatever a table file holds, loading it gives a checked table or one
InputError naming the file, never another exception (which `sim run --table` would show as a traceback).

Mutations start from the synthetic tables (servecap/costs/synthetic.py), which take the whole path a measured one does, and
change what a hand edit or a broken fit would: a value replaced by another of any JSON type, a key deleted, a list
emptied or cut. The example counts keep the file to a few seconds on two cores.
"""
from __future__ import annotations

import copy
import json
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servecap.costs.synthetic import constant_table, linear_table
from servecap.costs.table import CostTable, StationarityWarning, load_cost_table, table_id
from servecap.traces.errors import InputError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
VALID = [constant_table(), linear_table(backends=("paged",), max_batch=8)]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 10**6), st.sampled_from([0, -1, 2**63, 10**30]),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                   st.lists(st.integers(-1, 5000), max_size=3),
                   # fresh copies: one shared object put in two places could end up inside itself
                   st.sampled_from([[], {}, [[1, 0.01]], [[16, -0.01], [4096, 0.02]]]).map(copy.deepcopy))


def _paths(obj, prefix=()) -> list[tuple]:
    """Every path to a value inside a JSON object (keys and list indices)."""
    out = [prefix] if prefix else []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out += _paths(v, (*prefix, k))
    return out


PATHS = [_paths(t) for t in VALID]


@st.composite
def mutated(draw) -> dict:
    i = draw(st.integers(0, len(VALID) - 1))
    table = copy.deepcopy(VALID[i])
    for _ in range(draw(st.integers(1, 3))):
        # Mostly the fit, where a bad value reaches the cost model's own checks.
        fit = [p for p in PATHS[i] if p[0] in ("fit", "overhead")]
        path = draw(st.sampled_from(fit if draw(st.booleans()) else PATHS[i]))
        parent = table
        try:
            for k in path[:-1]:
                parent = parent[k]
            kind = draw(st.sampled_from(["replace", "delete", "cut"]))
            if kind == "delete" and isinstance(parent, dict):
                del parent[path[-1]]
            elif kind == "cut" and isinstance(parent[path[-1]], list):
                del parent[path[-1]][draw(st.integers(0, len(parent[path[-1]]))):]
            else:
                parent[path[-1]] = draw(VALUES)
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed or replaced the way there
            pass
    if draw(st.booleans()):
        table["table_id"] = table_id(table)  # most edits keep a matching id, so the checks past it run
    return table


def _loads_or_refuses(path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StationarityWarning)
            warnings.simplefilter("error", RuntimeWarning)  # an overflow would mean a value no check refused
            assert isinstance(load_cost_table(path), CostTable)
    except InputError as e:
        assert str(path) in str(e)


@SETTINGS
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_load_as_a_table_or_an_input_error(tmp_path, data):
    _loads_or_refuses(tmp_path / "t.json", data)


@SETTINGS
@given(text=st.one_of(st.just("[" * 100_000), st.just('{"a": ' * 50_000),
                      st.recursive(st.none() | st.integers() | st.text(max_size=4),
                                   lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                        max_size=3))
                      .map(json.dumps)))
def test_arbitrary_json_loads_as_a_table_or_an_input_error(tmp_path, text):
    _loads_or_refuses(tmp_path / "t.json", text.encode())


@SETTINGS
@given(table=mutated())
def test_mutated_tables_load_as_a_table_or_an_input_error(tmp_path, table):
    _loads_or_refuses(tmp_path / "t.json", json.dumps(table).encode())


@SETTINGS
@given(base=st.sampled_from(VALID), key=st.sampled_from(["max_batch", "max_tokens", "block_size"]),
       value=st.sampled_from([0, -1, 1, 3, 10**6, 2**63, 10**30, 1.5, "64", None, True]), same_id=st.booleans())
def test_a_table_of_any_size_loads_or_is_refused_at_once(tmp_path, base, key, value, same_id):
    """Sizes a typo or a broken writer could leave: the loader once took minutes over a max_batch of a million
    (its fit check prices every batch size) and raised a TypeError on 10**30 tokens."""
    table = {**base, key: value}
    if same_id:
        table["table_id"] = table_id(table)
    _loads_or_refuses(tmp_path / "t.json", json.dumps(table).encode())
