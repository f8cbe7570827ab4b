"""Property tests of the readers of user input: whatever bytes a file holds, reading it gives a valid trace
or one InputError naming the file, never another exception (which the CLI would show as a traceback).

The example counts are kept small so that the whole file runs in a few seconds on two cores.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servecap.traces.errors import InputError
from servecap.traces.importers import import_mooncake, import_table
from servecap.traces.prompts import PROMPT_LENGTHS
from servecap.traces.trace_io import read_trace, write_trace
from servecap.traces.workload import Trace, closed_mixed, hash_error, length_trace, poisson_trace

# Each example overwrites the same file, so a function-scoped tmp_path is safe to share between examples.
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _valid_files() -> list[bytes]:
    traces = [poisson_trace(3.0, 6, 1), closed_mixed(3, 2),
              length_trace([(0.0, 10, 5), (0.25, 3000, 256), (1.123456, 7, 1)], {"kind": "import", "note": "x,\"y\""}),
              length_trace([(0.0, 10, 5), (0.25, 1100, 256), (1.5, 512, 1)], {"kind": "mooncake"},
                           hash_ids=[(0,), (0, 1, 2), (7,)], hash_block=512)]
    with tempfile.TemporaryDirectory() as d:
        return [write_trace(t, Path(d) / f"{i}.csv").read_bytes() for i, t in enumerate(traces)]


VALID = _valid_files()
# Text that looks like the rows of a trace, so inserted lines reach past the CSV layer into the row checks.
ROWISH = st.one_of(
    st.binary(max_size=40),
    st.text(alphabet='0123456789.,-+e"p \r\t\u2028', max_size=40).map(str.encode),
    st.tuples(st.integers(-2, 10), st.floats(allow_nan=True, allow_infinity=True), st.integers(-1, 5000),
              st.integers(-1, 300), st.sampled_from(["", *PROMPT_LENGTHS, "p7"]))
    .map(lambda r: ",".join(map(str, r)).encode()),
    st.tuples(st.integers(-1, 10), st.floats(0, 5), st.integers(-1, 1200), st.integers(-1, 300), st.just(""),
              st.sampled_from([-1, 0, 1, 512]),
              st.lists(st.integers(-1, 3), max_size=4).map(lambda h: " ".join(map(str, h))))
    .map(lambda r: ",".join(map(str, r)).encode()),
)


@st.composite
def mutated(draw) -> bytes:
    """A valid trace file after a few byte flips, truncations, deleted bytes and inserted or repeated lines.
    Some examples leave the header line, or it and the column line, alone: hypothesis favours positions near
    the start, which would otherwise keep most mutations from reaching the rows' checks."""
    lines = draw(st.sampled_from(VALID)).split(b"\n")
    keep = draw(st.sampled_from([0, 1, 2]))
    kept, data = b"".join(line + b"\n" for line in lines[:keep]), bytearray(b"\n".join(lines[keep:]))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "delete", "insert-line", "repeat-line"]))
        if kind == "flip" and data:
            # Mostly bytes that keep the text UTF-8 and CSV-like; any byte now and then.
            byte = draw(st.one_of(st.sampled_from(b'0123456789.,-e"p\r\n '), st.integers(0, 255)))
            data[draw(st.integers(0, len(data) - 1))] = byte
        elif kind == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif kind == "delete" and data:
            i = draw(st.integers(0, len(data) - 1))
            del data[i:i + draw(st.integers(1, 8))]
        else:
            lines = bytes(data).split(b"\n")
            i = draw(st.integers(0, len(lines)))
            new = draw(ROWISH) if kind == "insert-line" else lines[draw(st.integers(0, len(lines) - 1))]
            data = bytearray(b"\n".join(lines[:i] + [new] + lines[i:]))
    return kept + bytes(data)


