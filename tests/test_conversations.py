"""The seeded multi-turn conversation generator (servecap/traces/conversations.py, `traces conversations`): its prompts grow
turn by turn, its hash ids say exactly what the prompts share, and its draws have the stated means."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from servecap.traces.cli import main
from servecap.traces.conversations import Conversations, conversation_trace
from servecap.traces.errors import InputError
from servecap.traces.request_tokens import request_token_ids
from servecap.traces.trace_io import read_trace
from servecap.traces.workload import hash_error, poisson_arrivals


def _one_session(**shape) -> list:
    """The turns of one session, in order (a single session's turns arrive in turn order)."""
    return conversation_trace(1.0, 1, 7, Conversations(**shape)).requests


def test_each_turn_is_the_previous_prompt_and_output_plus_new_user_tokens():
    turns = _one_session(turns=20.0, think_s=5.0)
    assert len(turns) > 3
    for before, after in zip(turns, turns[1:]):
        assert after.prompt_tokens > before.prompt_tokens + before.budget  # at least one new user token
        assert after.arrival >= before.arrival


def test_a_later_turn_repeats_the_earlier_turns_full_blocks_and_not_its_partial_one():
    shape = dict(turns=20.0, system_tokens=700, hash_block=256)
    turns = _one_session(**shape)
    for before, after in zip(turns, turns[1:]):
        full = before.prompt_tokens // 256
        assert after.hash_ids[:full] == before.hash_ids[:full]
        if before.prompt_tokens % 256:  # its last block was partial: the next turn's block there is other content
            assert after.hash_ids[full] != before.hash_ids[full]
        # and the tokens the ids give agree: the earlier prompt's full blocks open the later prompt
        a, b = request_token_ids(before, 1000), request_token_ids(after, 1000)
        assert (a[:full * 256] == b[:full * 256]).all()


def test_sessions_share_exactly_the_system_prompts_full_blocks():
    reqs = conversation_trace(2.0, 30, 3, Conversations(turns=1.0, system_tokens=1100, hash_block=512)).requests
    assert len(reqs) == 30  # one turn each
    for r in reqs:
        assert r.hash_ids[:2] == (0, 1)  # 1100 tokens: two full blocks of system prompt
    rest = [i for r in reqs for i in r.hash_ids[2:]]
    assert len(rest) == len(set(rest))  # the block holding the prompt's end and everything after: the session's own


def test_hash_ids_are_chained_numbered_in_order_and_a_partial_block_is_its_requests_own():
    trace = conversation_trace(1.0, 60, 5, Conversations(system_tokens=300, hash_block=128))
    where: dict[int, tuple] = {}  # id -> (its position, the ids before it)
    partial_owner: dict[int, int] = {}
    next_new = 0
    for r in trace.requests:
        assert hash_error(r.prompt_tokens, r.hash_ids, r.hash_block) is None and r.hash_block == 128
        for i, h in enumerate(r.hash_ids):
            if h not in where:
                assert h == next_new  # ids are 0, 1, 2, ... in the order the trace meets them
                next_new += 1
                where[h] = (i, r.hash_ids[:i])
            assert where[h] == (i, r.hash_ids[:i])  # chained: one id, one position and one prefix
        if r.prompt_tokens % 128:
            assert partial_owner.setdefault(r.hash_ids[-1], r.request_id) == r.request_id


def test_the_same_sessions_give_the_same_conversations_at_every_rate_and_the_same_file(tmp_path):
    slow, fast = conversation_trace(0.5, 80, 2), conversation_trace(4.0, 80, 2)
    lengths = sorted((r.prompt_tokens, r.budget) for r in slow.requests)
    assert lengths == sorted((r.prompt_tokens, r.budget) for r in fast.requests)
    assert conversation_trace(0.5, 80, 2).trace_id == slow.trace_id != conversation_trace(0.5, 80, 3).trace_id
    paths = [tmp_path / "a.csv", tmp_path / "b.csv"]
    for p in paths:
        assert main(["conversations", "--rate", "0.5", "--sessions", "80", "--seed", "2", "--out", str(p)]) == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    back = read_trace(paths[0])
    assert back.requests == slow.requests and back.meta["kind"] == "conversations" and "rate" not in back.meta


# Pinned once from the raw-word draws: a change to a draw, a stream or the id numbering shows here.
PINNED = [(1.604072, 1391, 102, (0, 1, 2)), (3.287914, 1113, 183, (0, 1, 3)), (5.022919, 1500, 192, (0, 1, 4))]


def test_pinned_first_requests():
    reqs = conversation_trace(0.5, 5, 1).requests
    assert [(r.arrival, r.prompt_tokens, r.budget, r.hash_ids) for r in reqs[:3]] == PINNED
    assert [r.arrival for r in reqs[:3]] == poisson_arrivals(0.5, 5, 1)[:3]  # first turns at their sessions' starts


def test_the_draws_have_their_stated_means():
    shape = Conversations(turns=3.0, user_tokens=200.0, output_tokens=100.0, think_s=10.0, system_tokens=0)
    trace = conversation_trace(1.0, 4000, 11, shape)
    assert len(trace) / 4000 == pytest.approx(3.0, rel=0.05)
    assert statistics.mean(r.budget for r in trace.requests) == pytest.approx(100.0, rel=0.05)
    # a single-turn session's prompt is its user tokens alone (no system prompt)
    single = conversation_trace(1.0, 4000, 11, Conversations(turns=1.0, user_tokens=200.0, system_tokens=0))
    assert statistics.mean(r.prompt_tokens for r in single.requests) == pytest.approx(200.0, rel=0.05)
    long_session = conversation_trace(1.0, 1, 0, Conversations(turns=3000.0, think_s=10.0))
    gaps = np.diff([r.arrival for r in long_session.requests])
    assert gaps.mean() == pytest.approx(10.0, rel=0.1) and (gaps >= 0).all()


def test_no_think_time_puts_every_turn_at_its_sessions_start():
    turns = _one_session(turns=10.0, think_s=0.0)
    assert len({r.arrival for r in turns}) == 1 and len(turns) > 1


@pytest.mark.parametrize("shape", [dict(turns=0.5), dict(user_tokens=0.0), dict(output_tokens=float("nan")),
                                   dict(think_s=-1.0), dict(system_tokens=-1), dict(hash_block=0),
                                   dict(system_tokens=1.5)])
def test_bad_shapes_are_refused(shape):
    with pytest.raises(InputError):
        Conversations(**shape)


@pytest.mark.parametrize("args", [(0.0, 5, 0), (1.0, 0, 0), (1.0, 5, -1), (float("inf"), 5, 0)])
def test_bad_rates_counts_and_seeds_are_refused(args):
    with pytest.raises(InputError):
        conversation_trace(*args)


@pytest.mark.parametrize("option", [["--turns", "0.9"], ["--think-s", "-1"], ["--hash-block", "0"],
                                    ["--system-tokens", "x"]])
def test_the_command_refuses_bad_options_in_one_line(tmp_path, capsys, option):
    with pytest.raises(SystemExit) as e:
        main(["conversations", "--rate", "1", *option, "--out", str(tmp_path / "t.csv")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and option[0] in err
    assert not (tmp_path / "t.csv").exists()
