"""A trainer placed where it cannot run gives up (exit 77, erld fails the job) instead of crashing into restarts;
the code a trainer ends with is recorded for an erld that adopted it."""

from __future__ import annotations

import os

import psutil
import pytest

from elastic_rl import exit_record, jobenv
from elastic_rl.errors import SpecError, WrongDevice
from elastic_rl.spec.loading import validate_spec
from elastic_rl.trainer import main as trainer_main
from policies.exits import EXIT_GAVE_UP

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class FakeReplica:
    """Stands in for TrainerReplica: its construction fails as the test says."""

    error: Exception = RuntimeError("set by the test")

    def __init__(self, *args):
        raise self.error


@pytest.fixture
def trainer_env(monkeypatch, tmp_path):
    monkeypatch.delenv(jobenv.ETCD, raising=False)  # no erld: the reason goes to the log only
    env = jobenv.JobEnv("j", tmp_path, validate_spec({"name": "j"}))
    monkeypatch.setattr(jobenv.JobEnv, "from_environ", classmethod(lambda cls: env))
    monkeypatch.setattr(trainer_main, "TrainerReplica", FakeReplica)


@pytest.mark.parametrize(
    "error", [WrongDevice("GPU slot(s) [0], and a torch built without CUDA"), SpecError(["trainer.dtype: bf16 ..."])]
)
def test_the_wrong_kind_of_slot_gives_up(trainer_env, monkeypatch, error, caplog, tmp_path):
    monkeypatch.setattr(FakeReplica, "error", error)
    with pytest.raises(SystemExit) as exited:
        trainer_main.main()
    assert exited.value.code == EXIT_GAVE_UP
    assert str(error) in caplog.text
    assert recorded_exit(tmp_path) == EXIT_GAVE_UP


def recorded_exit(workdir):
    return exit_record.read(workdir, os.getpid(), psutil.Process().create_time())


def test_any_other_failure_is_a_crash(trainer_env, monkeypatch, tmp_path):
    monkeypatch.setattr(FakeReplica, "error", RuntimeError("NCCL error"))
    with pytest.raises(RuntimeError, match="NCCL error"):
        trainer_main.main()
    assert recorded_exit(tmp_path) is None  # unknown: erld counts it as a crash


def test_a_record_is_read_only_for_the_process_that_wrote_it(tmp_path):
    exit_record.write(tmp_path, 0)
    me = psutil.Process()
    assert exit_record.read(tmp_path, me.pid, me.create_time()) == 0
    assert exit_record.read(tmp_path, me.pid, me.create_time() - 1.0) is None  # the pid reused
    assert exit_record.read(tmp_path, me.pid + 1, me.create_time()) is None
