"""One node's way to etcd, as a TCP proxy the chaos harness can cut: a network partition of that node.

The node's erld, and so every job process it starts, is given the proxy's
endpoint instead of etcd's; the node's processes still reach each other and
the other nodes' processes directly. Cutting the proxy is a partition between
the node and etcd alone, the case where a node cannot tell an etcd outage
from its own isolation while its peers go on without it.

    python -m chaos.etcd_proxy LISTEN_PORT:ETCD_PORT [LISTEN_PORT:ETCD_PORT ...]

One listening port per etcd member, on loopback. SIGUSR1 cuts: every open
connection is closed, and a new one is accepted and then held without an
answer, as a partition drops packets (a client's calls time out; nothing
refuses them). SIGUSR2 heals: the held connections are closed, and new ones
reach etcd again.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from elastic_rl.net import LOOPBACK

CHUNK = 1 << 16


class EtcdProxy:
    def __init__(self) -> None:
        self.cut = False
        self.connections: set[asyncio.StreamWriter] = set()

    def set_cut(self, cut: bool) -> None:
        self.cut = cut
        for writer in list(self.connections):
            writer.close()  # open streams break at a cut; held ones are let go at the heal
        self.connections.clear()

    async def serve(self, listen_port: int, etcd_port: int) -> asyncio.Server:
        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections.add(writer)
            if self.cut:
                return  # held: accepted and never answered
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(LOOPBACK, etcd_port)
            except OSError:
                writer.close()
                return
            self.connections.add(upstream_writer)
            await asyncio.gather(pump(reader, upstream_writer), pump(upstream_reader, writer))

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while chunk := await source.read(CHUNK):
                    sink.write(chunk)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()
                self.connections.discard(sink)

        return await asyncio.start_server(connected, LOOPBACK, listen_port)


async def main(pairs: list[tuple[int, int]]) -> None:
    proxy = EtcdProxy()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, proxy.set_cut, True)
    loop.add_signal_handler(signal.SIGUSR2, proxy.set_cut, False)
    servers = [await proxy.serve(listen, etcd) for listen, etcd in pairs]
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    asyncio.run(main([tuple(int(port) for port in pair.split(":")) for pair in sys.argv[1:]]))
