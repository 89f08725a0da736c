"""The etcd options a client is given, checked against its endpoint before any connection: each
refusal names the option to change."""

from __future__ import annotations

import pytest

from elastic_rl.store.credentials import BadEtcdCredentials, EtcdCredentials

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture
def files(tmp_path):
    for name in ("ca.pem", "client.pem", "client.key", "password"):
        (tmp_path / name).write_text("x")
    return tmp_path


@pytest.mark.parametrize(
    ("endpoint", "given", "named"),
    [
        ("https://10.0.0.1:2379", {}, "--etcd-cacert"),
        ("https://10.0.0.1:2379,http://10.0.0.2:2379", {"cacert": "ca.pem"}, "one scheme"),
        ("http://10.0.0.1:2379", {"cacert": "ca.pem"}, "need an https:// etcd endpoint"),
        ("https://10.0.0.1:2379", {"cacert": "ca.pem", "cert": "client.pem"}, "--etcd-key"),
        ("https://10.0.0.1:2379", {"cacert": "ca.pem", "user": "alice"}, "--etcd-password-file"),
        ("https://10.0.0.1:2379", {"cacert": "missing.pem"}, "--etcd-cacert"),
    ],
)
def test_options_that_cannot_work_are_refused_naming_the_option(files, endpoint, given, named):
    credentials = EtcdCredentials().overridden(
        **{name: value if name == "user" else str(files / value) for name, value in given.items()}
    )
    with pytest.raises(BadEtcdCredentials, match=named):
        credentials.check(endpoint)


def test_options_travel_to_a_child_in_the_environment_and_back(files):
    credentials = EtcdCredentials().overridden(
        cacert=str(files / "ca.pem"), user="alice", password_file=str(files / "password")
    )
    credentials.check("https://10.0.0.1:2379,https://10.0.0.2:2379")
    assert EtcdCredentials.from_environ(credentials.environ()) == credentials
    EtcdCredentials().check("127.0.0.1:2379")  # no scheme: plain, as the embedded etcd's
