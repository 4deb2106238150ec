"""The API process: FastAPI app (OpenAI, Anthropic and Responses endpoints, health, metrics) on
uvicorn, talking to the engine process over ZMQ. Started by `engine_proc.serve_engine` as
`python -m rankserve.runtime.serve.app` with its settings (JSON) on stdin."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading

import msgspec
import prometheus_client
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ... import __version__
from ..inputs import eos_token_ids_of, load_tokenizer, sampling_defaults
from . import anthropic_api, event_loop_factory, openai_api, responses_api
from .admin_api import add_admin_routes
from .args import ServerArgs
from .client import EngineClient, EngineDeadError
from .context import ServeContext, cancel_on_disconnect
from .metrics import Metrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    DerenderRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    MessagesRequest,
    RequestIdMiddleware,
    ResponsesRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    validation_param,
)

log = logging.getLogger("rankserve.serve")

DEAD_EXIT_S = 5.0  # after the engine died: answer 503 this long, then exit
FINAL_FLUSH_S = 2.0  # after the shutdown grace: time to send the error endings, then exit


class SafeJSONResponse(JSONResponse):
    """JSON that renders whatever the message quotes back (e.g. a lone surrogate from the
    request): \\u escapes instead of a UnicodeEncodeError while answering an error."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode()


def error_response(path: str, err: APIError) -> JSONResponse:
    body = err.anthropic_body() if path.startswith("/v1/messages") else err.openai_body()
    return SafeJSONResponse(body, status_code=err.status)


def validation_message(exc: RequestValidationError, content_type: str = "") -> str:
    msgs = []
    for e in exc.errors():
        if tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes):
            # FastAPI parses JSON only under a JSON content type (curl -d sends a form's)
            return ("the request body must be JSON sent with Content-Type: application/json, "
                    f"got Content-Type: {content_type or 'none'}")
        if e.get("type") == "json_invalid":
            at = [x for x in e.get("loc", ()) if isinstance(x, int)]
            return (f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}"
                    + (f" (at character {at[0]})" if at else ""))
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msgs.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "; ".join(msgs) or "invalid request"


OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})  # no API key needed (documented)
SHUTDOWN_OPEN_PATHS = frozenset({"/version", "/metrics"})  # still answered while draining


def _key_digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()  # equal lengths: compare_digest then leaks nothing


class ServeState:
    """What the middleware and the shutdown share: requests in flight, and whether we drain."""

    def __init__(self):
        self.inflight = 0
        self.draining: str | None = None  # why new requests get a 503


class ServeMiddleware:
    """Outermost layer of every HTTP request, in this order:
    - while shutting down, new requests get a 503 (`/version`, `/metrics` still answer);
    - the API key (`--api-key`, env, file) on every route but /health, /version and /metrics:
      `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients),
      checked before the body is read;
    - the body limit (`--max-request-body-bytes`): 413 from Content-Length, or as soon as a
      chunked body grows past it; the body is read here, then handed to the app;
    - any unexpected exception becomes a JSON 500 in the route's error format, and the
      connection stays usable (raising into uvicorn would reset it)."""

    def __init__(self, app, state: ServeState, key: str | None, max_body: int):
        self.app, self.state, self.max_body = app, state, max_body
        self.key = _key_digest(key.encode()) if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        reply = _replier(scope, send)
        if self.state.draining and path not in SHUTDOWN_OPEN_PATHS:
            return await reply(APIError(self.state.draining, 503), close=True)
        headers = dict(scope["headers"])
        if self.key is not None and path not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(_key_digest(given.strip()), self.key):
                return await reply(APIError("Invalid or missing API key", 401,
                                            code="invalid_api_key"))
        self.state.inflight += 1
        started = False

        async def send_(message):
            nonlocal started
            started = True
            await send(message)
        try:
            if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
                receive = await self._read_body(headers, receive)
                if receive is _GONE:  # the client left before its body was complete
                    return
                if receive is None:
                    return await reply(APIError(
                        f"the request body is larger than {self.max_body} bytes "
                        "(--max-request-body-bytes)", 413, code="request_too_large"), close=True)
            await self.app(scope, receive, send_)
        except Exception as e:
            log.exception("internal error on %s", path)
            if not started:
                await reply(APIError(f"internal error: {type(e).__name__}: {e}", 500))
            # else: the response is under way; uvicorn closes the connection after it
        finally:
            self.state.inflight -= 1

    async def _read_body(self, headers: dict, receive):
        """The whole body (None if over the limit), then the app gets it back from a receive
        that afterwards passes through (disconnect notices)."""
        try:
            if int(headers.get(b"content-length", b"0")) > self.max_body:
                return None
        except ValueError:
            pass
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending = [first]

        async def receive_():
            return pending.pop() if pending else await receive()
        return receive_


