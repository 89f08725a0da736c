"""The `cpu` engine: SGLang's HTTP contract served by a transformers model on the CPU.

Where SGLang cannot be installed (its wheels are CUDA-only), this server stands
in for it, so the router, the orchestrator and erld's health checks all run
against the same endpoints and JSON shapes they use with SGLang:

    python -m elastic_rl.engines.cpu_server --model-path runs/tiny-grpo-demo/weights/0 --port 30001

The scheduler (``engines.cpu_engine``) batches concurrent requests with a KV
cache and continuous batching. With ``--enable-deterministic-inference``
(SGLang's flag for the same promise) each sequence runs its own forward
passes over its own cache, so a seeded request yields the same tokens and log
probabilities whatever else is being served.

Under erld it asks the job's secret on every path but ``/health*`` and
``/metrics`` (``elastic_rl.job_secret``), as SGLang does with ``--api-key``;
it takes the secret from its environment, never from its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import orjson
import torch
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_log import AccessLogger

from elastic_rl import job_secret
from elastic_rl.engines import load_metrics
from elastic_rl.engines.cpu_engine import CpuEngine
from elastic_rl.engines.sampling import InvalidRequest

log = logging.getLogger("elastic_rl.engines.cpu_server")

HEALTH_GENERATE_TIMEOUT_S = 20.0
MODEL_POLL_S = 0.1
# Polled every second by erld and the router: not worth a log line each.
QUIET_PATHS = ("/health", "/health_generate", "/metrics")


class AccessLogWithoutHealthChecks(AccessLogger):
    """aiohttp's access log, less the health checks."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path not in QUIET_PATHS:
            super().log(request, response, time)


