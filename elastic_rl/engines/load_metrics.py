"""An engine's load as its ``/metrics`` shows it, in SGLang's Prometheus names.

SGLang (started with ``--enable-metrics``) counts the tokens it generated and
the requests it finished, and gauges the requests running and queued; the
cpu engine serves the same four series under the same names, so erld's
health check (``policies.engine_health``) reads both kinds alike. A counter
may be split into several labelled series (SGLang labels requests by
streaming or not): they are summed.
"""

from __future__ import annotations

from policies.engine_health import EngineLoad

GENERATED_TOKENS = "sglang:generation_tokens_total"
FINISHED_REQUESTS = "sglang:num_requests_total"
RUNNING_REQUESTS = "sglang:num_running_reqs"
QUEUED_REQUESTS = "sglang:num_queue_reqs"


def render(generated_tokens: int, finished_requests: int, running: int, queued: int) -> str:
    """The four series as Prometheus text, as the cpu engine serves them."""
    series = (
        (GENERATED_TOKENS, "counter", "Number of generation tokens processed.", generated_tokens),
        (FINISHED_REQUESTS, "counter", "Number of requests processed.", finished_requests),
        (RUNNING_REQUESTS, "gauge", "The number of running requests.", running),
        (QUEUED_REQUESTS, "gauge", "The number of requests in the waiting queue.", queued),
    )
    return "".join(
        f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name} {value}\n" for name, kind, text, value in series
    )


def parse(text: str) -> EngineLoad:
    """The load in a ``/metrics`` page; a series the page lacks counts as 0."""
    totals = dict.fromkeys((GENERATED_TOKENS, FINISHED_REQUESTS, RUNNING_REQUESTS, QUEUED_REQUESTS), 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        if name in totals:
            totals[name] += float(value)
    return EngineLoad(
        progress=int(totals[GENERATED_TOKENS] + totals[FINISHED_REQUESTS]),
        holding_work=totals[RUNNING_REQUESTS] + totals[QUEUED_REQUESTS] > 0,
        generated_tokens=int(totals[GENERATED_TOKENS]),
        running_requests=totals[RUNNING_REQUESTS],
    )
