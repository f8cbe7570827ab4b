"""The JSON-lines mechanics both points files share (servecap/traces/jsonl_store.py): whole lines, the header, entries,
appends that reach the disk at once."""
import json

import pytest

from servecap.traces.errors import InputError
from servecap.traces.jsonl_store import JsonLines, complete_lines, drop_cut_off, entries, header


def test_a_line_cut_off_mid_write_is_set_apart_and_can_be_dropped(tmp_path):
    assert complete_lines('{"a": 1}\n{"k": "x"}\n') == (['{"a": 1}', '{"k": "x"}'], "")
    text = '{"a": 1}\n{"k": "x"}\n{"k": "y", "v'
    lines, cut_off = complete_lines(text)
    assert lines == ['{"a": 1}', '{"k": "x"}'] and cut_off == '{"k": "y", "v'
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    drop_cut_off(path, text, cut_off)
    assert path.read_text() == '{"a": 1}\n{"k": "x"}\n'
    drop_cut_off(path, path.read_text(), "")  # nothing cut off: the file is left as it is
    assert path.read_text() == '{"a": 1}\n{"k": "x"}\n'


def test_the_header_is_the_first_line_as_an_object_or_none():
    assert header(['{"schema": "s"}', "x"]) == {"schema": "s"}
    assert header([]) is None and header(["[1, 2]"]) is None and header(["{not json"]) is None


def test_entries_are_read_by_key_and_a_bad_line_is_refused_with_its_number(tmp_path):
    lines = ['{"schema": "s"}', '{"key": "a", "value": 1}', '{"key": "b", "value": [2]}']
    assert entries(lines, "key", "value", path=tmp_path, refusal="bad") == {"a": 1, "b": [2]}
    for bad in ('{"key": "c"}', "[3]", "{oops"):
        with pytest.raises(InputError, match="line 4: not an entry"):
            entries(lines + [bad], "key", "value", path=tmp_path, refusal="not an entry")


def test_each_line_is_on_disk_as_soon_as_it_is_written(tmp_path):
    path = tmp_path / "sub" / "p.jsonl"
    f = JsonLines.create(path, {"schema": "s", "b": 1}, separators=(",", ":"))
    assert path.read_text() == '{"b": 1, "schema": "s"}\n'
    f.write({"key": "k", "value": {"z": 1, "a": 2}})
    assert path.read_text().splitlines()[1] == '{"key":"k","value":{"z":1,"a":2}}'  # the store's own format
    f.close()
    again = JsonLines(path, sort_keys=True)
    again.write({"key": "j", "value": 3})
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()[1:]] == ["k", "j"]
    again.close()