_GONE = object()


def _replier(scope, send):
    async def reply(err: APIError, close: bool = False):
        resp = error_response(scope["path"], err)
        if close:  # the rest of the body is not read: this connection cannot be reused
            resp.headers["Connection"] = "close"
        await resp(scope, None, send)
    return reply


class _JSONRequest(Request):
    async def json(self):
        """msgspec parses a body in a third of json.loads' time; where it refuses one (bad JSON,
        a BOM, NaN, a lone surrogate escape...), json.loads decides, with its usual result or
        error message."""
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = msgspec.json.decode(body)
            except Exception:  # noqa: BLE001
                self._json = json.loads(body)
        return self._json


class _JSONRoute(APIRoute):
    """A route whose body is parsed by _JSONRequest (FastAPI's custom-route hook)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(_JSONRequest(request.scope, request.receive))
        return route_handler


def build_app(ctx: ServeContext, metrics: Metrics, state: ServeState | None = None) -> FastAPI:
    """The app; /openapi.json (behind the API key) describes it (the fuzz suite reads it)."""
    app = FastAPI(title="rankserve", version=__version__, docs_url=None, redoc_url=None)
    app.router.route_class = _JSONRoute
    cors = ctx.args.cors()
    app.add_middleware(CORSMiddleware, allow_origins=cors["allowed_origins"],
                       allow_methods=cors["allowed_methods"], allow_headers=cors["allowed_headers"],
                       allow_credentials=ctx.args.allow_credentials)
    client = ctx.client
    state = state or ServeState()
    app.state.serve = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message = validation_message(exc, request.headers.get("content-type", ""))
        return error_response(request.url.path, APIError(message,
                                                         param=validation_param(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request.url.path, APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return error_response(request.url.path, APIError(str(exc), 503))

    # ---- service ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if client.dead:
            raise APIError(client.dead, 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_():
        return Response(metrics.exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        for name in request.query_params:  # vLLM's reset_running_requests / reset_external: not here
            raise APIError(f"unknown query parameter {name!r}: /reset_prefix_cache takes none (the "
                           "cache is reset only while no request holds blocks: {\"reset\": false} "
                           "otherwise; running requests are not preempted for it)", param=name)
        return {"reset": await client.call("reset_prefix_cache")}

    # tokenization, chat templates and decoding run in ctx's threads, never on the event loop;
    # the generation routes render ahead of their handler (ctx.prepare)
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        ctx.check_prompt_chars(req.prompt, "prompt")
        return await ctx.run_sync(openai_api.tokenize, ctx, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return await ctx.run_sync(openai_api.detokenize, ctx, req)

    # ---- /v1 ----------------------------------------------------------------------------------
    v1 = APIRouter(prefix="/v1", route_class=_JSONRoute)

    # the anthropic client (it sends `anthropic-version`) reads Anthropic's model objects
    @v1.get("/models")
    async def models(request: Request):
        names = [*ctx.model_names, *ctx.loras.adapters]
        if "anthropic-version" in request.headers:
            return anthropic_api.model_list(ctx, names)
        return {"object": "list", "data": [openai_api.model_card(ctx, n) for n in names]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        if "anthropic-version" not in request.headers:
            return openai_api.model_card(ctx, model_id)
        try:
            return anthropic_api.model_info(ctx, model_id)
        except APIError as e:
            return SafeJSONResponse(e.anthropic_body(), status_code=e.status)

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        # the engine checks the adapter's tensors against the model's layers ("" if it fits)
        problem = await client.call("check_lora", req.lora_path) if ctx.lora_enabled else ""
        return openai_api.load_lora_adapter(ctx, req, problem)

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        return openai_api.unload_lora_adapter(ctx, req)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            await ctx.prepare(openai_api.completion_prompts, ctx, prompt,
                              req.truncate_prompt_tokens is None)
        # (token ids have nothing to tokenize: no trip through the tokenizer threads)
        return await cancel_on_disconnect(request.receive, openai_api.create_completion(ctx, req))

    @v1.post("/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        await ctx.prepare(openai_api.prepare_chat, ctx, req)
        return await cancel_on_disconnect(request.receive,
                                          openai_api.create_chat_completion(ctx, req))

    @v1.post("/completions/render")
    async def render_completion(req: CompletionRequest):
        return await ctx.run_sync(openai_api.render_completion, ctx, req)

    @v1.post("/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest):
        return await ctx.run_sync(openai_api.render_chat, ctx, req)

    @v1.post("/chat/completions/derender")
    async def derender(req: DerenderRequest):
        return await ctx.run_sync(openai_api.derender, ctx, req)

    @v1.post("/messages")
    async def messages(req: MessagesRequest, request: Request):
        await ctx.prepare(anthropic_api._render, ctx, req)
        return await cancel_on_disconnect(request.receive, anthropic_api.create_message(ctx, req))

    @v1.post("/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return await ctx.run_sync(anthropic_api.count_tokens, ctx, req)

    @v1.post("/responses")
    async def responses(req: ResponsesRequest, request: Request):
        await ctx.prepare(responses_api.render, ctx, req)
        return await cancel_on_disconnect(request.receive, responses_api.create_response(ctx, req))

    @v1.post("/responses/input_tokens")
    async def responses_input_tokens(req: ResponsesRequest):
        return await ctx.run_sync(responses_api.count_input_tokens, ctx, req)

    @v1.api_route("/responses/{response_id}", methods=["GET", "DELETE"])
    @v1.post("/responses/{response_id}/cancel")
    @v1.get("/responses/{response_id}/input_items")
    async def stored_response(response_id: str):
        raise APIError(f"No response with id {response_id!r}: responses are not stored by this "
                       "server (store is not supported)", 404, "response_id")

    app.include_router(v1)
    add_admin_routes(app, client, metrics)  # sleep mode and weight updates
    app.add_middleware(ServeMiddleware, state=state, key=ctx.args.api_key,
                       max_body=ctx.args.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # outermost: errors and 401s carry the id too
    return app


def _model_files(model: str, source: str = "auto", override: str | None = None
                 ) -> tuple[str | None, dict]:
    """model_type from config.json and sampling defaults from generation_config.json
    (--generation-config, --override-generation-config)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    return model_type, sampling_defaults(model, source, override)


