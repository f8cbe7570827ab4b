"""Prompt block hashes in request traces: the file format (version 1 unchanged without them, version 2 with them),
their checks on read, and the token ids a request's hashes give (traces.request_tokens.request_token_ids).

Expectations are written out here: pinned digests of files written before hashes existed, hand-made files, and
the documented token draw (raw PCG64 words of the seed words, modulo the vocabulary)."""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servecap.traces.errors import InputError
from servecap.traces.prompts import QWEN_TEXT_VOCAB, prompt_tokens
from servecap.traces.request_tokens import request_token_ids
from servecap.traces.trace_io import read_trace, write_trace
from servecap.traces.workload import Request, Trace, closed_mixed, length_trace, poisson_trace, synthetic_trace

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- traces without hashes are what they were -------------------------------------------------------------

# (trace id, sha256 of the file) of each trace, taken from the code before hash ids existed.
BEFORE_HASHES = {
    "poisson": (poisson_trace(3.0, 40, 1), "8206160ed6826cca",
                "5ff0cdbada203ed56f07364474fceb13605f3a54116ee2bc5f1ba7228b1ae11f"),
    "closed": (closed_mixed(10, 2), "be89c3e46844a53a",
               "0097cd01448d5d5a55bf6b7add45b5355f72c7e49cd376cdb58b5f5569d56ed3"),
    "lengths": (length_trace([(0.0, 10, 5), (0.25, 3000, 256), (1.123456, 7, 1)], {"kind": "import", "note": "x"}),
                "87c8f34f531c9321", "2faf95ced3a03770cc23207284df0c8a66be876c376cee596dfddd5608cd30b4"),
    "synthetic": (synthetic_trace(2.0, 30, 4, "loguniform", "uniform"), "cb2be82cb25c1933",
                  "c64cc22eb755c9b15be0fff0bc41eae8fb8c1849c8645f05d862be0222bca4af"),
}


@pytest.mark.parametrize("name", BEFORE_HASHES)
def test_a_trace_without_hashes_has_the_id_and_the_bytes_it_had_before_hashes(tmp_path, name):
    trace, trace_id, file_sha = BEFORE_HASHES[name]
    path = write_trace(trace, tmp_path / "t.csv")
    assert trace.trace_id == trace_id
    assert hashlib.sha256(path.read_bytes()).hexdigest() == file_sha
    assert path.read_text().startswith('# {"meta": ') and '"version": 1}' in path.read_text().splitlines()[0]


# --- traces with hashes ------------------------------------------------------------------------------------

def _hashed() -> Trace:
    return length_trace([(0.0, 1024, 5), (0.5, 1025, 7), (0.75, 1, 1)], {"kind": "test"},
                        hash_ids=[(0, 1), (0, 1, 2), (9_223_372_036_854_775_807,)], hash_block=512)


def test_a_trace_with_hashes_writes_them_in_two_columns_and_reads_them_back(tmp_path):
    trace = _hashed()
    path = write_trace(trace, tmp_path / "t.csv")
    lines = path.read_text().splitlines()
    assert '"version": 2' in lines[0]
    assert lines[1:] == ["request_id,arrival_s,prompt_tokens,budget,prompt,hash_block,hash_ids",
                         "0,0.000000,1024,5,,512,0 1", "1,0.500000,1025,7,,512,0 1 2",
                         "2,0.750000,1,1,,512,9223372036854775807"]
    back = read_trace(path)
    assert back.requests == trace.requests and back.trace_id == trace.trace_id


def test_the_hashes_are_part_of_the_trace_id():
    trace = _hashed()
    plain = Trace([Request(r.request_id, r.arrival, r.prompt_tokens, r.budget) for r in trace.requests])
    other = Trace([trace.requests[0], Request(1, 0.5, 1025, 7, "", (0, 1, 3), 512), trace.requests[2]])
    finer = Trace([Request(r.request_id, r.arrival, r.prompt_tokens, r.budget, "", r.hash_ids, 1024)
                   for r in trace.requests])
    assert len({trace.trace_id, plain.trace_id, other.trace_id, finer.trace_id}) == 4


def test_a_request_without_hashes_in_a_hashed_trace_keeps_none(tmp_path):
    trace = Trace([Request(0, 0.0, 16, 4, "p16"), Request(1, 1.0, 600, 4, "", (3, 4), 512)])
    path = write_trace(trace, tmp_path / "t.csv")
    assert path.read_text().splitlines()[2] == "0,0.000000,16,4,p16,0,"
    assert read_trace(path).requests == trace.requests


def test_moving_a_request_keeps_its_hashes():
    r = Request(3, 1.0, 600, 4, "", (3, 4), 512)
    assert r.at(2.5) == Request(3, 2.5, 600, 4, "", (3, 4), 512)


HEADER = ('# {"schema": "request-trace", "version": 2}\n'
          "request_id,arrival_s,prompt_tokens,budget,prompt,hash_block,hash_ids\n")


@pytest.mark.parametrize("row, match", [
    ("0,0.0,1025,4,,512,0 1", "has 2 hash ids; a prompt of 1025 tokens in blocks of 512 needs 3"),
    ("0,0.0,1024,4,,512,0 1 2", "has 3 hash ids; a prompt of 1024 tokens in blocks of 512 needs 2"),
    ("0,0.0,16,4,,0,7", "has hash ids but no hash block size"),
    ("0,0.0,16,4,,512,", "has 0 hash ids; a prompt of 16 tokens in blocks of 512 needs 1"),
    ("0,0.0,16,4,,512,x", "hash id 'x' is not a whole number"),
    ("0,0.0,16,4,,512,-1", "hash id '-1' is not a whole number"),
    ("0,0.0,16,4,,512,1.0", "hash id '1.0' is not a whole number"),
    ("0,0.0,1024,4,,512,1  2", "hash id '' is not a whole number"),
    ("0,0.0,16,4,,512,9223372036854775808", "is not a whole number from 0 to 9,223,372,036,854,775,807"),
    ("0,0.0,16,4,,512," + "9" * 5000, "is not a whole number from 0"),
    ("0,0.0,16,4,,512,\u00b2", "is not a whole number"),
    ("0,0.0,16,4,,-512,1", "'hash_block': '-512' must be at least 0"),
], ids=["too-few", "too-many", "ids-without-block", "block-without-ids", "not-a-number", "negative", "float",
        "double-space", "past-int64", "thousands-of-digits", "superscript", "negative-block"])
