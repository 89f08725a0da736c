"""What arrives of a streamed request, in either of SGLang's chunk kinds; the in-flight log's records,
torn lines and full disks; what a restarted orchestrator takes back, and the count of tokens that came
twice."""

from __future__ import annotations

import asyncio
import os

import pytest

from checkpoints import inflight_log, layout
from checkpoints.inflight_log import InflightLog, Logged, Piece
from elastic_rl.engines.streaming import Received, event_data
from elastic_rl.errors import EngineError
from elastic_rl.rollout.groups import Sample, SampleStatus, Segment
from elastic_rl.rollout.inflight import InFlight

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KEY = (0, 5, 1)


def chunk(ids: list[int], completion: int, version: int = 3, finish: str | None = None) -> dict:
    return {
        "output_ids": ids,
        "meta_info": {
            "completion_tokens": completion,
            "output_token_logprobs": [[-float(token), token, None] for token in ids],
            "weight_version": str(version),
            "finish_reason": None if finish is None else {"type": finish},
        },
    }


@pytest.mark.parametrize("cumulative", [True, False], ids=["everything-so-far", "incremental"])
def test_the_tokens_of_both_kinds_of_chunk_add_up(cumulative):
    tokens = [11, 12, 13, 14, 15]
    received = Received()
    for count in (1, 3, 5):
        ids = tokens[:count] if cumulative else tokens[len(received.output_ids) : count]
        received.add(chunk(ids, count, finish="length" if count == 5 else None))
    assert received.output_ids == tokens and received.logprobs == [-float(t) for t in tokens]
    assert received.finished and received.answer()["meta_info"]["output_token_logprobs"][0] == [-11.0, 11, None]


def test_an_error_chunk_or_one_that_does_not_add_up_breaks_the_stream():
    received = Received()
    received.add(chunk([1, 2], 2))
    with pytest.raises(EngineError, match="mid-stream"):
        received.add({"error": {"message": "decode failed"}})
    with pytest.raises(EngineError, match="counts 5 tokens"):
        received.add(chunk([3], 5))
    # More than it counts: an engine's chunk read while its step appended a token. Taking its last
    # tokens would drop token 3 and shift every token after it against its log prob.
    with pytest.raises(EngineError, match="counts 3 tokens"):
        received.add(chunk([3, 4], 3))
    with pytest.raises(EngineError, match="counts 3 tokens"):
        received.add({**chunk([3], 3), "output_ids": [3, 4]})
    assert received.output_ids == [1, 2] and not received.finished
    assert event_data(b"data: [DONE]\n") is None and event_data(b": keep-alive\n") is None
    assert event_data(b'data: {"a": 1}\n') == {"a": 1}


def test_the_log_reads_back_its_pieces_and_ignores_a_torn_line(tmp_path):
    log = InflightLog(tmp_path, 4)
    log.start({})
    log.append([Piece(KEY, 0, [7, 8], [-0.1, -0.2], 3), Piece((0, 6, 0), 0, [9], [-0.3], 3)])
    log.append([Piece(KEY, 2, [10], [-0.4], 4, status="truncated")])
    with open(layout.inflight_path(tmp_path, 4), "ab") as handle:
        handle.write(b'{"key": [0, 6, 0], "at": 1, "ids": [1')  # a crash mid-line
    read = inflight_log.read(tmp_path, 4)
    assert read[KEY] == Logged([7, 8, 10], [-0.1, -0.2, -0.4], [(3, 2), (4, 1)], "truncated")
    assert read[(0, 6, 0)].output_ids == [9] and read[(0, 6, 0)].status is None
    assert inflight_log.read(tmp_path, 5) == {}
    # A piece that does not start where the sample ends is not taken.
    assert not Logged([1], [-1.0], [(3, 1)]).take(Piece(KEY, 3, [2], [-1.0], 3))


def test_a_full_disk_cuts_the_log_back_to_what_it_held(tmp_path, monkeypatch):
    log = InflightLog(tmp_path, 0)
    log.start({})
    log.append([Piece(KEY, 0, [7], [-0.1], 3)])
    held = layout.inflight_path(tmp_path, 0).read_bytes()

    def no_room(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_room)
    with pytest.raises(OSError):
        log.append([Piece(KEY, 1, [8], [-0.2], 3)])
    assert layout.inflight_path(tmp_path, 0).read_bytes() == held
    monkeypatch.undo()
    log.append([Piece(KEY, 1, [8], [-0.2], 3)])
    assert inflight_log.read(tmp_path, 0)[KEY].output_ids == [7, 8]
    log.remove()
    assert layout.inflight_rollouts(tmp_path) == []