def _read_is_a_valid_trace_or_an_input_error(path: Path) -> None:
    try:
        trace = read_trace(path)
    except InputError as e:
        assert str(path) in str(e) and "\n" not in str(e), str(e)
        return
    assert isinstance(trace, Trace) and isinstance(trace.meta, dict)
    arrivals = [r.arrival for r in trace.requests]
    assert all(math.isfinite(a) and a >= 0 for a in arrivals) and arrivals == sorted(arrivals)
    for r in trace.requests:
        assert r.request_id >= 0 and r.prompt_tokens >= 1 and r.budget >= 1
        assert not r.prompt or PROMPT_LENGTHS[r.prompt] == r.prompt_tokens
        assert hash_error(r.prompt_tokens, r.hash_ids, r.hash_block) is None
    assert len(trace.trace_id) == 16


def test_the_valid_files_are_valid(tmp_path):
    for data in VALID:
        (tmp_path / "t.csv").write_bytes(data)
        assert len(read_trace(tmp_path / "t.csv")) >= 3


@SETTINGS
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_read_as_a_trace_or_an_input_error(tmp_path, data):
    (tmp_path / "t.csv").write_bytes(data)
    _read_is_a_valid_trace_or_an_input_error(tmp_path / "t.csv")


@SETTINGS
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_after_a_valid_header_read_as_a_trace_or_an_input_error(tmp_path, data):
    (tmp_path / "t.csv").write_bytes(VALID[0].split(b"\n", 2)[0] + b"\n" + data)
    _read_is_a_valid_trace_or_an_input_error(tmp_path / "t.csv")


@settings(SETTINGS, max_examples=400)
@given(data=mutated())
def test_mutated_trace_files_read_as_a_trace_or_an_input_error(tmp_path, data):
    (tmp_path / "t.csv").write_bytes(data)
    _read_is_a_valid_trace_or_an_input_error(tmp_path / "t.csv")


NUMBER = st.from_regex(r"-?[0-9]{1,4}(\.[0-9]{1,3})?(e-?[0-9]{1,8})?", fullmatch=True)
IMPORT_ROW = st.tuples(NUMBER, NUMBER, NUMBER).map(lambda r: ",".join(r).encode())


@SETTINGS
@given(data=st.one_of(st.binary(max_size=200), st.lists(st.one_of(ROWISH, IMPORT_ROW), max_size=6).map(b"\n".join)))
def test_arbitrary_import_files_give_a_trace_or_an_input_error(tmp_path, data):
    path = tmp_path / "t.csv"
    path.write_bytes(b"ts,in,out\n" + data)
    try:
        import_table(path, "ts", "in", "out")
    except InputError as e:
        assert str(path) in str(e) and "\n" not in str(e), str(e)


JSON_VALUE = st.one_of(NUMBER, st.integers(-2, 2000).map(str), st.sampled_from(['"12"', "null", "true", "[]", "{}"]))
HASH_LIST = st.lists(st.one_of(st.integers(-1, 9).map(str), st.sampled_from(["1.0", '"3"', "null", "[1]"])),
                     max_size=4).map(lambda h: "[" + ", ".join(h) + "]")
MOONCAKE_ROW = st.tuples(JSON_VALUE, JSON_VALUE, JSON_VALUE, st.one_of(HASH_LIST, JSON_VALUE)).map(
    lambda r: ('{"timestamp": %s, "input_length": %s, "output_length": %s, "hash_ids": %s}' % r).encode())


@SETTINGS
@given(data=st.one_of(st.binary(max_size=200), st.lists(MOONCAKE_ROW, min_size=1, max_size=5).map(b"\n".join)))
def test_arbitrary_mooncake_files_give_a_trace_or_an_input_error(tmp_path, data):
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    try:
        trace, _ = import_mooncake(path)
    except InputError as e:
        assert str(path) in str(e) and "\n" not in str(e), str(e)
        return
    for r in trace.requests:
        assert r.hash_block == 512 and hash_error(r.prompt_tokens, r.hash_ids, r.hash_block) is None
