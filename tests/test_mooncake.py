"""Mooncake's traces imported with their prompt block hashes (traces import-mooncake), and what the hashes say
about prefix reuse (servecap/traces/prefix.py).

The expectations for the shared file are counted here with json alone; the rest are hand-made files."""
from __future__ import annotations

import hashlib
import json
import math

import pytest
from shared_data import TRACES

from servecap.traces.cli import main
from servecap.traces.errors import InputError
from servecap.traces.importers import ImportOptions, import_mooncake, import_note
from servecap.traces.prefix import cached_prefix_share, repeated_block_share
from servecap.traces.trace_io import read_trace, write_trace
from servecap.traces.workload import Request

MOONCAKE = TRACES / "synthetic_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.exists(), reason=f"{MOONCAKE} is not on this machine")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with open(MOONCAKE) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def imported():
    return import_mooncake(MOONCAKE)


@needs_mooncake
def test_the_shared_mooncake_trace_imports_whole_with_its_hashes(rows, imported):
    trace, report = imported
    assert len(rows) == 3993  # SOURCES.md's row count
    assert (report.rows_read, report.dropped_prompt, report.clipped_budget, report.kept) == (3993, 0, 0, 3993)
    assert [(r.prompt_tokens, r.budget, r.hash_ids, r.hash_block) for r in trace.requests] == [
        (row["input_length"], row["output_length"], tuple(row["hash_ids"]), 512) for row in rows]
    assert [r.arrival for r in trace.requests] == [(row["timestamp"] - rows[0]["timestamp"]) / 1000 for row in rows]
    assert trace.span == pytest.approx(1022.025)
    # Every row has one id per 512-token block, its last block partial (none is refused)
    assert all(len(row["hash_ids"]) == math.ceil(row["input_length"] / 512) for row in rows)
    # Prompts past Qwen2.5-1.5B's 32,768 positions: kept, for the simulator to refuse or serve
    over = sum(row["input_length"] > 32768 for row in rows)
    assert sum(r.prompt_tokens > 32768 for r in trace.requests) == over == 645
    source = trace.meta["source"]
    assert source["sha256"] == hashlib.sha256(MOONCAKE.read_bytes()).hexdigest() == \
        "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"  # SOURCES.md's
    assert (source["file"], source["format"], source["hash_block"]) == ("synthetic_trace.jsonl", "jsonl", 512)
    assert trace.meta["kind"] == "mooncake" and trace.meta["options"]["time_unit"] == "ms"
    assert import_note(trace.meta) == "full lengths (no prompt or output cap)"


@needs_mooncake
def test_the_mooncake_trace_round_trips_through_a_trace_file(tmp_path, imported):
    trace, _ = imported
    back = read_trace(write_trace(trace, tmp_path / "t.csv"))
    assert back.requests == trace.requests and back.trace_id == trace.trace_id


@needs_mooncake
def test_caps_drop_and_clip_mooncake_rows_and_say_so(rows):
    trace, report = import_mooncake(MOONCAKE, ImportOptions(max_prompt=4096, max_budget=256))
    kept = [row for row in rows if row["input_length"] <= 4096]
    clipped = sum(row["output_length"] > 256 for row in kept)
    assert (report.dropped_prompt, report.kept, report.clipped_budget) == (len(rows) - len(kept), len(kept), clipped)
    assert [r.hash_ids for r in trace.requests] == [tuple(row["hash_ids"]) for row in kept]
    assert import_note(trace.meta) == (f"{len(rows) - len(kept)} of 3993 prompts over 4096 tokens dropped, "
                                       f"{clipped} of {len(kept)} outputs clipped to 256 tokens")


@needs_mooncake
def test_the_reuse_the_mooncake_hashes_show(rows, imported):
    trace, _ = imported
    seen, repeated = set(), 0
    for row in rows:
        repeated += sum(h in seen for h in row["hash_ids"])
        seen.update(row["hash_ids"])
    share = repeated / sum(len(row["hash_ids"]) for row in rows)
    assert repeated_block_share(trace.requests) == share and round(share, 2) == 0.64  # SOURCES.md's 64%
    assert 0.6 < cached_prefix_share(trace.requests, 64) < 0.7


def test_import_mooncake_command_writes_the_trace_and_prints_the_report(tmp_path, capsys):
    src, out = tmp_path / "m.jsonl", tmp_path / "t.csv"
    src.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'
                   '{"timestamp": 1500, "input_length": 5000, "output_length": 400, '
                   '"hash_ids": [0, 2, 3, 4, 5, 6, 7, 8, 9, 10]}\n'
                   '{"timestamp": 2500, "input_length": 512, "output_length": 300, "hash_ids": [0]}\n')
    assert main(["import-mooncake", str(src), "--max-prompt", "4096", "--max-budget", "256", "--out", str(out)]) == 0
    assert "dropped by the prompt cap  1" in capsys.readouterr().out
    trace = read_trace(out)
    assert [(r.arrival, r.prompt_tokens, r.budget, r.hash_ids) for r in trace.requests] == [
        (0.0, 600, 3, (0, 1)), (2.5, 512, 256, (0,))]
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "hash ids       2 requests, blocks of 512 tokens; 33.3% of their blocks repeat an earlier request's" in shown
    assert "import         1 of 3 prompts over 4096 tokens dropped, 1 of 2 outputs clipped to 256 tokens" in shown


@pytest.mark.parametrize("line, match", [
    ('{"timestamp": 0, "input_length": 1025, "output_length": 3, "hash_ids": [0, 1]}',
     "has 2 hash ids; a prompt of 1025 tokens in blocks of 512 needs 3"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": 7}', "7 is not a list of hash ids"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1.0]}', "hash id '1.0' is not a whole"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [null]}', "hash id null is not a whole"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3}', "no such column"),
], ids=["count", "not-a-list", "float-id", "null-id", "no-hashes"])
def test_bad_mooncake_rows_are_refused_naming_the_line_even_when_a_cap_would_drop_them(tmp_path, line, match):
    src = tmp_path / "m.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0]}\n' + line + "\n")
    with pytest.raises(InputError, match=match) as err:
        import_mooncake(src, ImportOptions(max_prompt=5))
    assert f"{src}, line 2, column 'hash_ids'" in str(err.value)


def test_the_cached_prefix_share_counts_whole_cache_blocks_of_the_longest_repeated_prefix():
    reqs = [Request(0, 0.0, 300, 1, "", (1, 2, 3), 128),
            Request(1, 0.0, 300, 1, "", (1, 2, 4), 128),  # 256 tokens of it cached
            Request(2, 0.0, 200, 1, "", (1, 5), 128),  # 128
            Request(3, 0.0, 300, 1, "", (1, 2, 3), 128),  # all of it: its last, partial block too -> 288 in 32s
            Request(4, 0.0, 300, 1)]  # no hashes: nothing known to be shared
    assert cached_prefix_share(reqs, 32) == (256 + 128 + 288) / 1400
    assert cached_prefix_share(reqs, 100) == (200 + 100 + 300) / 1400
    assert repeated_block_share(reqs) == (2 + 1 + 3) / 11
