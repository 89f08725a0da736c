"""Benchmark: what TLS and etcd's auth cost, against a plain etcd, in one run.

    .venv/bin/python bench/secure_etcd_bench.py [--rounds 5]

Two real etcd members on loopback, one plain and one secured as a shared cluster runs it (TLS,
client certificates required, auth on, a password user: tests/secure_etcd.py). For each, in
alternating rounds: `erl list` as a user runs it (a fresh CLI process: its connection and sign-in
included), a Store call (a put and a get on an open client), and a read of the whole /erl/
keyspace, populated with 2,000 keys as a large cluster's (what each erld's pass read before it kept
a watched copy; now its start, and a broken watch's resync).
Prints the medians and secured / plain ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic_rl.net import free_port  # noqa: E402
from elastic_rl.store import keys  # noqa: E402
from elastic_rl.store.client import Store  # noqa: E402
from elastic_rl.store.credentials import EtcdCredentials  # noqa: E402
from elastic_rl.store.embedded import EmbeddedEtcd  # noqa: E402
from tests.secure_etcd import SecureEtcd  # noqa: E402

KEYS = 2000
CALLS = 200


async def populate(endpoint: str, credentials: EtcdCredentials) -> None:
    async with Store(endpoint, credentials=credentials) as store:
        # A node record, as an erld keeps: `erl list` answers only where a daemon is up.
        await store.put(f"{keys.NODES}bench-node", {"devices": 8})
        for index in range(KEYS):
            await store.put(f"/erl/bench/{index:05d}", {"node": f"node-{index % 300}", "slot": index % 8})


async def store_times(endpoint: str, credentials: EtcdCredentials) -> tuple[float, float]:
    """(seconds per put + get, seconds per whole-keyspace read) on one open client."""
    async with Store(endpoint, credentials=credentials) as store:
        await store.get("/erl/warm-up")
        started = time.perf_counter()
        for index in range(CALLS):
            await store.put("/erl/bench-call", index)
            await store.get("/erl/bench-call")
        call = (time.perf_counter() - started) / CALLS
        started = time.perf_counter()
        for _ in range(10):
            await store.get_prefix("/erl/")
        return call, (time.perf_counter() - started) / 10


def cli_time(endpoint: str, credentials: EtcdCredentials) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "elastic_rl.cli", "list", "--etcd", endpoint],
        check=True,
        capture_output=True,
        cwd=REPO,
        env={**os.environ, **credentials.environ()},
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        plain = EmbeddedEtcd(root / "plain", client_port=free_port())
        asyncio.run(plain.start())
        secured = SecureEtcd.create(root / "secured")
        secured.start()
        secured.enable_auth()
        setups = {
            "plain": (plain.endpoint, EtcdCredentials()),
            "secured": (secured.endpoint, secured.credentials()),
        }
        try:
            for endpoint, credentials in setups.values():
                asyncio.run(populate(endpoint, credentials))
            figures: dict[str, dict[str, list[float]]] = {name: {"cli": [], "call": [], "read": []} for name in setups}
            for _ in range(args.rounds):
                for name, (endpoint, credentials) in setups.items():
                    figures[name]["cli"].append(cli_time(endpoint, credentials))
                    call, read = asyncio.run(store_times(endpoint, credentials))
                    figures[name]["call"].append(call)
                    figures[name]["read"].append(read)
        finally:
            plain.stop()
            secured.stop()
    print(f"medians of {args.rounds} alternating rounds ({KEYS} keys under /erl/):")
    print("| | plain | TLS + auth | ratio |")
    print("|---|---|---|---|")
    for key, label, scale, unit in (
        ("cli", "`erl list` (a fresh CLI process)", 1.0, "s"),
        ("call", "a put and a get on an open client", 1000.0, "ms"),
        ("read", "erld's read of the whole keyspace each pass", 1000.0, "ms"),
    ):
        ours, theirs = median(figures["secured"][key]), median(figures["plain"][key])
        print(f"| {label} | {theirs * scale:.3f} {unit} | {ours * scale:.3f} {unit} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