def public_url(host: str, port: int, tls: bool = False) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    if ":" in host:  # an IPv6 address: in brackets, or the URL does not parse
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def uvicorn_config(app: FastAPI, args: ServerArgs, **kw) -> uvicorn.Config:
    """The HTTP server of `args`: address, TLS, the path prefix behind a proxy."""
    kw = dict(dict(log_level=args.uvicorn_log_level, timeout_graceful_shutdown=FINAL_FLUSH_S,
                   access_log=args.uvicorn_log_level in ("info", "debug", "trace")), **kw)
    return uvicorn.Config(app, host=args.host, port=args.port, root_path=args.root_path or "",
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, **kw)


class DrainingServer(uvicorn.Server):
    """uvicorn with a graceful SIGTERM/SIGINT: new requests get a 503 at once, requests in flight
    get `--shutdown-timeout` seconds to finish, then the rest end with an error (an SSE error
    event, or a JSON 503) and the server exits. A second SIGINT exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServeState, client: EngineClient,
                 grace_s: float):
        super().__init__(config)
        self.state, self.client, self.grace_s = state, client, grace_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_task is not None or self.loop is None:
            if sig == signal.SIGINT or self.loop is None:
                super().handle_exit(sig, frame)  # the second Ctrl-C: now
            return
        self.loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        if self.drain_task is None:
            self.drain_task = asyncio.ensure_future(self.drain(signal.Signals(sig).name))

    async def drain(self, why: str) -> None:
        self.state.draining = "the server is shutting down"
        log.info("%s: draining %d request(s) for up to %.3g s", why, self.state.inflight,
                 self.grace_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while self.state.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.inflight:
            log.warning("shutdown: ending %d request(s) still in flight", self.state.inflight)
            self.client.end_all("the server is shutting down: the request did not finish within "
                                f"the shutdown timeout ({self.grace_s:g} s)")
            deadline = loop.time() + FINAL_FLUSH_S
            while self.state.inflight and loop.time() < deadline:
                await asyncio.sleep(0.02)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        """Like uvicorn's, without raising the signal again at the end (a drained shutdown
        exits 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


