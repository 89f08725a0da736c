"""The pure parts of the NCCL weight sync: the group's ranks, the buckets, the requests' fields (SGLang's
names), and the watchdog that aborts a sync that hangs. The broadcast itself needs GPUs and SGLang
(tests/gpu/test_sglang_job.py)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from elastic_rl.engines.client import EngineClient
from elastic_rl.trainer.watchdog import Watchdog
from elastic_rl.trainer.weight_broadcast import ABORT_GRACE_S, buckets, dtype_name, group_layout
from policies.exits import EXIT_SYNC_HUNG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_the_trainer_is_rank_0_and_each_engine_gets_a_rank_per_tensor_parallel_rank():
    layout = group_layout(engines=3, tp_size=2)
    assert layout.world_size == 7
    assert layout.rank_offsets == (1, 3, 5)
    assert group_layout(engines=1, tp_size=1).rank_offsets == (1,)


def test_buckets_keep_the_order_and_their_size():
    state = {name: torch.zeros(n, dtype=torch.float32) for name, n in [("a", 100), ("b", 100), ("c", 300), ("d", 10)]}
    cut = list(buckets(state, max_bytes=1000))
    assert [list(bucket) for bucket in cut] == [["a", "b"], ["c"], ["d"]]  # "c" alone: larger than a bucket
    assert [name for bucket in cut for name in bucket] == list(state)


def test_dtypes_are_named_as_sglang_reads_them():
    assert dtype_name(torch.float32) == "float32" and dtype_name(torch.bfloat16) == "bfloat16"
    assert getattr(torch, dtype_name(torch.bfloat16)) is torch.bfloat16


def test_the_requests_carry_sglangs_fields(monkeypatch):
    sent = []

    async def record(self, method, path, body=None, timeout_s=None):
        sent.append((method, path, body, timeout_s))
        return {"success": True}

    monkeypatch.setattr(EngineClient, "_call", record)
    client = EngineClient("http://engine")

    async def calls():
        await client.init_weights_update_group("10.0.0.2", 29500, 3, 7, "erl-weights-4", timeout_s=60)
        await client.update_weights_from_distributed(["w"], ["float32"], [[2, 3]], "erl-weights-4", 60, "4")
        await client.update_weights_from_distributed(["v"], ["float32"], [[1]], "erl-weights-4", 60, flush_cache=False)
        await client.destroy_weights_update_group("erl-weights-4", 10)

    asyncio.run(calls())
    init, last, first, destroy = sent
    assert init[:2] == ("POST", "/init_weights_update_group") and init[3] == 60
    assert init[2] == {
        "master_address": "10.0.0.2",
        "master_port": 29500,
        "rank_offset": 3,
        "world_size": 7,
        "group_name": "erl-weights-4",
        "backend": "nccl",
    }
    assert last[1] == "/update_weights_from_distributed"
    assert last[2] == {
        "names": ["w"],
        "dtypes": ["float32"],
        "shapes": [[2, 3]],
        "group_name": "erl-weights-4",
        "flush_cache": True,
        "weight_version": "4",
    }
    assert "weight_version" not in first[2] and first[2]["flush_cache"] is False
    assert destroy[1:3] == ("/destroy_weights_update_group", {"group_name": "erl-weights-4"})


def sync_watchdog(timeout_s, on_expiry, grace_s=ABORT_GRACE_S, exit=os._exit) -> Watchdog:
    """The weight sync's watchdog, as the broadcaster makes it."""
    return Watchdog(timeout_s, "the weight sync", EXIT_SYNC_HUNG, on_expiry, grace_s, exit)


def test_the_watchdog_aborts_a_block_that_overruns_and_spares_one_that_does_not():
    unblocked = threading.Event()
    with sync_watchdog(0.2, unblocked.set) as watchdog:
        assert unblocked.wait(5), "the watchdog did not fire"  # stands in for a hung NCCL call that abort() ends
    assert watchdog.expired.is_set()

    fired = threading.Event()
    with sync_watchdog(0.5, fired.set) as quick:
        assert 0 < quick.remaining() <= 0.5
    time.sleep(0.7)
    assert not fired.is_set() and not quick.expired.is_set()


class FakeExit:
    """Stands in for os._exit: records the code instead of ending the test process."""

    def __init__(self):
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def test_a_sync_that_its_abort_does_not_end_ends_the_trainer_for_erld_to_restart():
    fake_exit = FakeExit()
    with sync_watchdog(0.1, lambda: None, grace_s=0.2, exit=fake_exit):  # an abort that frees nothing
        assert fake_exit.called.wait(5), "the last resort did not come"
    assert fake_exit.codes == [EXIT_SYNC_HUNG]


def test_an_abort_that_hangs_itself_still_ends_the_trainer():
    released = threading.Event()
    fake_exit = FakeExit()
    try:
        with sync_watchdog(0.1, released.wait, grace_s=0.2, exit=fake_exit):  # abort() blocks
            assert fake_exit.called.wait(5), "the last resort waited for the abort"
    finally:
        released.set()
    assert fake_exit.codes == [EXIT_SYNC_HUNG]


def test_a_sync_that_its_abort_ends_within_the_grace_keeps_the_trainer():
    fake_exit = FakeExit()
    unblocked = threading.Event()
    with sync_watchdog(0.1, unblocked.set, grace_s=0.3, exit=fake_exit) as watchdog:
        assert unblocked.wait(5)  # the aborted broadcast returns
    time.sleep(0.5)
    assert watchdog.expired.is_set() and fake_exit.codes == []
