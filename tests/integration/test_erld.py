"""The tiny job under a real erld, a real embedded etcd and real job processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from checkpoints import layout
from elastic_rl.event_kinds import EventKind
from elastic_rl.metric_names import registered
from elastic_rl.net import free_port
from elastic_rl.store import keys
from elastic_rl.store.client import Store
from elastic_rl.store.embedded import EmbeddedEtcd
from tests.integration.erld_support import erl, metrics, receive, status, wait_phase
from tests.processes import REPO, SPEC
from tests.wandb_history import history

pytestmark = [pytest.mark.integration]

# A short version of examples/tiny-grpo.yaml that still learns.
SHORT_JOB = [
    "--set",
    "rollout.num_rollouts=30",
    "--set",
    "metrics.tensorboard=true",
    "--set",
    "metrics.wandb_offline=true",
]
# The other advantage estimators, as jobs beside it on the same erld: GSPO with per-sequence loss
# aggregation, and REINFORCE++ with TIS, off-policy sequence masking and its KL in the reward.
OTHER_ESTIMATORS = {
    # GSPO also takes the engines' log probs as the old policy's: no old-policy pass of the trainer's own.
    "tiny-gspo": [
        "algorithm.advantage_estimator=gspo",
        "algorithm.loss_aggregation=seq_mean_token_mean",
        "algorithm.use_rollout_logprobs=true",
    ],
    "tiny-reinforce": [
        "algorithm.advantage_estimator=reinforce_plus_plus",
        "algorithm.tis_cap=2.0",
        "algorithm.kl_coef=0.001",
        "algorithm.kl_in_reward=true",
        "algorithm.opsm=true",
    ],
}

# PPO: a critic beside the policy, which learns alone for the first two rollouts. Measured at this length,
# its last five rollouts average 0.90 reward (40 rollouts; the tiny GRPO job rises about 0.4 in 30).
PPO_JOB = [
    "name=tiny-ppo",
    "rollout.num_rollouts=40",
    "engines.count=1",
    "algorithm.advantage_estimator=ppo",
    "algorithm.critic.warmup_rollouts=2",
]

# The distillation student: the tiny job on one engine, as many rollouts as its teacher had, at a constant
# learning rate, with a reward that scores a group's samples alike (no signal for GRPO), its teacher served
# by an engine of its own. lr 0.01: at the tiny job's 0.003 it has 70 % of its teacher's reward after 20 rollouts.
STUDENT_ROLLOUTS = 30
STUDENT = [
    "name=tiny-distil",
    f"rollout.num_rollouts={STUDENT_ROLLOUTS}",
    "engines.count=1",
    "trainer.lr=0.01",
    "trainer.lr_decay=constant",
    "rollout.group_reward_function=tests.rewards:group_copy_rate",
    "algorithm.distillation.engines.count=1",
]
GROUPS_PER_ROLLOUT, SAMPLES_PER_ROLLOUT = 32, 512  # the tiny job's; the teacher scores a group a request


def teacher_answers(workdir: Path) -> int:
    """Scoring requests the job's teacher engines have answered, from their logs (one line each)."""
    return sum(log.read_text().count("POST /generate") for log in (workdir / "logs").glob("teacher-*.log"))


