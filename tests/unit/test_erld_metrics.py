"""erld's /metrics as Prometheus reads it: counters where figures only grow, a running job's headline
figures, and a Grafana dashboard (deploy/grafana) that asks only for metrics erld exports."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from checkpoints import layout
from daemon.cluster import Cluster
from daemon.metrics import ClusterCollector
from daemon.proctable import LocalProc, ProcessTable, ProcState
from tests.processes import REPO

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

DASHBOARD = REPO / "deploy" / "grafana" / "elastic-rl.json"


class FakePool:
    """Stands in for the interpreter pool: counts only."""

    def counts(self) -> dict[str, tuple[int, int]]:
        return {"trainer": (1, 1)}


class FakeErld:
    """Stands in for the erld the collector reads: one node, leading, with a job's processes."""

    def __init__(self) -> None:
        self.node = "node-a"
        self.devices = 2
        self.leading = True
        self.pool = FakePool()
        self.table = ProcessTable(self.node, "http://127.0.0.1:2379")
        self.table.add(LocalProc("job-1", "trainer-0-0", 1, state=ProcState.RUNNING, restarts=[1.0, 2.0]))
        self.table.add(LocalProc("job-1", "engine-0", 1, state=ProcState.RUNNING, serving=True))

    def lease_may_have_expired(self) -> bool:
        return False


def scraped(workdir: Path | None = None) -> dict[str, object]:
    """Every exported sample by name, from a cluster with a running job (its work dir ``workdir``), a
    draining node and a failed slot."""
    collector = ClusterCollector(FakeErld())
    status = {"phase": "running", "size": {"replicas": [1, 1, 2], "engines": [1, 1, 1]}}
    collector.cluster = Cluster(
        statuses={"job-1": {**status, "workdir": str(workdir)} if workdir else status},
        assignments={},
        nodes={},
        reported={},
        failed={"node-a": {1}},
        progress={
            "job-1": {
                "rollouts_done": 7,
                "metrics": {
                    "rollout/reward_mean": 0.5,
                    "perf/generated_tokens_per_sec": 180.0,
                    "perf/iteration_time": 35.0,
                    "rollout/time": 10.0,
                    "train/step_time": 5.9,
                    "train/participants": 1,
                    "train/straggler_ratio": 1.1,
                    "memory/node-a/0/generation_peak_bytes": 3e9,
                    "memory/node-a/0/training_peak_bytes": 2e9,
                    "memory/slot_peak_bytes_max": 3e9,
                    "memory/colocation_saved_bytes": 1e9,
                },
            }
        },
        draining={"node-a": {"deadline": 0.0}},
    )
    registry = CollectorRegistry()
    registry.register(collector)
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    return {
        "types": {family.name: family.type for family in families},
        "samples": {sample.name: sample for family in families for sample in family.samples},
        "every": [sample for family in families for sample in family.samples],
    }


def test_growing_figures_are_counters_and_the_headline_figures_are_there():
    exported = scraped()
    assert exported["types"]["erld_process_restarts"] == "counter"
    assert exported["types"]["erld_job_rollouts_committed"] == "counter"
    samples = exported["samples"]
    assert samples["erld_process_restarts_total"].value == 2
    assert samples["erld_job_rollouts_committed_total"].value == 7
    assert samples["erld_job_reward_mean"].value == 0.5
    assert samples["erld_job_generated_tokens_per_second"].value == 180.0
    assert samples["erld_job_iteration_time_seconds"].value == 35.0


def test_a_colocated_jobs_memory_is_exported_per_slot_and_phase():
    exported = scraped()
    peaks = {
        (sample.labels["slot"], sample.labels["phase"]): sample.value
        for sample in exported["every"]
        if sample.name == "erld_job_slot_peak_memory_bytes"
    }
    assert peaks == {("node-a/0", "generation"): 3e9, ("node-a/0", "training"): 2e9}
    assert exported["samples"]["erld_job_colocation_saved_bytes"].value == 1e9


def test_the_time_a_fault_cost_is_exported_from_the_jobs_record(tmp_path):
    """Rollouts every 10 s; a process exit makes one interval 25 s: 15 s lost."""
    now = time.time()
    trained = [now - 60, now - 50, now - 40, now - 15, now - 5]
    layout.metrics_lines_path(tmp_path).write_bytes(
        b"".join(orjson.dumps({"rollout": i, "time": t}) + b"\n" for i, t in enumerate(trained))
    )
    events = [{"time": now - 30, "kind": "proc_exited"}, {"time": now - 8, "kind": "job_scaled"}]
    layout.events_path(tmp_path).write_bytes(b"".join(orjson.dumps(event) + b"\n" for event in events))
    lost = scraped(tmp_path)["samples"]["erld_job_time_lost_to_faults_seconds"].value
    assert lost == pytest.approx(15.0, abs=0.01)


def test_stragglers_are_counted_by_what_became_of_them(tmp_path):
    events = [
        {"time": 1.0, "kind": "replica_straggling", "replaced": False},
        {"time": 2.0, "kind": "replica_straggling", "replaced": True},
        {"time": 3.0, "kind": "proc_exited"},
    ]
    layout.events_path(tmp_path).write_bytes(b"".join(orjson.dumps(event) + b"\n" for event in events))
    exported = scraped(tmp_path)
    found = {s.labels["outcome"]: s.value for s in exported["every"] if s.name == "erld_job_stragglers_total"}
    assert found == {"replaced": 1.0, "kept": 1.0}
    assert exported["samples"]["erld_job_straggler_ratio"].value == 1.1


def test_the_dashboard_asks_only_for_metrics_erld_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions += [variable.get("query", "") for variable in dashboard["templating"]["list"]]
    asked = {name for expression in expressions for name in re.findall(r"\berld_[a-z_]+", expression)}
    exported = scraped()
    exported = set(exported["types"]) | set(exported["samples"])  # a family with no sample here is declared
    assert asked and asked <= exported, sorted(asked - exported)
    # Every panel shows something a job's operator looks for: progress, restarts and faults among them.
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("rollouts committed", "reward", "restarts", "failed device"):
        assert topic in titles, topic
