"""deploy/kubernetes: every manifest valid against Kubernetes' own schemas (offline, with
kubernetes-validate), and erld's and erl's command lines in them accepted by erl's parser."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from elastic_rl.cli.main import build_parser
from tests.processes import REPO

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.31.0"


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def containers(kind: str) -> list[dict]:
    return [
        container
        for doc in documents()
        if doc["kind"] == kind
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_each_manifest_is_valid_kubernetes(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_commands_are_ones_erl_accepts():
    parser = build_parser()
    for kind in ("DaemonSet", "Job"):
        (container,) = containers(kind)
        assert container["command"][0] == "erl"
        parser.parse_args(container["command"][1:])  # exits (SystemExit) on an unknown option


def test_erld_is_probed_scraped_and_given_time_to_drain():
    (daemonset,) = [doc for doc in documents() if doc["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]
    (erld,) = pod["spec"]["containers"]
    assert erld["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    args = build_parser().parse_args(erld["command"][1:])
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.drain_on_term
    assert args.etcd.startswith("https://") and args.etcd_cacert
