"""An OpenAI-compatible HTTP server over the engine's scheduler (Starlette + uvicorn).

One thread runs `engine.step()` while requests are in flight and hands each request's outputs
to its asyncio queue on the event loop; the handlers only parse, submit and format. Routes:
POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tabed_engine.serving.metrics import ServerMetrics
from tabed_engine.serving.protocol import (ApiError, ParsedRequest, check_model, chunk, completion_body, parse_chat,
                              parse_completion, parse_json, submit_to_engine)

log = logging.getLogger("tabed_engine.serving.server")
SWITCH_INTERVAL = 2e-4   # seconds: the GIL hand-over interval while the server runs


@dataclass
class _Tracked:
    """A request in flight: where its outputs go and when they came."""

    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None
    finished: bool = False


class EngineLoop:
    """Steps the engine in its own thread and routes every RequestOutput to its request's queue.

    `submit` and the queues live on the event loop's thread; the engine thread only calls
    `engine.step()` and schedules deliveries with `loop.call_soon_threadsafe`."""

    def __init__(self, engine, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics
        self.failure: Optional[str] = None      # set when step() itself raised: the server is unhealthy
        self._tracked: dict[str, _Tracked] = {}
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def start(self):
        self._loop = asyncio.get_running_loop()
        # a thread waiting for the GIL gets it after this interval at the latest: the engine thread
        # back from a device wait must not stall behind the event loop's work (CPython's default 5 ms)
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        self._thread = threading.Thread(target=self._run, name="tabed-engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0):
        """Abort what is still in flight and join the engine thread."""
        for rid in list(self._tracked):
            self.abort(rid)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            sys.setswitchinterval(self._switch)

    async def submit(self, rid: str, req: ParsedRequest) -> asyncio.Queue:
        """Hand a parsed request to the engine; its outputs arrive on the returned queue.
        Raises ApiError for input the engine refuses."""
        if self.failure is not None:
            raise ApiError(f"the engine failed: {self.failure}", status=503, kind="server_error")
        track = self._tracked[rid] = _Tracked(asyncio.Queue())   # before the engine can answer
        try:
            await asyncio.to_thread(submit_to_engine, self.engine, rid, req)
        except BaseException:
            del self._tracked[rid]
            raise
        self.metrics.running = len(self._tracked)
        self._wake.set()
        return track.queue

    def abort(self, rid: str):
        """Stop a request (its client went away); its rows free up at the next step."""
        track = self._tracked.get(rid)
        if track is not None and not track.finished:
            self.engine.abort(rid)
            self._wake.set()

    def health(self) -> tuple[dict, int]:
        """GET /health's body and status: ok (200) while the engine loop runs, error (503) after
        it failed."""
        if self.failure is not None:
            return {"status": "error", "error": self.failure}, 503
        return {"status": "ok"}, 200

    def _run(self):
        while not self._stop.is_set():
            self._wake.clear()      # cleared before the check: a submit after it wakes the wait
            if not self.engine.has_unfinished():
                self._wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # the engine itself is broken: fail what is in flight, stop
                log.exception("engine.step() failed")
                self._loop.call_soon_threadsafe(self._fail, f"{type(e).__name__}: {e}")
                return
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs, time.perf_counter())

    def _deliver(self, outputs, now: float):
        self.metrics.step_outputs.observe(len(outputs))
        for out in outputs:
            track = self._tracked.get(out.request_id)
            if track is None:
                continue
            if out.new_token_ids and track.first is None:
                track.first = now
            track.queue.put_nowait(out)
            if out.finished:
                track.finished = True
                del self._tracked[out.request_id]
                self.metrics.finished(out.output, track.arrival, track.first, now)
        self.metrics.running = len(self._tracked)

    def _fail(self, message: str):
        self.failure = message
        for track in self._tracked.values():
            track.queue.put_nowait(ApiError(f"the engine failed: {message}", status=500, kind="server_error"))
        self._tracked.clear()
        self.metrics.running = 0


def _error(e: ApiError, metrics: ServerMetrics) -> JSONResponse:
    metrics.rejected.inc(value=str(e.status))
    return JSONResponse(e.body(), status_code=e.status)


async def _next(queue: asyncio.Queue):
    item = await queue.get()
    if isinstance(item, ApiError):
        raise item
    return item


def _finish_error(out) -> ApiError:
    return ApiError(f"generation failed: {out.output.error}", status=500, kind="server_error")


class OpenAIServer:
    """The ASGI app: routes, request handling and the engine loop's lifetime.

    `engine` is served through an `EngineLoop` (a thread of this process); or, with `backend`
    (and engine None), requests go to that backend instead: any object with EngineLoop's
    `metrics`, `start`, `stop`, `submit`, `abort` and `health` (the data-parallel front,
    `serving.data_parallel.ReplicaPool`)."""

    def __init__(self, engine, model_name: str, default_max_tokens: Optional[int] = None,
                 image_root: Optional[str] = None, backend=None):
        if (engine is None) == (backend is None):
            raise ValueError("OpenAIServer takes an engine or a backend, not both or neither")
        self.model, self.default_max_tokens, self.image_root = model_name, default_max_tokens, image_root
        if backend is None:
            self.metrics = ServerMetrics()
            self.loop = EngineLoop(engine, self.metrics)
        else:
            self.metrics, self.loop = backend.metrics, backend
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model_card, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop.start()
        try:
            yield
        finally:
            self.loop.stop()

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        try:
            body = parse_json(await request.body())
            check_model(body, self.model)
            parse = parse_chat if chat else parse_completion
            args = (body, self.default_max_tokens) + ((self.image_root,) if chat else ())
            req = await asyncio.to_thread(parse, *args)     # image decoding off the event loop
            queue = await self.loop.submit(rid, req)
        except ApiError as e:
            return _error(e, self.metrics)
        if req.stream:
            return StreamingResponse(self._events(rid, queue, chat, req.include_usage),
                                     media_type="text/event-stream")
        return await self._whole(rid, queue, chat, request)

    async def _whole(self, rid: str, queue: asyncio.Queue, chat: bool, request: Request) -> Response:
        """Wait for the finished output (aborting it when the client disconnects first)."""
        try:
            while True:
                try:
                    out = await asyncio.wait_for(_next(queue), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.loop.abort(rid)
                        return Response(status_code=499)
                    continue
                if out.finished:
                    break
        except ApiError as e:
            return _error(e, self.metrics)
        if out.output.finish_reason == "error":
            return _error(_finish_error(out), self.metrics)
        return JSONResponse(completion_body(rid, self.model, chat, out.output))

    async def _events(self, rid: str, queue: asyncio.Queue, chat: bool, include_usage: bool):
        """Server-sent events of one streamed answer; a client that leaves aborts the request
        (Starlette cancels this generator when the connection drops)."""
        done = False
        try:
            if chat:
                yield chunk(rid, self.model, chat, role=True)
            while not done:
                out = await _next(queue)
                done = out.finished
                if out.new_text:
                    yield chunk(rid, self.model, chat, text=out.new_text)
            if out.output.finish_reason == "error":
                yield f"data: {json.dumps(_finish_error(out).body())}\n\n"
            else:
                yield chunk(rid, self.model, chat, finish=out.output.finish_reason)
                if include_usage:
                    yield chunk(rid, self.model, chat, out=out.output)
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            if not done:
                self.loop.abort(rid)
        yield "data: [DONE]\n\n"

    def _card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "tabed_engine"}

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the one model served."""
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request) -> Response:
        """GET /v1/models/{model}."""
        if request.path_params["model"] != self.model:
            return _error(ApiError(f"model {request.path_params['model']!r} is not served here", "model",
                                   status=404), self.metrics)
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        """GET /health: 200 while the engine loop runs (with replicas: while one does), 503 after
        it failed."""
        body, status = self.loop.health()
        return JSONResponse(body, status_code=status)

    async def prometheus(self, request: Request) -> Response:
        """GET /metrics in the Prometheus text format."""
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")


def serve(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str = "tabed", **options):
    """Serve `engine` over HTTP until interrupted (SIGINT/SIGTERM drain in-flight requests)."""
    import uvicorn

    server = OpenAIServer(engine, model_name, **options)
    uvicorn.run(server.app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
