"""A real etcd member secured as a production cluster would be: TLS on its client port with client
certificates required, and etcd's auth enabled with a root user. The certificates are made per test
with trustme; the files a client needs are written beside the member's data dir."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import trustme
from aetcd import rpc

from elastic_rl.net import LOOPBACK, free_port
from elastic_rl.store.client import etcd_answers
from elastic_rl.store.credentials import EtcdCredentials
from elastic_rl.store.embedded import etcd_command

ROOT_PASSWORD = "correct horse battery staple"


@dataclass
class SecureEtcd:
    root: Path
    client_port: int
    peer_port: int
    process: subprocess.Popen | None = None

    @classmethod
    def create(cls, root: Path) -> SecureEtcd:
        etcd = cls(root, free_port(), free_port())
        root.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(etcd.cacert))
        server = ca.issue_cert(LOOPBACK)
        server.private_key_pem.write_to_path(str(root / "server.key"))
        server.cert_chain_pems[0].write_to_path(str(root / "server.crt"))
        for name in ("root", "nobody"):  # etcd takes a certificate's common name for its user
            client = ca.issue_cert(f"{name}.client", common_name=name)
            client.private_key_pem.write_to_path(str(root / f"{name}.key"))
            client.cert_chain_pems[0].write_to_path(str(root / f"{name}.crt"))
        etcd.password_file.write_text(ROOT_PASSWORD + "\n")
        return etcd

    @property
    def endpoint(self) -> str:
        return f"https://{LOOPBACK}:{self.client_port}"

    @property
    def cacert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def password_file(self) -> Path:
        return self.root / "root.password"

    def credentials(self, certificate: str = "root", user: str | None = "root") -> EtcdCredentials:
        """A client's credentials: the CA, the client certificate named ``certificate`` and, with
        ``user``, root's password."""
        return EtcdCredentials(
            cacert=self.cacert,
            cert=self.root / f"{certificate}.crt",
            key=self.root / f"{certificate}.key",
            user=user,
            password_file=self.password_file if user else None,
        )

    def start(self, timeout_s: float = 30.0) -> None:
        plain = f"http://{LOOPBACK}:{self.client_port}"
        command = [
            self.endpoint if part == plain else part
            for part in etcd_command(self.root / "data", self.client_port, self.peer_port)
        ]
        command += [
            "--cert-file", str(self.root / "server.crt"),
            "--key-file", str(self.root / "server.key"),
            "--trusted-ca-file", str(self.cacert),
            "--client-cert-auth",
        ]  # fmt: skip
        log = open(self.root / "etcd.log", "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        # By the certificate alone: before `enable_auth` etcd has no users to sign in as.
        while not asyncio.run(etcd_answers(self.endpoint, self.credentials(user=None))):
            assert time.monotonic() < deadline and self.process.poll() is None, "the secured etcd did not come up"
            time.sleep(0.2)

    def enable_auth(self) -> None:
        """A root user with root's password and role, then etcd's auth on (etcdctl's `user add root`,
        `user grant-role root root`, `auth enable`)."""

        async def enable() -> None:
            tls = self.credentials().tls()
            async with grpc.aio.secure_channel(f"{LOOPBACK}:{self.client_port}", tls) as channel:
                auth = rpc.AuthStub(channel)
                await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
                await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=ROOT_PASSWORD))
                await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
                await auth.AuthEnable(rpc.AuthEnableRequest())

        asyncio.run(enable())

    def restart(self) -> None:
        """Stop the member and start it again on its data: it forgets every token it gave out."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
