"""`erl validate` and the CLI's promises: examples in every help, exit 2 on bad input, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from elastic_rl.cli.main import build_parser, main
from tests.processes import REPO, SPEC

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_validate_prints_the_resolved_spec(capsys):
    assert main(["validate", str(SPEC), "--set", "engines.count=3"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["engines"]["count"] == 3
    assert resolved["trainer"]["clip_grad"] == 1.0


def test_invalid_spec_exits_2_with_every_problem(capsys):
    code = main(["validate", str(SPEC), "--set", "engines.count=0", "--set", "rollout.top_p=2"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert "2 problems" in captured.err
    assert "engines.count" in captured.err and "rollout.top_p" in captured.err


def test_every_help_has_an_example():
    parser = build_parser()
    assert "example" in parser.format_help()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():
        assert "example" in sub.format_help(), name


def test_cli_imports_no_torch():
    code = "import sys, elastic_rl.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert out.stdout.strip() == "False"


def test_erl_entry_point_exit_code(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: j\nengines: {count: -1}\n")
    out = subprocess.run(
        [sys.executable, "-m", "elastic_rl.cli", "validate", str(bad)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
    assert "engines.count" in out.stderr


def test_daemon_takes_cpu_slots_or_gpus_not_both(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["daemon", "--gpus", "all", "--cpu-devices", "3"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_daemon_gpus_without_nvidias_driver_is_refused_before_anything_starts(capsys):
    # No GPU and no NVML here: `--gpus` says so and what to use instead (exit 2), and starts no etcd.
    assert main(["daemon", "--gpus", "all", "--etcd-port", "1"]) == 2
    assert "--cpu-devices" in capsys.readouterr().err


def test_resume_changes_only_the_replica_layout(capsys):
    # Refused before any etcd is asked: the job's other fields stay as submitted.
    assert main(["resume", "tiny-grpo", "--set", "trainer.lr=0.1", "--etcd", "http://127.0.0.1:9"]) == 2
    assert "trainer.data_parallel" in capsys.readouterr().err
