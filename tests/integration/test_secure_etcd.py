"""etcd over TLS with its auth on, as a shared cluster runs it: who may reach it, erld and a job on
it, and a client that signs in again after the member forgets its token."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from chaos.erl_cli import erl, job_status
from elastic_rl.store import credentials as names
from elastic_rl.store import keys
from elastic_rl.store.client import Store, StoreAccessDenied
from elastic_rl.store.credentials import BadEtcdCredentials, EtcdCredentials
from tests.processes import REPO, SPEC
from tests.secure_etcd import SecureEtcd

pytestmark = [pytest.mark.integration]


@pytest.fixture
def secure_etcd(tmp_path):
    etcd = SecureEtcd.create(tmp_path / "etcd")
    etcd.start()
    etcd.enable_auth()
    yield etcd
    etcd.stop()


async def round_trip(endpoint: str, credentials: EtcdCredentials, key: str) -> object:
    async with Store(endpoint, timeout_s=2.0, attempts=2, credentials=credentials) as store:
        await store.put(key, {"written": key})
        return await store.get(key)


def test_https_without_a_ca_is_refused_before_any_connection():
    with pytest.raises(BadEtcdCredentials, match="--etcd-cacert"):
        Store("https://127.0.0.1:1", credentials=EtcdCredentials())
    result = erl("list", "--etcd", "https://127.0.0.1:1", timeout=30)
    assert result.returncode == 2 and "--etcd-cacert" in result.stderr


@pytest.mark.timeout(60)
def test_who_may_reach_a_secured_etcd(secure_etcd):
    endpoint = secure_etcd.endpoint
    # A password, or a client certificate whose common name is an etcd user.
    assert asyncio.run(round_trip(endpoint, secure_etcd.credentials(), "/t/password")) == {"written": "/t/password"}
    by_certificate = secure_etcd.credentials(user=None)
    assert asyncio.run(round_trip(endpoint, by_certificate, "/t/certificate")) == {"written": "/t/certificate"}
    # A certificate of nobody etcd knows, and no user: refused, naming the options to give.
    with pytest.raises(StoreAccessDenied, match="--etcd-user"):
        asyncio.run(round_trip(endpoint, secure_etcd.credentials("nobody", user=None), "/t/nobody"))
    # A member that restarts forgets its tokens: the client signs in again and goes on.

    async def across_a_restart() -> object:
        async with Store(endpoint, timeout_s=2.0, credentials=secure_etcd.credentials()) as store:
            await store.put("/t/before", 1)
            await asyncio.to_thread(secure_etcd.restart)
            return await store.get("/t/before")

    assert asyncio.run(across_a_restart()) == 1


async def secret_in_etcd(endpoint: str, job: str) -> str:
    async with Store(endpoint) as store:
        return await store.get(keys.job_secret(job))


@pytest.mark.timeout(150)
def test_erld_and_a_job_on_a_secured_etcd(secure_etcd, tmp_path, monkeypatch):
    """erld takes the credentials as options and hands them to the job's processes; `erl` takes
    them from the environment; without a user the same command is refused with exit code 2."""
    credentials = secure_etcd.credentials()
    options = [
        "--etcd-cacert", str(credentials.cacert),
        "--etcd-cert", str(credentials.cert),
        "--etcd-key", str(credentials.key),
        "--etcd-user", "root",
        "--etcd-password-file", str(credentials.password_file),
    ]  # fmt: skip
    erld = subprocess.Popen(
        [sys.executable, "-m", "elastic_rl.cli", "daemon", "--etcd", secure_etcd.endpoint, *options,
         "--state-dir", str(tmp_path / "erld"), "--node", "secure-node", "--cpu-devices", "4",
         "--pool", "trainer=0", "--pool", "orchestrator=0", "--pool", "engine=0"],
        cwd=REPO,
        stdout=open(tmp_path / "erld.log", "wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        for name, value in credentials.environ().items():
            monkeypatch.setenv(name, value)

        async def node_joined() -> bool:
            async with Store(secure_etcd.endpoint) as store:
                return f"{keys.NODES}secure-node" in await store.get_prefix(keys.NODES)

        deadline = time.monotonic() + 60
        while not asyncio.run(node_joined()):
            assert time.monotonic() < deadline and erld.poll() is None, (tmp_path / "erld.log").read_text()[-3000:]
            time.sleep(0.2)
        submit = erl(
            "submit", str(SPEC), "--set", "rollout.num_rollouts=3", "--set", "engines.count=1",
            "--workdir", str(tmp_path / "job"), "--etcd", secure_etcd.endpoint, timeout=60,
        )  # fmt: skip
        assert submit.returncode == 0, submit.stdout + submit.stderr
        deadline = time.monotonic() + 120
        while (phase := job_status(secure_etcd.endpoint, "tiny-grpo")["status"]["phase"]) != "succeeded":
            assert phase in ("pending", "running") and time.monotonic() < deadline, phase
            assert erld.poll() is None, (tmp_path / "erld.log").read_text()[-3000:]
            time.sleep(0.5)
        assert (tmp_path / "job" / "metrics.jsonl").read_text().count("\n") == 3
        # The job's secret, which its engines and router asked for, is in etcd and nowhere a user reads.
        secret = asyncio.run(secret_in_etcd(secure_etcd.endpoint, "tiny-grpo"))
        shown = erl("status", "tiny-grpo", "-o", "json", "--etcd", secure_etcd.endpoint, timeout=60)
        assert shown.returncode == 0 and "tiny-grpo" in shown.stdout
        assert secret not in shown.stdout
        files = [path for path in tmp_path.rglob("*") if path.is_file() and not path.is_relative_to(secure_etcd.root)]
        assert not [path for path in files if secret.encode() in path.read_bytes()]  # job, erld logs, erld state

        monkeypatch.delenv(names.USER_ENV)
        monkeypatch.delenv(names.PASSWORD_FILE_ENV)
        monkeypatch.setenv(names.CERT_ENV, str(secure_etcd.root / "nobody.crt"))
        monkeypatch.setenv(names.KEY_ENV, str(secure_etcd.root / "nobody.key"))
        refused = erl("status", "tiny-grpo", "--etcd", secure_etcd.endpoint, timeout=60)
        assert refused.returncode == 2 and "--etcd-user" in refused.stderr, refused.stderr
    finally:
        erld.terminate()
        erld.wait(timeout=60)
