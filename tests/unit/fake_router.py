"""What the rollout side's fake routers share (test doubles, named as such): the streamed call, made of
their whole answer."""

from __future__ import annotations

from typing import Any

from elastic_rl.engines.streaming import Received


class StreamsWholeAnswers:
    """For a fake router whose ``generate(ids, params)`` answers whole: ``generate_stream`` streams that
    answer as one chunk, as an engine streams a request that ends at its first step."""

    async def generate_stream(
        self, ids: list[int], params: dict[str, Any], received: Received, silence_s: float | None = None
    ) -> dict[str, Any]:
        received.add(await self.generate(ids, params))
        return received.answer()
