"""The API process: FastAPI app (OpenAI, Anthropic and Responses endpoints, health, metrics) on
uvicorn, talking to the engine process over ZMQ. Started by `engine_proc.serve_engine` as
`python -m rankserve.runtime.serve.app` with its settings (JSON) on stdin."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import sys

import msgspec
import prometheus_client
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ... import __version__
from ..inputs import eos_token_ids_of, load_tokenizer
from . import anthropic_api, openai_api, responses_api
from .args import ServerArgs
from .client import EngineClient, EngineDeadError
from .context import ServeContext, cancel_on_disconnect
from .metrics import Metrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                              CountTokensRequest, DerenderRequest,
                                              DetokenizeRequest, MessagesRequest,
                                              ResponsesRequest, TokenizeRequest, now)

log = logging.getLogger("rankserve.serve")

DEAD_EXIT_S = 5.0  # after the engine died: answer 503 this long, then exit
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def error_response(path: str, err: APIError) -> JSONResponse:
    body = err.anthropic_body() if path.startswith("/v1/messages") else err.openai_body()
    return JSONResponse(body, status_code=err.status)


def validation_message(exc: RequestValidationError) -> str:
    msgs = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msgs.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "; ".join(msgs) or "invalid request"


class APIKeyMiddleware:
    """`--api-key`: /v1 endpoints need `Authorization: Bearer KEY` (OpenAI clients) or
    `x-api-key: KEY` (Anthropic clients). Checked before the body is read."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given.strip(), self.key):
                err = APIError("Invalid or missing API key", 401, code="invalid_api_key")
                await error_response(scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(ctx: ServeContext, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="rankserve", version=__version__, docs_url=None, redoc_url=None)
    client = ctx.client

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(request.url.path, APIError(validation_message(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request.url.path, APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return error_response(request.url.path, APIError(str(exc), 503))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(request.url.path, APIError(f"internal error: {exc}", 500))

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
    async def reset_prefix_cache():
        return {"reset": await client.call("reset_prefix_cache")}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return openai_api.tokenize(ctx, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return openai_api.detokenize(ctx, req)

    # ---- /v1 ----------------------------------------------------------------------------------
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": now(), "owned_by": "rankserve",
            "root": ctx.model_path, "parent": None,
            "max_model_len": client.model_info.get("max_model_len")}]}

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await cancel_on_disconnect(request.receive, openai_api.create_completion(ctx, req))

    @v1.post("/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return await cancel_on_disconnect(request.receive,
                                          openai_api.create_chat_completion(ctx, req))

    @v1.post("/completions/render")
    async def render_completion(req: CompletionRequest):
        return openai_api.render_completion(ctx, req)

    @v1.post("/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest):
        return openai_api.render_chat(ctx, req)

    @v1.post("/chat/completions/derender")
    async def derender(req: DerenderRequest):
        return openai_api.derender(ctx, req)

    @v1.post("/messages")
    async def messages(req: MessagesRequest, request: Request):
        return await cancel_on_disconnect(request.receive, anthropic_api.create_message(ctx, req))

    @v1.post("/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return anthropic_api.count_tokens(ctx, req)

    @v1.post("/responses")
    async def responses(req: ResponsesRequest, request: Request):
        return await cancel_on_disconnect(request.receive, responses_api.create_response(ctx, req))

    app.include_router(v1)
    if ctx.args.api_key:
        app.add_middleware(APIKeyMiddleware, key=ctx.args.api_key)
    return app


def _model_files(model: str) -> tuple[str | None, dict]:
    """model_type from config.json and sampling defaults from generation_config.json."""
    def read(name):
        try:
            with open(os.path.join(model, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}
    gen = read("generation_config.json")
    return read("config.json").get("model_type"), {k: gen[k] for k in GENERATION_DEFAULTS
                                                   if gen.get(k) is not None}


def public_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{host}:{port}"


async def serve(settings: dict) -> int:
    args = ServerArgs(**settings["server_args"])
    tokenizer = load_tokenizer(settings["tokenizer"])
    eos = eos_token_ids_of(tokenizer, settings["model"]) if tokenizer is not None else []
    metrics = Metrics(settings["served_model_name"])
    client = EngineClient(settings["engine_address"], tokenizer, eos, metrics,
                          settings.get("engine_pid"))
    await client.start()
    model_type, defaults = _model_files(settings["model"])
    ctx = ServeContext(args, settings["served_model_name"], settings["model"], tokenizer, client,
                       model_type, defaults)
    config = uvicorn.Config(build_app(ctx, metrics), host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level, timeout_graceful_shutdown=3,
                            access_log=args.uvicorn_log_level in ("info", "debug"))
    server = uvicorn.Server(config)
    loop = asyncio.get_running_loop()
    client.on_dead = lambda: loop.call_later(DEAD_EXIT_S, setattr, server, "should_exit", True)

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        await client.call("ready", public_url(args.host, args.port))
    task = asyncio.create_task(announce())
    try:
        await server.serve()
    finally:
        task.cancel()
        await client.stop()
    return 0 if server.started else 1


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    settings = msgspec.json.decode(sys.stdin.buffer.read())
    try:
        code = asyncio.run(serve(settings))
    except (ValueError, KeyError) as e:  # bad --renderer / parser names and the like
        log.error("the API server cannot start: %s", e)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
