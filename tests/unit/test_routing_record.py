"""A mixture of experts' routing record on its way from the engine to the trainer: SGLang's wire format,
a stream's chunks, a continued sample, the group buffer's JSON, the in-flight log across an orchestrator
restart, the rollout log (and its format 2, which has none), and the trainer's replay of it: the engine's
choice where it made one, the router's own elsewhere, again in a recomputed forward."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import torch

from checkpoints import inflight_log, layout
from checkpoints.rollout_log import RolloutBatch, read_rollout, write_rollout
from elastic_rl import routing_record as routing
from elastic_rl.cli.main import main
from elastic_rl.engines.streaming import Received
from elastic_rl.errors import EngineError, RolloutLogError
from elastic_rl.model.routing_replay import LayerReplay, RoutingReplay
from elastic_rl.rollout.groups import Sample, SampleStatus
from elastic_rl.rollout.inflight import InFlight
from elastic_rl.routing_record import NO_ROUTE, RoutingShape
from tests.processes import SPEC

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SHAPE = RoutingShape(layers=2, per_token=2, experts=4)
KEY = (0, 3, 1)


def record(rows: int, start: int = 0) -> torch.Tensor:
    """A record whose every index tells its row (mod the experts)."""
    values = (torch.arange(start, start + rows) % SHAPE.experts).to(torch.int16)
    return values.view(-1, 1, 1).expand(rows, SHAPE.layers, SHAPE.per_token).contiguous()


def chunk(ids: list[int], completion: int, rows: torch.Tensor | None, finish: str | None = None) -> dict:
    meta = {
        "completion_tokens": completion,
        "output_token_logprobs": [[-1.0, token, None] for token in ids],
        "weight_version": "2",
        "finish_reason": None if finish is None else {"type": finish},
    }
    if rows is not None:
        meta[routing.WIRE_KEY] = routing.encode_wire(rows)
    return {"output_ids": ids, "meta_info": meta}


@pytest.mark.parametrize(
    "overrides, named",
    [
        ([], "applies to a mixture of experts only"),  # the toy model is dense
        (["algorithm.kind=sft"], "kind sft"),
        (["rollout.rollout_function=examples.multi_turn_rollout:rollout"], "rollout.rollout_function"),
    ],
)
def test_routing_replay_is_refused_where_there_is_no_routing_to_replay(capsys, overrides, named):
    settings = ["algorithm.routing_replay=true", *overrides]
    code = main(["validate", str(SPEC), *(arg for setting in settings for arg in ("--set", setting))])
    assert code == 2
    assert named in capsys.readouterr().err


def test_the_wire_format_round_trips_and_a_record_of_part_rows_is_refused():
    rows = record(7)
    assert torch.equal(routing.decode_wire(routing.encode_wire(rows), SHAPE), rows)
    with pytest.raises(ValueError, match="not whole rows"):
        routing.decode_wire(routing.encode_wire(rows)[:-8], SHAPE)
    with pytest.raises(ValueError, match="outside"):
        routing.decode_wire(routing.encode_wire(rows + SHAPE.experts), SHAPE)
    assert torch.equal(routing.from_json(orjson.loads(orjson.dumps(routing.to_json(rows)))), rows)


def test_a_stream_takes_whole_records_or_the_rows_after_and_breaks_on_any_other():
    received = Received(routing_shape=SHAPE, input_tokens=4)
    received.add(chunk([11], 1, record(4)))  # a 4-token prompt: its 4 rows, the new token not yet forwarded
    received.add(chunk([11, 12], 2, record(5)))  # whole
    received.add(chunk([13], 3, record(1, start=5)))  # the row after
    assert torch.equal(received.routing, record(6))
    assert routing.WIRE_KEY not in received.answer()["meta_info"]
    torn = chunk([14], 4, record(1, start=6))
    torn["meta_info"][routing.WIRE_KEY] = routing.encode_wire(record(1))[:-4]
    with pytest.raises(EngineError, match="unreadable"):
        received.add(torn)
    with pytest.raises(EngineError, match="holds 2 rows, 6 received before"):
        received.add(chunk([14], 4, record(2, start=6)))
    # A request that did not ask reads no record.
    plain = Received(input_tokens=4)
    plain.add(chunk([11], 1, record(4)))
    assert plain.routing is None


def test_a_continued_sample_keeps_its_prefixs_rows_and_takes_the_rest_from_the_new_request():
    first = Sample.unstarted().continued([11, 12], [-1.0, -1.0], 2, SampleStatus.UNFINISHED, record(5))
    # A 4-token prompt. The continuing engine routed its whole input again (6 tokens: prompt and prefix) and one more.
    again = record(7, start=100)
    done = first.continued([13, 14], [-1.0, -1.0], 2, SampleStatus.COMPLETED, again)
    assert torch.equal(done.routing, torch.cat([record(5), again[5:]]))
    assert len(done.routing) == 4 + 4 - 1
    back = Sample.from_json(orjson.loads(orjson.dumps(done.to_json())))
    assert torch.equal(back.routing, done.routing) and back.output_ids == done.output_ids
    # A request that returned no record leaves the sample's as it was.
    assert torch.equal(first.continued([13], [-1.0], 2, SampleStatus.UNFINISHED).routing, record(5))


def test_the_inflight_log_carries_the_record_across_an_orchestrator_restart(tmp_path):
    async def scenario():
        first = InFlight(tmp_path)
        await first.begin(2, oldest_allowed=2)
        received = Received(routing_shape=SHAPE, input_tokens=4)
        first.requesting(KEY, Sample.unstarted(), received)
        received.add(chunk([21], 1, record(4)))
        await first.persist(version=2)
        received.add(chunk([21, 22, 23], 3, record(6)))
        await first.persist(version=2)

        second = InFlight(tmp_path)
        await second.begin(2, oldest_allowed=2)
        resumed = second.resumed(KEY, Sample.unstarted())
        assert resumed.output_ids == [21, 22, 23] and torch.equal(resumed.routing, record(6))
        more = Received(routing_shape=SHAPE, input_tokens=7)
        second.requesting(KEY, resumed, more)
        more.add(chunk([24], 1, record(7, start=50), finish="stop"))
        done = resumed.continued(more.output_ids, more.logprobs, 2, SampleStatus.COMPLETED, more.routing)
        second.done(KEY, done)
        await second.persist(version=2)
        logged = inflight_log.read(tmp_path, 2)[KEY]
        assert logged.output_ids == [21, 22, 23, 24]
        assert torch.equal(logged.routing, torch.cat([record(6), record(7, start=50)[6:]]))

    asyncio.run(scenario())
    assert layout.inflight_path(tmp_path, 2).is_file()


def batch(routed: torch.Tensor | None) -> RolloutBatch:
    rows, width = 2, 6
    return RolloutBatch(
        tokens=torch.arange(rows * width).view(rows, width),
        prompt_lengths=torch.tensor([3, 3]),
        response_lengths=torch.tensor([3, 2]),
        engine_logprobs=torch.zeros(rows, width),
        rewards=torch.tensor([1.0, 0.0]),
        prompt_indices=torch.tensor([0, 0]),
        prompt_epochs=torch.tensor([0, 0]),
        weight_versions=torch.tensor([0, 0]),
        loss_mask=torch.zeros(rows, width),
        routed_experts=routed,
    )


def test_the_rollout_log_commits_the_records_and_reads_format_2_without_them(tmp_path):
    stored = routing.stored([record(5), record(4)], 6, SHAPE)
    assert stored.dtype is torch.uint8 and stored.shape == (2, 6, 2, 2)
    replayed = routing.replayable(stored)
    assert torch.equal(replayed[0, :5], record(5).long()) and bool((replayed[0, 5:] == NO_ROUTE).all())
    assert bool((replayed[1, 4:] == NO_ROUTE).all())
    wide = RoutingShape(layers=2, per_token=2, experts=300)
    assert routing.stored([None], 3, wide).dtype is torch.int16
    assert bool((routing.replayable(routing.stored([None], 3, wide)) == NO_ROUTE).all())

    write_rollout(tmp_path, 0, batch(stored), {})
    read, _ = read_rollout(tmp_path, 0)
    assert torch.equal(read.routed_experts, stored) and torch.equal(read.select(slice(1, 2)).routed_experts, stored[1:])

    write_rollout(tmp_path, 1, batch(None), {})
    meta_path = layout.rollout_dir(tmp_path, 1) / layout.META_FILE
    meta = orjson.loads(meta_path.read_bytes())
    meta_path.write_bytes(orjson.dumps({**meta, "format": 2}))
    old, _ = read_rollout(tmp_path, 1)
    assert old.routed_experts is None
    meta_path.write_bytes(orjson.dumps({**meta, "format": 1}))
    with pytest.raises(RolloutLogError, match="format 1"):
        read_rollout(tmp_path, 1)


def own_top2(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


class _Owner:
    """A fake of ``RoutingReplay``: what a layer's replay reads of it."""

    counting, queuing = False, False

    def __init__(self):
        self.agreed = torch.zeros((), dtype=torch.float64)
        self.replayed = torch.zeros((), dtype=torch.float64)


