"""A user's own rollouts under erld, with the exactly-once guarantees: the multi-turn rollout function
(examples/multi_turn_rollout.py) trains the tiny job, only the model's turns in the loss, and an
orchestrator SIGKILLed inside the function changes nothing (each rollout committed once, weights bitwise
equal to a fault-free run's); a reward model served over HTTP by examples/reward_server.py scores the
tiny job, which learns, loses no group while the model is down and started again, and fails with the
reason when the model is down for good. One erld runs every job here."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import mean

import orjson
import pytest
from safetensors.torch import load_file

from chaos.invariants import check_run, read_spec
from checkpoints import layout
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.net import free_port, url
from tests.integration.erld_support import job_events, metrics, run_job, running_daemon, status
from tests.processes import REPO, Server
from tests.rollouts import calls

pytestmark = [pytest.mark.integration]

KILLED_IN = 1
ROLLOUTS = 2
ROLLOUT_FUNCTION_JOB = [
    "--set",
    "rollout.rollout_function=tests.rollouts:multi_turn_then_settle",
    "--set",
    f"rollout.num_rollouts={ROLLOUTS}",
    "--set",
    "rollout.prompts_per_rollout=8",
    "--set",
    "rollout.n_samples_per_prompt=4",
    "--set",
    "rollout.max_new_tokens=24",
    "--set",
    "trainer.global_batch_size=32",
    "--set",
    "trainer.micro_batch_size=32",
    "--set",
    "checkpoints.keep_last=1000",  # the rollout log is read back
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("custom-rollouts")) as topology:
        yield topology


def inside_the_function(rollout_id: int):
    """A moment: the rollout function has made rollout ``rollout_id``'s samples and not returned them."""

    def moment(workdir: Path) -> bool:
        return bool(calls(workdir, rollout_id)) and rollout_id not in layout.committed_rollouts(workdir)

    return moment


@pytest.mark.timeout(300)
def test_a_multi_turn_rollout_function_trains_and_an_orchestrator_killed_inside_it_changes_nothing(daemon, tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, ROLLOUT_FUNCTION_JOB)
    injected = run_job(daemon, faulty, ROLLOUT_FUNCTION_JOB, [("orchestrator", inside_the_function(KILLED_IN))])
    assert injected == ["orchestrator"]

    # The function made rollout 1 twice, once in each orchestrator; the rollout was committed once, and the
    # run ends with the fault-free run's weights, bit for bit.
    assert len(calls(faulty, KILLED_IN)) == 2
    assert any(e["kind"] == "proc_restarted" and e["proc"] == "orchestrator" for e in job_events(faulty))
    checks = check_run(faulty, clean, status(daemon, "tiny-grpo")["status"], tolerance=0.0)
    assert all(check.held for check in checks), [check for check in checks if not check.held]

    tokenizer = load_tokenizer(read_spec(faulty).model)
    tool_calls = 0
    for rollout_id in range(ROLLOUTS):
        folder = layout.rollout_dir(faulty, rollout_id)
        batch = load_file(str(folder / "batch.safetensors"))
        meta = orjson.loads((folder / layout.META_FILE).read_bytes())
        tool_calls += assert_the_loss_covers_only_the_models_turns(batch, meta, tokenizer)
    assert tool_calls > 0
    assert [line["rollout/rollout_function_failures"] for line in metrics(faulty)] == [0.0] * ROLLOUTS


def assert_the_loss_covers_only_the_models_turns(batch: dict, meta: dict, tokenizer) -> int:
    """Each sample's loss mask is 1 exactly at the model's tokens: 0 at the calculator's answers (which
    decode to what the metadata says, with no engine log prob) and outside the response. Returns how many
    tool answers the rollout holds."""
    calls = 0
    for row, record in enumerate(meta["samples"]):
        start = int(batch["prompt_lengths"][row])
        end = start + int(batch["response_lengths"][row])
        tool = set()
        for call in record["metadata"]["tool_calls"]:
            span = range(start + call["start"], start + call["end"])
            assert tokenizer.decode(batch["tokens"][row, span.start : span.stop].tolist()) == call["answer"]
            tool |= set(span)
            calls += 1
        assert record["metadata"]["turns"] == 1 + len(record["metadata"]["tool_calls"])
        mask = batch["loss_mask"][row].tolist()
        assert mask == [1.0 if start <= t < end and t not in tool else 0.0 for t in range(len(mask))]
        assert all(batch["engine_logprobs"][row, t] == 0.0 for t in tool)
    return calls


def start_reward_server(port: int, log: Path) -> Server:
    """examples/reward_server.py scoring toy_copy on ``port``, once it accepts connections."""
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "examples.reward_server", "--port", str(port), "--reward", "toy_copy"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Server(process, port)
        except OSError:
            time.sleep(0.1)


def reward_model_job(port: int, *settings: str) -> list[str]:
    return ["--set", f"rollout.reward_model={{url: '{url(port)}/', batch_size: 16{''.join(settings)}}}"]


OUTAGE_S = 4.0
LEARNING_ROLLOUTS = 10


@pytest.mark.timeout(300)
def test_a_reward_model_down_for_a_while_loses_no_group_and_the_job_learns(daemon, tmp_path):
    port = free_port()
    job = [
        *reward_model_job(port),
        "--set",
        f"rollout.num_rollouts={LEARNING_ROLLOUTS}",
        "--set",
        "checkpoints.keep_last=1000",
    ]
    log = tmp_path / "reward-model.log"
    servers = [start_reward_server(port, log)]

    def outage() -> None:
        """The reward model killed, and started again OUTAGE_S later (longer than its first retries)."""
        servers[-1].kill()
        threading.Timer(OUTAGE_S, lambda: servers.append(start_reward_server(port, log))).start()

    try:
        assert run_job(daemon, tmp_path / "job", job, [(outage, 3)]) == ["outage"]
    finally:
        for server in servers:
            server.stop()

    lines = metrics(tmp_path / "job")
    assert [line["rollout"] for line in lines] == list(range(LEARNING_ROLLOUTS))
    assert sum(line["rollout/reward_model_failures"] for line in lines) >= 2
    samples = 32 * 16
    assert all(line["rollout/samples_used"] == samples and line["rollout/unscorable_samples"] == 0 for line in lines)
    for rollout_id in range(LEARNING_ROLLOUTS):
        meta = orjson.loads((layout.rollout_dir(tmp_path / "job", rollout_id) / layout.META_FILE).read_bytes())
        assert meta["dropped_groups"] == [] and len(meta["drawn_prompts"]) == 32  # none lost, none drawn again
    rewards = [line["rollout/reward_mean"] for line in lines]
    assert mean(rewards[-3:]) >= mean(rewards[:3]) + 0.06, rewards


@pytest.mark.timeout(200)
def test_a_reward_model_down_for_good_fails_the_job_with_the_reason(daemon, tmp_path):
    port = free_port()  # nothing listens there
    run_job(daemon, tmp_path, reward_model_job(port, ", max_failures: 2"), expect=("failed",))
    reason = status(daemon, "tiny-grpo")["status"]["reason"]
    assert f"the reward model at {url(port)}/ failed 2 times in a row" in reason, reason
    assert not layout.committed_rollouts(tmp_path)