class RouterProbeFilter(logging.Filter):
    """The router, adding a worker, first tries HTTP/2 (to find gRPC workers); aiohttp speaks
    HTTP/1.1 and refuses it with a traceback that reads like a failure. One line says what it was."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage) and "PRI/Upgrade" in str(error):
            log.info("refused an HTTP/2 connection (the router probing for gRPC); this server speaks HTTP/1.1")
            return False
        return True


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


async def _stream(request: web.Request, chunks) -> web.StreamResponse:
    """Server-sent events as SGLang sends them: ``data: <chunk>`` per chunk, an error as a chunk of its
    own, then ``data: [DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    # Closing the chunks (also when the client went away and a write fails) aborts an unfinished request.
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        except ConnectionError:
            raise
        except Exception as exc:  # a failed decode step fails its requests, not the server
            await response.write(b"data: " + orjson.dumps({"error": {"message": str(exc)}}) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def build_app(
    engine: CpuEngine, server_args: dict[str, Any], incremental_streaming: bool = False, secret: str | None = None
) -> web.Application:
    """``secret``: what every request but a health check or a metrics scrape must carry; None: none."""
    routes = web.RouteTableDef()

    @routes.post("/generate")
    async def generate(request: web.Request) -> web.Response:
        body = await _body(request)
        input_ids, rid = body.get("input_ids"), body.get("rid")
        if input_ids is None and isinstance(body.get("text"), str):
            input_ids = engine.tokenizer(body["text"])["input_ids"]
        if not isinstance(input_ids, list):
            raise InvalidRequest("input_ids: give a list of token ids (or a list of such lists)")
        if input_ids and isinstance(input_ids[0], list):
            if body.get("stream"):
                raise InvalidRequest("stream: give one prompt per streamed request, not a list of them")
            rids = rid if isinstance(rid, list) else [None] * len(input_ids)
            starts = body.get("logprob_start_len")
            bodies = [{**body, "logprob_start_len": start} for start in starts] if isinstance(starts, list) else None
            if bodies is not None and len(bodies) != len(input_ids):
                raise InvalidRequest(f"logprob_start_len: give one per prompt ({len(input_ids)}), or one for all")
            requests = [
                engine.make_request(body if bodies is None else bodies[i], ids, r)
                for i, (ids, r) in enumerate(zip(input_ids, rids))
            ]
            await engine.score_inputs(requests)
            return _json(list(await asyncio.gather(*(engine.generate(r) for r in requests))))
        generation = engine.make_request(body, input_ids, rid)
        if body.get("stream"):
            return await _stream(request, engine.stream(generation, incremental_streaming))
        return _json(await engine.generate(generation))

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    @routes.get("/health_generate")
    async def health_generate(request: web.Request) -> web.Response:
        if engine.paused or engine.admission_closed:
            return web.Response(status=200)
        probe = engine.make_request({"sampling_params": {"max_new_tokens": 1, "temperature": 0}}, [0], None)
        try:
            await asyncio.wait_for(engine.generate(probe), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error("generation did not finish in time", status=503)
        return web.Response(status=200)

    @routes.post("/update_weights_from_disk")
    async def update_weights(request: web.Request) -> web.Response:
        body = await _body(request)
        if not isinstance(body.get("model_path"), str):
            raise InvalidRequest("model_path: give the folder of the new weights")
        version = body.get("weight_version")
        # Shielded: a load runs to its end even if its caller goes away (handler_cancellation below).
        held = await asyncio.shield(
            engine.update_weights(
                Path(body["model_path"]),
                None if version is None else str(version),
                bool(body.get("abort_all_requests", False)),
            )
        )
        return _json({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": held})

    @routes.post("/abort_request")
    async def abort_request(request: web.Request) -> web.Response:
        body = await _body(request)
        engine.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all", False)))
        return web.Response(status=200)

    @routes.post("/pause_generation")
    async def pause_generation(request: web.Request) -> web.Response:
        engine.pause((await _body(request)).get("mode", "abort"))
        return _json({"message": "Generation paused successfully."})

    @routes.post("/continue_generation")
    async def continue_generation(request: web.Request) -> web.Response:
        engine.resume()
        return _json({"message": "Generation continued successfully."})

    async def release_memory(request: web.Request) -> web.Response:
        engine.release_memory((await _body(request)).get("tags"))
        return web.Response(status=200)

    async def resume_memory(request: web.Request) -> web.Response:
        # Shielded as a weight load is: it runs to its end even if its caller goes away.
        await asyncio.shield(engine.resume_memory((await _body(request)).get("tags")))
        return web.Response(status=200)

    async def flush_cache(request: web.Request) -> web.Response:
        if engine.running or engine.waiting:
            return _error("Cache not flushed: requests are running.", status=400)
        return web.Response(text="Cache flushed.")

    async def model_info(request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": str(engine.model_path),
                "tokenizer_path": str(engine.model_path),
                "is_generation": True,
                "weight_version": engine.weight_version,
            }
        )

    async def server_info(request: web.Request) -> web.Response:
        return _json(
            {
                **server_args,
                "weight_version": engine.weight_version,
                "running_requests": len(engine.running),
                "waiting_requests": len(engine.waiting),
                "paused": engine.paused,
                "memory_released": sorted(engine.released),
                # Colocated mode's telemetry: the peak resident memory of the last phase of each kind.
                "memory_peak_bytes": {phase.value: peak for phase, peak in engine.memory_peaks.last.items()},
                "generated_tokens": engine.generated_tokens,
                "finished_requests": engine.finished_requests,
            }
        )

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        # Requests held while the memory is released wait for the trainers' turn to end, not for this
        # engine: counted as queued, they would make an engine idle by design look hung to erld.
        queued = 0 if engine.released else len(engine.waiting)
        page = load_metrics.render(engine.generated_tokens, engine.finished_requests, len(engine.running), queued)
        return web.Response(text=page, content_type="text/plain")

    @routes.get("/get_weight_version")
    async def weight_version(request: web.Request) -> web.Response:
        return _json({"weight_version": engine.weight_version})

    @web.middleware
    async def invalid_requests(request: web.Request, handler):
        try:
            return await handler(request)
        except InvalidRequest as exc:
            return _error(str(exc))

    @web.middleware
    async def authorized(request: web.Request, handler):
        if secret is None or job_secret.is_open(request.path):
            return await handler(request)
        if not job_secret.carried(request.headers.get(job_secret.AUTHORIZATION), secret):
            return _error("this engine asks for the job's secret: Authorization: Bearer <secret>", status=401)
        return await handler(request)

    app = web.Application(middlewares=[authorized, invalid_requests], client_max_size=64 * 1024**2)
    app.add_routes(routes)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/flush_cache", flush_cache)
        app.router.add_route(method, "/release_memory_occupation", release_memory)
        app.router.add_route(method, "/resume_memory_occupation", resume_memory)
        # SGLang's older and newer names; the router asks for the newer ones first.
        for path in ("/get_model_info", "/model_info"):
            app.router.add_route(method, path, model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server_info)

    async def start_scheduler(app: web.Application):
        task = asyncio.create_task(engine.run())
        yield
        task.cancel()

    app.cleanup_ctx.append(start_scheduler)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_rl.engines.cpu_server",
        description="Serve an HF causal LM on the CPU behind SGLang's HTTP API.",
        epilog="example: python -m elastic_rl.engines.cpu_server --model-path runs/demo/weights/0 --port 30001",
    )
    parser.add_argument("--model-path", type=Path, required=True, help="folder of an HF checkpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences stepped together")
    parser.add_argument("--weight-version", default="0", help="version reported before any update")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--wait-for-model",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for --model-path to appear (it may still be being written)",
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="a streamed chunk holds the new tokens only, not everything so far (SGLang's flag)",
    )
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="results independent of batching: one forward pass per sequence",
    )
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    deadline = time.monotonic() + args.wait_for_model
    while not args.model_path.is_dir() and time.monotonic() < deadline:
        time.sleep(MODEL_POLL_S)  # the folder appears whole (written aside, then renamed)
    if not (args.model_path / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: no config.json there; give an HF checkpoint folder")
    engine = CpuEngine(args.model_path, args.max_batch_size, args.weight_version, args.enable_deterministic_inference)
    server_args = {
        "engine": "elastic-rl-cpu",
        "model_path": str(args.model_path),
        "host": args.host,
        "port": args.port,
        "tp_size": 1,
        "max_batch_size": args.max_batch_size,
        "context_length": engine.context_length,
        "enable_deterministic_inference": engine.deterministic,
        "incremental_streaming_output": args.incremental_streaming_output,
    }
    log.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    logging.getLogger("aiohttp.server").addFilter(RouterProbeFilter())
    web.run_app(
        build_app(engine, server_args, args.incremental_streaming_output, job_secret.from_environment()),
        host=args.host,
        port=args.port,
        print=None,
        access_log_class=AccessLogWithoutHealthChecks,
        # As SGLang: a request whose client went away (a router that died holding it) is aborted, not
        # generated to the end for nobody while the same request comes again from elsewhere.
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