def test_a_layer_replays_the_engines_choice_where_it_made_one_and_counts_agreement():
    owner = _Owner()
    layer = LayerReplay(owner, moe_layer=0)
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [1.0, 4.0, 2.0, 3.0]])
    assert torch.equal(layer.get_replay_topk(scores, 2, default_compute_topk=own_top2)[1], own_top2(scores, 2)[1])
    layer.target_topk_idx = torch.tensor([[1, 0], [0, 1], [NO_ROUTE, NO_ROUTE]])
    owner.counting = True
    probs, chosen = layer.get_replay_topk(scores, 2, default_compute_topk=own_top2)
    # Token 0: the router's own pair in another order; token 1: another pair; token 2: no row, its own.
    assert chosen.tolist() == [[1, 0], [0, 1], [1, 3]]
    assert probs.tolist() == [[3.0, 4.0], [1.0, 2.0], [4.0, 3.0]]
    assert owner.agreed.item() == 1 and owner.replayed.item() == 2


def test_a_recomputed_forward_replays_the_routing_of_its_own_micro_batch():
    owner = _Owner()
    owner.queuing = True  # the trainer's training pass, with trainer.recompute full
    layer = LayerReplay(owner, moe_layer=0)
    chosen_in_backward = []

    def routed(x: torch.Tensor) -> torch.Tensor:
        probs, chosen = layer.get_replay_topk(x * 1.0, 1, default_compute_topk=own_top2)
        if torch._C._current_graph_task_id() != -1:
            chosen_in_backward.append(chosen.tolist())
        return probs.sum()

    losses = []
    for target in ([[2], [3]], [[0], [1]]):  # two micro-batches' forwards, then their backwards
        layer.target_topk_idx = torch.tensor(target)
        x = torch.ones(2, 4, requires_grad=True)
        losses.append(torch.utils.checkpoint.checkpoint(routed, x, use_reentrant=True))
        layer.target_topk_idx = None
    for loss in losses:
        loss.backward()
    assert chosen_in_backward == [[[2], [3]], [[0], [1]]]


def test_replay_reaches_only_the_model_it_is_attached_to(monkeypatch):
    monkeypatch.setattr("elastic_rl.model.routing_replay.TopKRouter", _FakeRouter)
    model = _FakeModel()
    replay = RoutingReplay.attach(model)
    assert model.routing_replay is replay and model.router.router_replay is replay.layers[0]
    assert RoutingReplay.attach(torch.nn.Linear(2, 2)) is None
    routed = torch.tensor([[[[1, 2]], [[3, 0]]]])  # [batch 1, seq 2, layers 1, topk 2]
    with replay.replaying(routed):
        assert replay.layers[0].target_topk_idx.tolist() == [[1, 2], [3, 0]]
    assert replay.layers[0].target_topk_idx is None


class _FakeRouter(torch.nn.Module):
    """A fake of megatron's TopKRouter: the attributes the replay reads."""

    layer_number = 1
    router_replay = None


class _FakeModel(torch.nn.Module):
    """A fake of a megatron model holding one router."""

    def __init__(self):
        super().__init__()
        self.router = _FakeRouter()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"recompute_granularity": None, "sequence_parallel": False})()