def test_a_full_disk_costs_only_the_persisting_reported_once_and_caught_up_after(tmp_path, monkeypatch):
    events = []

    async def report(kind, message):
        events.append(kind)

    def no_room(fd):
        raise OSError(28, "No space left on device")

    async def scenario():
        inflight = InFlight(tmp_path, report)
        await inflight.begin(0, oldest_allowed=0)
        received = Received()
        inflight.requesting(KEY, Sample.unstarted(), received)
        received.add(chunk([21, 22], 2, version=0))
        monkeypatch.setattr(os, "fsync", no_room)
        await inflight.persist(version=0)
        received.add(chunk([23], 3, version=0))
        await inflight.persist(version=0)  # still full: reported once, not twice
        assert events == ["inflight_persist_failed"]
        monkeypatch.undo()
        await inflight.persist(version=0)  # room again: everything that arrived meanwhile goes in
        assert events == ["inflight_persist_failed", "inflight_persist_resumed"]
        assert inflight_log.read(tmp_path, 0)[KEY].output_ids == [21, 22, 23]

    asyncio.run(scenario())


def test_what_arrived_is_persisted_taken_back_after_a_restart_and_stale_prefixes_dropped(tmp_path):
    events = []

    async def report(kind, message):
        events.append(kind)

    async def scenario():
        first = InFlight(tmp_path, report)
        await first.begin(2, oldest_allowed=2)
        received = Received()
        first.requesting(KEY, Sample.unstarted(), received)
        received.add(chunk([21, 22, 23], 3, version=2))
        other = Received()
        first.requesting((0, 9, 0), Sample([30], [-1.0], [Segment(1, 1)], SampleStatus.UNFINISHED), other)
        other.add(chunk([31], 1, version=2))
        await first.persist(version=2)
        received.add(chunk([24], 4, version=2))  # arrives after the last persist: lost with `first`

        second = InFlight(tmp_path, report)
        await second.begin(2, oldest_allowed=2)  # the sample begun by weights 1 is too stale now
        resumed = second.resumed(KEY, Sample.unstarted())
        assert resumed.output_ids == [21, 22, 23] and resumed.segments == [Segment(2, 3)]
        assert second.resumed_tokens == 3 and (0, 9, 0) not in second.restored
        assert events == ["stale_prefixes_dropped"]
        # Continued from there: nothing came twice.
        more = Received()
        second.requesting(KEY, resumed, more)
        more.add(chunk([24, 25], 2, version=2, finish="length"))
        done = resumed.continued(more.output_ids, more.logprobs, 2, SampleStatus.TRUNCATED)
        second.done(KEY, done)
        assert second.regenerated_tokens == 0
        await second.persist(version=2)
        logged = inflight_log.read(tmp_path, 2)[KEY]
        assert logged.output_ids == [21, 22, 23, 24, 25] and logged.status == "truncated"

    asyncio.run(scenario())


def test_tokens_for_positions_that_arrived_before_are_counted():
    inflight = InFlight(None)
    sample = Sample.unstarted()
    first = Received()
    inflight.requesting(KEY, sample, first)
    first.add(chunk([1, 2, 3, 4], 4))
    inflight.done(KEY, sample)  # broke, and started over (continuation off): the four are thrown away
    again = Received()
    inflight.requesting(KEY, sample, again)
    again.add(chunk([1, 2, 3, 4, 5, 6], 6, finish="length"))
    inflight.done(KEY, sample.continued(again.output_ids, again.logprobs, 3, SampleStatus.TRUNCATED))
    assert inflight.regenerated_tokens == 4
    # An answer from other weights, thrown away, is persisted by no one.
    stray = Received()
    inflight.requesting((1, 1, 1), Sample.unstarted(), stray)
    stray.add(chunk([9], 1, version=7))
    assert [piece.key for piece in inflight.pieces(version=3)] == [KEY]