async def serve(settings: dict) -> int:
    args = ServerArgs(**settings["server_args"])
    tokenizer = load_tokenizer(settings["tokenizer"], settings.get("trust_remote_code", False))
    eos = eos_token_ids_of(tokenizer, settings["model"])
    # one engine address, or one per data-parallel replica (replica 0 first)
    addresses = settings.get("engine_addresses") or [settings["engine_address"]]
    metrics = Metrics(settings["served_model_name"], len(addresses), settings.get("num_speculative_tokens", 0))
    client = EngineClient(addresses, tokenizer, eos, metrics, settings.get("engine_pid"))
    await client.start()
    model_type, defaults = _model_files(settings["model"], settings.get("generation_config", "auto"),
                                        settings.get("override_generation_config"))
    ctx = ServeContext(args, settings.get("served_model_names") or settings["served_model_name"],
                       settings["model"], tokenizer, client,
                       model_type, defaults)
    lora = settings.get("lora") or {}
    if lora.get("enable"):
        from ..lora import LoRATable, parse_lora_modules
        ctx.lora_enabled, ctx.loras = True, LoRATable(lora["max_lora_rank"])
        for name, path, base in parse_lora_modules(lora["modules"]):
            ctx.loras.add(name, path, base)
    state = ServeState()
    config = uvicorn_config(build_app(ctx, metrics, state), args)
    server = DrainingServer(config, state, client, args.shutdown_timeout)
    loop = server.loop = asyncio.get_running_loop()
    client.on_dead = lambda: loop.call_later(DEAD_EXIT_S, setattr, server, "should_exit", True)

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        await client.call("ready", public_url(args.host, args.port, bool(args.ssl_certfile)))
    task = asyncio.create_task(announce())
    # torch, transformers and the tokenizer leave ~250k objects that live as long as the process:
    # out of the collector's sight, a full collection no longer walks them (0.2-0.3 s on a
    # 2-core machine, paid inside bursts of requests); vLLM's API server does the same
    gc.collect()
    gc.freeze()
    try:
        await server.serve()
    finally:
        task.cancel()
        ctx.pool.shutdown(wait=False, cancel_futures=True)
        await client.stop()
    return 0 if server.started else 1


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    settings = msgspec.json.decode(sys.stdin.buffer.read())
    factory = event_loop_factory()
    log.info("API server event loop: %s", "asyncio" if factory is None else factory.__module__.split(".")[0])
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            code = runner.run(serve(settings))
    except (ValueError, KeyError) as e:  # bad --renderer / parser names and the like
        log.error("the API server cannot start: %s", e)
        code = 1
    except KeyboardInterrupt:  # a SIGINT sent to this process itself before uvicorn took over
        code = 128 + signal.SIGINT
    sys.exit(code)


if __name__ == "__main__":
    main()
