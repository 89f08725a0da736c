"""The loopback transport a healing replica takes its peer's state through."""

from __future__ import annotations

import pickle
import threading
import urllib.error
from datetime import timedelta

import pytest
import torch

from elastic_rl.trainer.heal_transport import LoopbackTransport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

TIMEOUT = timedelta(seconds=5)


class Smuggled:
    """Not a tensor nor a plain container: must not be unpickled on the receiving side."""


@pytest.fixture
def transport():
    server = LoopbackTransport(TIMEOUT)
    yield server
    server.shutdown()


def test_state_offered_for_a_step_arrives_whole(transport):
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "optim": {"step": 3, "betas": (0.9, 0.98)}, "rollout": None}
    transport.send_checkpoint([1], step=7, state_dict=state, timeout=TIMEOUT)
    received = LoopbackTransport.recv_checkpoint(transport, 0, transport.metadata(), 7, TIMEOUT)
    assert torch.equal(received["model"]["w"], state["model"]["w"])
    assert received["optim"] == {"step": 3, "betas": (0.9, 0.98)} and received["rollout"] is None


def test_it_listens_on_loopback_only(transport):
    assert transport.metadata().startswith("http://127.0.0.1:")


def test_a_request_waits_for_the_state_of_its_step(transport):
    sender = threading.Timer(0.3, transport.send_checkpoint, args=([1], 4, {"x": torch.ones(2)}, TIMEOUT))
    sender.start()
    received = transport.recv_checkpoint(0, transport.metadata(), 4, TIMEOUT)
    assert torch.equal(received["x"], torch.ones(2))


def test_a_withdrawn_or_other_step_is_not_served():
    # The server waits this long for a step's state before answering 404.
    server = LoopbackTransport(timedelta(seconds=0.3))
    try:
        server.send_checkpoint([1], step=2, state_dict={"x": torch.ones(1)}, timeout=TIMEOUT)
        with pytest.raises(Exception, match="404"):
            server.recv_checkpoint(0, server.metadata(), 3, TIMEOUT)
        server.disallow_checkpoint()
        with pytest.raises(Exception, match="404"):
            server.recv_checkpoint(0, server.metadata(), 2, TIMEOUT)
    finally:
        server.shutdown()


def test_objects_other_than_tensors_and_containers_are_refused(transport):
    transport.send_checkpoint([1], step=1, state_dict={"evil": Smuggled()}, timeout=TIMEOUT)
    with pytest.raises(pickle.UnpicklingError):
        transport.recv_checkpoint(0, transport.metadata(), 1, TIMEOUT)


def test_a_peer_without_the_jobs_secret_gets_nothing():
    server = LoopbackTransport(TIMEOUT, secret="the-job-secret")
    try:
        server.send_checkpoint([1], step=5, state_dict={"x": torch.ones(3)}, timeout=TIMEOUT)
        stranger = LoopbackTransport(TIMEOUT)  # no secret in this test's environment
        peer = LoopbackTransport(TIMEOUT, secret="the-job-secret")
        try:
            with pytest.raises(urllib.error.HTTPError) as refused:
                stranger.recv_checkpoint(0, server.metadata(), 5, TIMEOUT)
            assert refused.value.code == 401
            assert torch.equal(peer.recv_checkpoint(0, server.metadata(), 5, TIMEOUT)["x"], torch.ones(3))
        finally:
            stranger.shutdown()
            peer.shutdown()
    finally:
        server.shutdown()
