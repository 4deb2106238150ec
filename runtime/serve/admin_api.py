"""Admin endpoints: profiling (vLLM's `/start_profile`, `/stop_profile`), sleep mode (vLLM's
`/sleep`, `/wake_up`, `/is_sleeping`) and weight updates
(SGLang's `/update_weights_from_disk`, `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`). Each is one utility call
to the engine (`EngineServer.util_admin`), which runs it on every rank. Behind the API key like
every route but /health, /version and /metrics.

Answers: 200 with a JSON body (`success: true` for the weight updates, as SGLang's); 400 bad
input (sleep mode not enabled, a checkpoint of another architecture, an unknown group ...); 409
while requests run or wait (sleep and weight updates need an idle engine: finish or abort them
first); 500 a failure on some rank (the message names it).
"""
from __future__ import annotations

import json
from typing import Literal

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .client import EngineClient
from .metrics import Metrics
from .protocol import APIError, Bool


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400, as elsewhere


class SleepRequest(_Body):  # /sleep and /wake_up take their query arguments as a JSON body too
    level: int | None = None


class WakeUpRequest(_Body):
    tags: list[str] | None = None


# vLLM's newer arguments, refused with what to do instead
UNSUPPORTED = {
    ("/sleep", "tags"): " (sleeping single tags is not supported: level 1 or 2 sleeps both "
                        "the weights and the KV cache; /wake_up takes tags)",
    ("/sleep", "mode"): " (no abort / wait modes: a sleep needs an idle engine and is refused "
                        "with a 409 while requests run; abort them or let them finish first)",
}


async def _json_args(request: Request, model: type[_Body], **query):
    """The call's arguments from the query and/or a JSON body (not ignored: a body's level 2
    read as the default 1 would keep the weights in host memory); the same one given both
    ways differently is a 400."""
    for name in request.query_params:  # not ignored either: /sleep?levle=2 is no level 1 sleep
        if name not in query:
            hint = UNSUPPORTED.get((request.url.path, name), "")
            raise APIError(f"unknown query parameter {name!r}: {request.url.path} takes "
                           f"{', '.join(query)} only{hint}", param=name)
    raw = await request.body()
    try:
        body = model.model_validate(json.loads(raw)) if raw.strip() else model()
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(map(str, err["loc"])) or "body"
        raise APIError(f"{loc}: {err['msg']}", param=loc) from None
    except ValueError as e:  # not JSON
        raise APIError(f"the body is not JSON: {e}") from None
    out = {}
    for name, q in query.items():
        b = getattr(body, name)
        if q is not None and b is not None and q != b:
            raise APIError(f"{name} is {q!r} in the query and {b!r} in the body", param=name)
        out[name] = q if q is not None else b
    return out


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str
    load_format: Literal["auto", "safetensors"] | None = None
    flush_cache: Bool = True  # the prefix cache is always reset after an update


class InitWeightsUpdateGroupRequest(_Body):
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # the trainer is rank 0
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedRequest(_Body):
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    # SGLang's older one-tensor form
    name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    group_name: str = "weight_update_group"
    flush_cache: Bool = True

    @model_validator(mode="after")
    def _one_form(self):
        many = self.names is not None or self.dtypes is not None or self.shapes is not None
        one = self.name is not None or self.dtype is not None or self.shape is not None
        if many == one:
            raise ValueError("give names, dtypes and shapes (or name, dtype and shape)")
        if one:
            if None in (self.name, self.dtype, self.shape):
                raise ValueError("name, dtype and shape go together")
            self.names, self.dtypes, self.shapes = [self.name], [self.dtype], [self.shape]
        elif None in (self.names, self.dtypes, self.shapes):
            raise ValueError("names, dtypes and shapes go together")
        return self


COLLECTIVE_RPC = ("reload_weights",)  # EngineCore.COLLECTIVE_RPC (not imported: torch)


class CollectiveRPCRequest(_Body):  # vLLM's /collective_rpc, for its sleep-mode flow
    method: str
    args: list = Field(default_factory=list)
    kwargs: dict = Field(default_factory=dict)
    timeout: None = None  # (not implemented: a value is refused)


class DestroyWeightsUpdateGroupRequest(_Body):
    group_name: str = "weight_update_group"


def add_admin_routes(app: FastAPI, client: EngineClient, metrics: Metrics) -> None:
    async def admin(call: str, /, **kwargs):
        reply = await client.call("admin", call, kwargs)
        if reply["status"] != 200:
            raise APIError(reply["message"], reply["status"])
        return reply["result"]

    def track(result: dict) -> None:
        client.sleeping = bool(result.get("is_sleeping"))
        metrics.set_sleep_level(result.get("level", 0) if client.sleeping else 0)

    @app.post("/start_profile")
    async def start_profile():
        """Profile every rank until /stop_profile (needs --profiler-config)."""
        return await admin("start_profile")

    @app.post("/stop_profile")
    async def stop_profile():
        """Stop; answers once every rank's trace is written, with their paths."""
        return await admin("stop_profile")

    @app.post("/sleep")
    async def sleep(request: Request,
                    level: int | None = Query(None, description="1 (default): weights to host "
                                              "memory, KV cache discarded; 2: both discarded")):
        level = (await _json_args(request, SleepRequest, level=level))["level"]
        result = await admin("sleep", level=1 if level is None else level)
        track(result)
        return {"success": True, "is_sleeping": True, "level": result["level"]}

    @app.post("/wake_up")
    async def wake_up(request: Request,
                      tags: list[str] | None = Query(None, description="weights and/or kv_cache "
                                                                         "(default: both)")):
        tags = (await _json_args(request, WakeUpRequest, tags=tags))["tags"]
        result = await admin("wake_up", tags=tags)
        track(result)
        return {"success": True, "is_sleeping": result["is_sleeping"], "asleep": result["asleep"]}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await admin("is_sleeping")}

    @app.post("/collective_rpc")
    async def collective_rpc(req: CollectiveRPCRequest):
        """`{"method": "reload_weights"}` after a level 2 sleep and /wake_up?tags=weights: the
        weights the engine started with, loaded in place on every rank (vLLM's flow)."""
        if req.method not in COLLECTIVE_RPC:  # (checked here too: nothing odd goes to the engine)
            raise APIError(f"collective_rpc: method {req.method!r} is not supported (rankserve "
                           f"runs {', '.join(COLLECTIVE_RPC)} only)", param="method")
        if req.args or req.kwargs:
            raise APIError(f"collective_rpc: {req.method} takes no arguments",
                           param="args" if req.args else "kwargs")
        return {"results": await admin("collective_rpc", method=req.method)}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest):
        await admin("update_weights_from_disk", model_path=req.model_path)
        return {"success": True, "message": f"loaded {req.model_path}; prefix cache reset"}

    # not in /openapi.json: it blocks the engine until the trainer joins (or a timeout), which
    # a schema-driven fuzzer would hit with made-up addresses
    @app.post("/init_weights_update_group", include_in_schema=False)
    async def init_weights_update_group(req: InitWeightsUpdateGroupRequest):
        await admin("init_weights_update_group", **req.model_dump())
        return {"success": True, "message": f"joined weight-update group {req.group_name!r}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest):
        result = await admin("update_weights_from_distributed", names=req.names, dtypes=req.dtypes,
                             shapes=req.shapes, group_name=req.group_name)
        return {"success": True, "message": f"received {result['num_tensors']} tensor(s); "
                                            "prefix cache reset"}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupRequest):
        await admin("destroy_weights_update_group", group_name=req.group_name)
        return {"success": True, "message": f"left weight-update group {req.group_name!r}"}