def kill_the_teacher_as_it_scores_rollout_3(daemon, student: Path, abandoned: threading.Event) -> int:
    """Stop the student's teacher engine at its first answer for rollout 3, as its groups finish generating,
    and kill it a second later; its pid. Gives up when ``abandoned`` is set (the test failed meanwhile)."""
    deadline = time.monotonic() + 300
    while (killed := status(daemon, "tiny-distil")["procs"].get("teacher-0", {}).get("pid")) is None:
        assert time.monotonic() < deadline and not abandoned.is_set(), status(daemon, "tiny-distil")
        time.sleep(0.1)
    while teacher_answers(student) <= 3 * GROUPS_PER_ROLLOUT:  # its first answer for rollout 3: more will come
        assert time.monotonic() < deadline and not abandoned.is_set(), status(daemon, "tiny-distil")
        time.sleep(0.01)
    # Stopped first, so that the requests the rest of the rollout sends meanwhile are in flight at the kill.
    os.kill(killed, signal.SIGSTOP)
    time.sleep(1.0)
    os.kill(killed, signal.SIGKILL)
    return killed


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.timeout(600)
def test_tiny_job_runs_to_completion_and_reward_rises(daemon, tmp_path):
    """The tiny GRPO job through `erl run`, with a GSPO, a REINFORCE++ and a PPO job beside it on the same
    erld, and a student distilled from the GSPO job (together they cost less than one after the other: a
    job start is mostly waiting on imports)."""
    jobs = {
        **{
            name: [f"name={name}", "rollout.num_rollouts=30", "engines.count=1", *o]
            for name, o in OTHER_ESTIMATORS.items()
        },
        "tiny-ppo": PPO_JOB,
    }
    for name, overrides in jobs.items():
        sets = [arg for o in overrides for arg in ("--set", o)]
        erl("submit", str(SPEC), *sets, "--workdir", str(tmp_path / name), "--etcd", daemon.endpoint, check=True)
    # The GSPO job, once trained, teaches a distillation student, which runs beside the GRPO job.
    assert wait_phase(daemon, "tiny-gspo", ("succeeded", "failed"), time.monotonic() + 300)["status"]["phase"] == (
        "succeeded"
    )
    student = tmp_path / "tiny-distil"
    teacher = max(
        (p for p in (tmp_path / "tiny-gspo" / "weights").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    )
    sets = [arg for o in [f"algorithm.distillation.teacher={teacher}", *STUDENT] for arg in ("--set", o)]
    erl("submit", str(SPEC), *sets, "--workdir", str(student), "--etcd", daemon.endpoint, check=True)
    workdir = tmp_path / "job"
    abandoned = threading.Event()
    with ThreadPoolExecutor(1) as background:
        killing = background.submit(kill_the_teacher_as_it_scores_rollout_3, daemon, student, abandoned)
        try:
            run = erl("run", str(SPEC), *SHORT_JOB, "--workdir", str(workdir), "--etcd", daemon.endpoint, timeout=540)
        except BaseException:
            abandoned.set()
            raise
        killed = killing.result()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "succeeded" in run.stdout
    # GSPO and REINFORCE++ learn too: the last 5 rollouts at least 0.5 above the first 5.
    for name in OTHER_ESTIMATORS:
        assert (
            wait_phase(daemon, name, ("succeeded", "failed"), time.monotonic() + 300)["status"]["phase"] == "succeeded"
        )
        rewards = [line["rollout/reward_mean"] for line in metrics(tmp_path / name)]
        assert len(rewards) == 30 and mean(rewards[-5:]) >= mean(rewards[:5]) + 0.5, (name, rewards)
    # Without its own pass the trainer measures its gap to the engine on each rollout's first step: on CPU
    # slots both compute in fp32, so the engines' log probs stand for the trainer's.
    assert metrics(tmp_path / "tiny-gspo")[0]["train/logprob_abs_diff_max"] <= 1e-5
    # PPO learned the task: past 0.8, its critic's values explaining more of the returns as it went, and the
    # policy still for the critic's warmup rollouts.
    assert (
        wait_phase(daemon, "tiny-ppo", ("succeeded", "failed"), time.monotonic() + 300)["status"]["phase"]
        == "succeeded"
    )
    ppo = metrics(tmp_path / "tiny-ppo")
    rewards = [line["rollout/reward_mean"] for line in ppo]
    assert len(rewards) == 40 and mean(rewards[-5:]) >= 0.8, rewards
    explained = [line["train/explained_variance"] for line in ppo]
    assert mean(explained[-5:]) > mean(explained[:5]), explained
    assert [line["train/grad_norm"] == 0.0 for line in ppo[:3]] == [True, True, False]
    assert ppo[0]["train/critic_grad_norm"] > 0, ppo[0]
    assert all(line["train/value_loss"] >= 0 and 0 <= line["train/value_clipfrac"] <= 1 for line in ppo)
    # OPSM acted (a rollout's later steps find sequences that drifted) and the job learned all the same.
    masked = [line["train/opsm_masked_fraction"] for line in metrics(tmp_path / "tiny-reinforce")]
    assert all(0.0 <= share <= 1.0 for share in masked) and max(masked) > 0, masked

    lines = metrics(workdir)
    assert [line["rollout"] for line in lines] == list(range(30))
    rewards = [line["rollout/reward_mean"] for line in lines]
    assert sum(rewards[:5]) / 5 <= 0.2
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.15, rewards
    # slime's CI checks: the trainer's recomputed log probs equal the engine's on the
    # first rollout, and the PPO KL of the first step of every rollout is exactly 0.
    assert lines[0]["train/logprob_abs_diff_max"] <= 1e-5
    assert all(line["train/first_step_ppo_kl"] == 0.0 for line in lines)
    for key in (
        "rollout/reward_std",
        "rollout/response_length_mean",
        "train/entropy",
        "train/clipfrac",
        "train/grad_norm",
        "train/step_time",
        "rollout/time",
        "perf/generated_tokens_per_sec",
        "perf/longest_sample_tokens_per_sec",
        "train/kl",
    ):
        assert key in lines[0]
    # Every metric written and every event recorded is in its registry (the docs' references list them).
    assert not [key for line in lines for key in line if not registered(key)]
    assert {event["kind"] for event in layout.read_lines(layout.events_path(workdir))} <= set(EventKind)
    # Where each iteration's time went, from both sides (docs/operations/monitoring.md).
    accounting = (
        "perf/iteration_time",
        "rollout/wait_weights_time",
        "rollout/weights_load_time",
        "rollout/eval_time",
        "rollout/commit_time",
        "train/wait_rollout_time",
        "train/prepare_time",
        "train/rollout_train_time",
        "train/export_time",
    )
    assert all(line[key] >= 0.0 for line in lines[1:] for key in accounting), lines[1]

    final = status(daemon, "tiny-grpo")
    assert final["status"]["phase"] == "succeeded"
    assert final["progress"]["rollouts_done"] == 30
    assert "tiny-grpo" in erl("list", "--etcd", daemon.endpoint, check=True).stdout
    text = erl("status", "tiny-grpo", "--etcd", daemon.endpoint, check=True).stdout
    assert "job tiny-grpo: succeeded" in text and "rollouts: 30/30" in text and "orchestrator" in text
    logs = erl("logs", "tiny-grpo", "--proc", "orchestrator", "--etcd", daemon.endpoint, check=True).stdout
    assert "rollout 29 committed" in logs
    # The metrics also went to TensorBoard, one reward point per rollout.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(workdir / "tensorboard"))
    board.Reload()
    assert [event.step for event in board.Scalars("rollout/reward_mean")] == list(range(30))
    # And to an offline W&B run, the same reward at the same step.
    logged = history(workdir / "wandb")
    assert [row["_step"] for row in logged] == list(range(30))
    assert [row["rollout/reward_mean"] for row in logged] == [line["rollout/reward_mean"] for line in lines]
    # Engine logs hold the requests, not a line per health check, and no tracebacks.
    for engine_log in (workdir / "logs").glob("engine-*.log"):
        text = engine_log.read_text()
        assert "POST /generate" in text and "GET /health" not in text and "Traceback" not in text

    # On-policy distillation from the GSPO job, as the teacher of a student from the same start. The
    # student's reward gives every sample of a group the same score, so GRPO teaches it nothing: what it
    # learns of the task it learns from the teacher, as its reverse KL to the teacher falls, until it
    # scores as the teacher does. The teacher engine was killed while it scored rollout 3.
    final = wait_phase(daemon, "tiny-distil", ("succeeded", "failed"), time.monotonic() + 300)
    assert final["status"]["phase"] == "succeeded", final
    assert final["procs"]["teacher-0"]["pid"] != killed
    taught = metrics(student)
    reward = [line["rollout/reward_mean"] for line in taught]
    teacher_reward = [line["rollout/reward_mean"] for line in metrics(tmp_path / "tiny-gspo")]
    assert mean(reward[-3:]) >= mean(teacher_reward[-3:]) - 0.05, (reward, teacher_reward)
    reverse_kl = [line["train/distillation_reverse_kl"] for line in taught]
    assert reverse_kl[-1] < 0.5 * reverse_kl[0], reverse_kl
    # The requests the kill broke were sent again, to its replacement; every trained sample was scored once.
    assert taught[3]["rollout/teacher_failures"] > 0, [line["rollout/teacher_failures"] for line in taught]
    assert [line["rollout/teacher_scored"] for line in taught] == [SAMPLES_PER_ROLLOUT] * STUDENT_ROLLOUTS
    assert teacher_answers(student) == STUDENT_ROLLOUTS * GROUPS_PER_ROLLOUT

    # The finished job plots, `erl logs -f` ends with it (here: at once), printing what the logs hold.
    plotted = erl("plot", "tiny-grpo", "--etcd", daemon.endpoint, check=True)
    assert (workdir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plotted.stdout
    followed = erl("logs", "tiny-grpo", "-f", "--proc", "orchestrator", "--etcd", daemon.endpoint, timeout=20)
    assert followed.returncode == 0 and "rollout 29 committed" in followed.stdout
    # A reader that goes away early gets no traceback and no failure.
    for command in ("status tiny-grpo", "logs tiny-grpo"):
        piped = subprocess.run(
            [
                "bash",
                "-c",
                f"set -o pipefail; {sys.executable} -m elastic_rl.cli {command} --etcd {daemon.endpoint} | head -1",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert piped.returncode == 0 and piped.stderr == "" and len(piped.stdout.splitlines()) == 1, piped


@pytest.mark.timeout(600)
def test_killed_erld_restarts_and_the_job_completes(daemon, tmp_path):
    workdir = tmp_path / "job"
    submitted = erl(
        "submit",
        str(SPEC),
        "--set",
        "rollout.num_rollouts=15",
        "--workdir",
        str(workdir),
        "--etcd",
        daemon.endpoint,
        check=True,
    )
    assert "erl status tiny-grpo" in submitted.stdout
    deadline = time.monotonic() + 300
    while status(daemon, "tiny-grpo")["progress"].get("rollouts_done", 0) < 3:
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.5)
    before = {name: proc["pid"] for name, proc in status(daemon, "tiny-grpo")["procs"].items()}

    daemon.nodes[0].restart()

    while status(daemon, "tiny-grpo")["status"]["phase"] == "running":
        assert time.monotonic() < deadline + 200, "the job did not finish after erld restarted"
        time.sleep(0.5)
    final = status(daemon, "tiny-grpo")
    assert final["status"]["phase"] == "succeeded", final
    assert final["progress"]["rollouts_done"] == 15
    # The job's processes survived erld's death and were adopted, not restarted.
    assert before["trainer-0-0"] == final["procs"]["trainer-0-0"]["pid"]
    events = final["events"] + status(daemon, "tiny-grpo")["events"]
    assert any(event["kind"] == "job_adopted" for event in events)
    # The adopted trainer's exit at the job's end is known (it recorded it), not taken for a crash.
    assert not [event for event in events if event["kind"] == "proc_exited"], events
    assert [line["rollout"] for line in metrics(workdir)] == list(range(15))


@pytest.mark.timeout(300)
def test_process_that_keeps_crashing_fails_the_job_with_a_reason(daemon, tmp_path):
    run = erl(
        "run",
        str(SPEC),
        "--workdir",
        str(tmp_path / "job"),
        "--etcd",
        daemon.endpoint,
        "--set",
        "rollout.reward=tests.rewards:exits_the_process",
        "--set",
        "fault_tolerance.max_restarts=1",
        timeout=240,
    )
    assert run.returncode == 1
    final = status(daemon, "tiny-grpo")
    assert final["status"]["phase"] == "failed"
    assert "orchestrator" in final["status"]["reason"] and "restart budget 1" in final["status"]["reason"]
    assert final["procs"]["orchestrator"]["state"] == "failed"

    # A user's function that cannot be imported would fail every restart the same way: no restart.
    run = erl(
        "run",
        str(SPEC),
        "--workdir",
        str(tmp_path / "job2"),
        "--etcd",
        daemon.endpoint,
        "--set",
        "name=unimportable",
        "--set",
        "rollout.reward=no_such_module:score",
        timeout=240,
    )
    assert run.returncode == 1
    reason = status(daemon, "unimportable")["status"]["reason"]
    assert "orchestrator gave up: rollout.reward: cannot load 'no_such_module:score'" in reason, reason


@pytest.mark.timeout(300)
def test_stop_then_sigterm(daemon, tmp_path):
    erl("submit", str(SPEC), "--workdir", str(tmp_path / "job"), "--etcd", daemon.endpoint, check=True)
    deadline = time.monotonic() + 120
    while status(daemon, "tiny-grpo")["progress"].get("rollouts_done", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    pids = [proc["pid"] for proc in status(daemon, "tiny-grpo")["procs"].values()]
    assert "stopping" in erl("stop", "tiny-grpo", "--etcd", daemon.endpoint, check=True).stdout
    while status(daemon, "tiny-grpo")["status"]["phase"] != "stopped":
        assert time.monotonic() < deadline + 60
        time.sleep(0.3)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    receive(daemon.notify, 1, until="__drain__")
    daemon.nodes[0].process.send_signal(signal.SIGTERM)
    messages = receive(daemon.notify, 30, until="STOPPING=1")
    assert "STOPPING=1" in messages
    assert daemon.nodes[0].process.wait(timeout=60) == 0


def test_watchdog_and_status_while_running(daemon):
    receive(daemon.notify, 1, until="__drain__")
    messages = receive(daemon.notify, 3, until="__never__")
    assert "WATCHDOG=1" in messages
    assert any(m.startswith("STATUS=node test-node") for m in messages)


@pytest.mark.timeout(120)
def test_sigterm_revokes_the_lease_on_an_external_etcd(tmp_path):
    etcd = EmbeddedEtcd(tmp_path / "etcd-state", client_port=free_port())
    asyncio.run(etcd.start())
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elastic_rl.cli",
                "daemon",
                "--etcd",
                etcd.endpoint,
                "--state-dir",
                str(tmp_path / "erld-state"),
                "--node",
                "leaving-node",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        async def node_keys() -> dict:
            async with Store(etcd.endpoint) as store:
                return await store.get_prefix(keys.NODES)

        deadline = time.monotonic() + 60
        while "/erl/nodes/leaving-node" not in asyncio.run(node_keys()):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        # Gone at once, not after the lease's TTL runs out.
        assert asyncio.run(node_keys()) == {}
    finally:
        etcd.stop()


@pytest.mark.timeout(60)
def test_invalid_spec_never_reaches_etcd(daemon, tmp_path):
    bad = erl("submit", str(SPEC), "--set", "engines.count=0", "--etcd", daemon.endpoint)
    assert bad.returncode == 2
    assert "engines.count" in bad.stderr
    # A data file with a malformed line is bad input too: every bad line is named, before the run.
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1=", "label": "1"}\n{"text": "2="}\n{"prompt": "3=", "label": "3"}\nnot json\n')
    bad_data = erl("submit", str(SPEC), "--set", f"data.path={data}", "--etcd", daemon.endpoint)
    assert bad_data.returncode == 2
    assert f"{data}:2:" in bad_data.stderr and f"{data}:4:" in bad_data.stderr
    assert orjson.loads(erl("list", "-o", "json", "--etcd", daemon.endpoint, check=True).stdout) == []


@pytest.mark.timeout(60)
def test_commands_without_a_daemon_say_how_to_start_one():
    nowhere = f"http://127.0.0.1:{free_port()}"
    for args in (("submit", str(SPEC)), ("status",), ("list",)):
        result = erl(*args, "--etcd", nowhere)
        assert result.returncode == 1
        assert "no erld is running" in result.stderr and "erl daemon" in result.stderr