def test_bad_hashes_are_refused_naming_the_line(tmp_path, row, match):
    p = tmp_path / "bad.csv"
    p.write_text(HEADER + "1,0.0,16,4,,0,\n" + row + "\n")
    with pytest.raises(InputError, match=match) as err:
        read_trace(p)
    assert f"{p}, line 4" in str(err.value) and "\n" not in str(err.value)


def test_a_hashed_file_missing_its_hash_columns_is_refused(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text('# {"schema": "request-trace", "version": 2}\nrequest_id,arrival_s,prompt_tokens,budget,prompt\n'
                 "0,0.0,16,4,\n")
    with pytest.raises(InputError, match=r"line 2: missing columns \['hash_block', 'hash_ids'\]"):
        read_trace(p)


@st.composite
def hashed_traces(draw) -> Trace:
    """Traces of requests with and without hashes: any lengths, blocks and (int64) ids, arrivals in order."""
    n = draw(st.integers(1, 8))
    gaps = draw(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=n, max_size=n))
    reqs, t = [], 0.0
    for i, gap in enumerate(gaps):
        t = round(t + gap, 6)
        prompt = draw(st.integers(1, 5000))
        block = draw(st.sampled_from([0, 1, 16, 64, 512, 4096]))
        ids = tuple(draw(st.lists(st.integers(0, 2 ** 63 - 1), min_size=math.ceil(prompt / block),
                                  max_size=math.ceil(prompt / block)))) if block else ()
        reqs.append(Request(i, t, prompt, draw(st.integers(1, 10 ** 6)), "", ids, block))
    return Trace(reqs, draw(st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)))


@SETTINGS
@given(trace=hashed_traces())
def test_traces_with_hashes_round_trip_exactly(tmp_path, trace):
    path = write_trace(trace, tmp_path / "t.csv")
    back = read_trace(path)
    assert back.requests == trace.requests and back.meta == trace.meta and back.trace_id == trace.trace_id
    assert write_trace(back, tmp_path / "again.csv").read_bytes() == path.read_bytes()


# --- token ids from hashes ---------------------------------------------------------------------------------

def _block(h: int, size: int, vocab: int) -> np.ndarray:
    # The documented draw: raw PCG64 words of the seed words (0, 1, h, 1), modulo the vocabulary.
    return (np.random.PCG64(np.random.SeedSequence([0, 1, h, 1])).random_raw(size) % np.uint64(vocab)).astype(np.int32)


@pytest.mark.parametrize("vocab", [QWEN_TEXT_VOCAB, 151936, 1000])
def test_a_request_without_hashes_gets_the_engines_prompt_ids(vocab):
    for req in (Request(0, 0.0, 300, 4), Request(1, 0.0, 16, 4, "p16")):
        ids = request_token_ids(req, vocab)
        assert ids.dtype == np.int32
        assert ids.tolist() == prompt_tokens(req.prompt_tokens, min(vocab, QWEN_TEXT_VOCAB))


def test_hashed_blocks_are_their_ids_tokens_and_a_partial_block_takes_the_first_ones():
    vocab = 1000
    a = Request(0, 0.0, 1024, 4, "", (5, 6), 512)
    b = Request(1, 0.0, 1200, 4, "", (5, 7, 8), 512)
    ta, tb = request_token_ids(a, vocab), request_token_ids(b, vocab)
    assert ta.dtype == np.int32 and len(ta) == 1024 and len(tb) == 1200
    assert ta.tolist() == np.concatenate([_block(5, 512, vocab), _block(6, 512, vocab)]).tolist()
    assert (ta[:512] == tb[:512]).all()  # the shared first block
    assert (ta[512:] != tb[512:1024]).mean() > 0.99  # different ids, different tokens
    assert tb[1024:].tolist() == _block(8, 512, vocab)[:176].tolist()
    assert ta.max() < vocab and ta.min() >= 0


def test_equal_hashes_give_equal_tokens_whatever_else_the_requests_hold():
    a = request_token_ids(Request(0, 0.0, 100, 4, "", (42,), 64 * 2), QWEN_TEXT_VOCAB)
    b = request_token_ids(Request(9, 5.0, 128, 60, "", (42,), 128), 151936)
    assert a.tolist() == b[:100].tolist()
    # a length-only request of that length draws from its own stream, not block 42's
    assert a.tolist() != request_token_ids(Request(0, 0.0, 100, 4), QWEN_TEXT_VOCAB).tolist()


def test_hash_id_0_and_a_one_token_prompt_are_different_streams():
    # SeedSequence reads [0, 1, 0] as [0, 1]: the words of hash id 0 must not be those of the 1-token prompt
    block = request_token_ids(Request(0, 0.0, 4, 1, "", (0,), 4), QWEN_TEXT_VOCAB)
    assert block.tolist() != (np.random.PCG64(np.random.SeedSequence([0, 1])).random_raw(4)
                              % np.uint64(QWEN_TEXT_VOCAB)).tolist()
