"""How a process proves itself to a secured etcd: TLS files and an etcd user, named by file paths.

An ``https://`` endpoint means TLS: the CA that signed etcd's certificate is required, and a client
certificate and key are added where etcd asks for one (``--client-cert-auth``; with etcd's auth
enabled, the certificate's common name is then the etcd user). With a user name, the client signs
in with the password read from a file. Every path travels in the environment (the ``ERL_ETCD_*``
variables below), so a job's processes inherit erld's; key material and passwords are never put on
a command line or in etcd.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from elastic_rl.errors import InputError

CACERT_ENV = "ERL_ETCD_CACERT"
CERT_ENV = "ERL_ETCD_CERT"
KEY_ENV = "ERL_ETCD_KEY"
USER_ENV = "ERL_ETCD_USER"
PASSWORD_FILE_ENV = "ERL_ETCD_PASSWORD_FILE"


class BadEtcdCredentials(InputError):
    """The etcd options do not fit the endpoint, or a file they name cannot be read."""


@dataclass(frozen=True)
class EtcdCredentials:
    cacert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password_file: Path | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> EtcdCredentials:
        def path(name: str) -> Path | None:
            return Path(environ[name]) if environ.get(name) else None

        return cls(
            cacert=path(CACERT_ENV),
            cert=path(CERT_ENV),
            key=path(KEY_ENV),
            user=environ.get(USER_ENV) or None,
            password_file=path(PASSWORD_FILE_ENV),
        )

    def overridden(self, **given: str | None) -> EtcdCredentials:
        """These credentials with each option given (not None) in place of its value."""
        paths = {"cacert", "cert", "key", "password_file"}
        chosen = {name: Path(value) if name in paths else value for name, value in given.items() if value is not None}
        return replace(self, **chosen)

    def environ(self) -> dict[str, str]:
        """The variables that carry these credentials to a child process."""
        named = {
            CACERT_ENV: self.cacert,
            CERT_ENV: self.cert,
            KEY_ENV: self.key,
            USER_ENV: self.user,
            PASSWORD_FILE_ENV: self.password_file,
        }
        return {name: str(value) for name, value in named.items() if value is not None}

    def check(self, endpoint: str) -> None:
        """Refuse what cannot work against ``endpoint`` (its members, comma-separated), naming the option."""
        members = [member.strip() for member in endpoint.split(",") if member.strip()]
        schemes = {member.split("://")[0] if "://" in member else "http" for member in members}
        if len(schemes) > 1:
            raise BadEtcdCredentials(f"etcd endpoint {endpoint} mixes http:// and https:// members: use one scheme")
        secure = schemes == {"https"}
        if secure and self.cacert is None:
            raise BadEtcdCredentials(
                f"etcd endpoint {endpoint} is https://: give the CA that signed etcd's certificate "
                f"with --etcd-cacert (or ${CACERT_ENV})"
            )
        if not secure and (self.cacert or self.cert or self.key):
            raise BadEtcdCredentials(
                f"--etcd-cacert, --etcd-cert and --etcd-key need an https:// etcd endpoint, not {endpoint}"
            )
        if (self.cert is None) != (self.key is None):
            raise BadEtcdCredentials("--etcd-cert and --etcd-key go together: give both or neither")
        if (self.user is None) != (self.password_file is None):
            raise BadEtcdCredentials("--etcd-user and --etcd-password-file go together: give both or neither")
        for option, path in (
            ("--etcd-cacert", self.cacert),
            ("--etcd-cert", self.cert),
            ("--etcd-key", self.key),
            ("--etcd-password-file", self.password_file),
        ):
            if path is not None and not path.is_file():
                raise BadEtcdCredentials(f"{option} {path}: no such file")

    def tls(self) -> grpc.ChannelCredentials | None:
        """The channel's TLS credentials, read from the files; None without a CA (plain text)."""
        if self.cacert is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.cacert.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )

    def password(self) -> str | None:
        if self.password_file is None:
            return None
        return self.password_file.read_text().rstrip("\n")
