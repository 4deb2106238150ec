"""The API process's connection to the EngineCore(s): sends requests over ZMQ, receives outputs,
detokenizes them (OutputProcessor: stop strings, n > 1 fan-out) and hands each request its
updates; records the metrics on the way.

With data parallelism (`--data-parallel-size N`) there is one engine core per replica, each
behind its own socket; a request goes to the one `LoadBalancer` picks (load, prefix affinity),
admin calls go to all of them."""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ..inputs import engine_request
from ..messages import (
    EngineCoreOutputs,
    EngineCoreRequestType,
    LogprobsEntry,
    encoder,
    outputs_decoder,
)
from ..outputs import OutputProcessor
from ..sampling_params import SamplingParams
from .load_balancer import LoadBalancer
from .metrics import Metrics, observe_many

log = logging.getLogger("rankserve.serve")


class EngineDeadError(RuntimeError):
    """The engine is gone; the API answers 503."""


class ServerShutdownError(EngineDeadError):
    """The server is shutting down and the request ran out of time (503)."""


class RequestError(ValueError):
    """The engine refused the request (e.g. the prompt is longer than the context)."""


class EngineSleepingError(EngineDeadError):
    """The engine sleeps (sleep mode): requests are refused with a 503 until it wakes up."""


# engine messages handled in a row before the handlers get a turn (a bound on their wait)
MAX_MESSAGES_PER_TURN = 64
SLEEPING = ("the engine is sleeping: POST /wake_up first; the request was not queued")


@dataclass
class Update:
    """What one engine output added to choice `index`."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsEntry] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobsEntry | None] | None = None  # with the first update only

    def merge(self, later: Update) -> None:
        """Append a later update of the same choice (one chunk for both)."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


class RequestStream:
    """The updates of one request (all its choices) in arrival order. `close()` aborts whatever
    has not finished; call it when the client goes away.

    Updates the consumer has not taken yet are merged (same choice, not finished): when the
    handler falls behind the engine it wakes once and sends one chunk for all the tokens that
    arrived meanwhile, instead of one per engine step; no token is lost or reordered."""

    def __init__(self, client: EngineClient, request_id: str, child_ids: list[str]):
        self.client, self.request_id, self.child_ids = client, request_id, child_ids
        self.items: collections.deque = collections.deque()  # Updates and Exceptions
        self._waiter: asyncio.Future | None = None
        self.unfinished = set(child_ids)
        self._peeked: Update | None = None
        self.arrival = time.monotonic()

    def put(self, item: Update | Exception) -> None:
        items = self.items
        if items and isinstance(item, Update):
            last = items[-1]
            if isinstance(last, Update) and last.index == item.index and last.finish_reason is None:
                last.merge(item)
                return
        items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self._peeked is not None:
            upd, self._peeked = self._peeked, None
            return upd
        while not self.items:
            if not self.unfinished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self.items.popleft()
        if isinstance(item, Exception):
            self.close()
            raise item
        return item

    async def peek(self) -> Update:
        """Wait for the first update (raises RequestError if the engine refused the request)."""
        if self._peeked is None:
            self._peeked = await self.__anext__()
        return self._peeked

    def close(self) -> None:
        if self.unfinished:
            self.client.abort(list(self.unfinished))
            self.unfinished.clear()
        self.client.streams.pop(self.request_id, None)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class _Child:
    __slots__ = ("engine", "first", "index", "last", "num_prompt", "stream", "timing")

    def __init__(self, stream: RequestStream, index: int, num_prompt: int, engine: int):
        self.stream, self.index, self.num_prompt, self.engine = stream, index, num_prompt, engine
        self.first = self.last = None
        # the engine's times (its clock): queued, first scheduled, first token, last token
        self.timing: list[float] | None = None


# admin calls every replica must run (the others go to replica 0 alone)
BROADCAST_CALLS = frozenset({"get_model_info", "reset_prefix_cache", "admin"})
# a trainer's process group spans the ranks of one engine; several replicas would need one each
SINGLE_ENGINE_ADMIN = frozenset({"init_weights_update_group", "update_weights_from_distributed",
                                 "destroy_weights_update_group"})


class EngineClient:
    def __init__(self, address: str | list[str], tokenizer, eos_token_ids: list[int], metrics: Metrics,
                 engine_pid: int | None = None):
        self.addresses = [address] if isinstance(address, str) else list(address)
        self.balancer = LoadBalancer(len(self.addresses))
        self.processor = OutputProcessor(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics
        self.engine_pid = engine_pid
        self.streams: dict[str, RequestStream] = {}
        self.children: dict[str, _Child] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead: str | None = None
        self.closing: str | None = None  # set when shutting down: no new requests
        self.on_dead = None  # callback: the app schedules its own shutdown
        self.model_info: dict = {}
        self.sleeping = False  # as the last sleep / wake-up call left it (the engine checks too)
        # --enable-log-requests: a line per request and per finished choice; the int is
        # --max-log-len (-1: the whole prompt), None: no request is logged
        self.log_requests: int | None = None

    @property
    def num_engines(self) -> int:
        return len(self.addresses)

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.socks = []
        for address in self.addresses:
            sock = self.ctx.socket(zmq.DEALER)
            for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
                sock.setsockopt(opt, 0)
            sock.connect(address)
            self.socks.append(sock)
        self._tasks = [asyncio.create_task(self._recv_loop(e)) for e in range(self.num_engines)]
        self._tasks.append(asyncio.create_task(self._watch()))
        self.model_info = await self.call("get_model_info")  # also introduces us to every engine
        self.balancer.block_size = self.model_info.get("block_size", 16)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()

    # ---- requests ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, priority: int = 0,
                 request_id: str | None = None, lora_request=None) -> RequestStream:
        if self.dead or self.closing:
            raise (EngineDeadError(self.dead) if self.dead else ServerShutdownError(self.closing))
        if self.sleeping:
            raise EngineSleepingError(SLEEPING)
        rid = request_id or uuid.uuid4().hex
        child_ids = self.processor.add_request(rid, prompt, prompt_token_ids, params)
        if self.log_requests is not None:
            cut = None if self.log_requests < 0 else self.log_requests
            tok = self.processor.tokenizer
            if prompt is None and tok is not None:  # chat / token prompts: the text they decode to
                prompt = tok.decode(prompt_token_ids if cut is None else prompt_token_ids[:cut])
            shown = f"prompt: {prompt[:cut]!r}" if prompt is not None else \
                f"prompt_token_ids: {prompt_token_ids[:cut]}"
            log.info("Received request %s: %s, prompt_tokens=%d, params: %s, lora: %s", rid, shown,
                     len(prompt_token_ids), params, lora_request and lora_request.lora_name)
        stream = RequestStream(self, rid, child_ids)
        self.streams[rid] = stream
        # the choices of one request stay together: they share the prompt's KV blocks
        engine = self.balancer.pick(prompt_token_ids, lora_request and lora_request.lora_name,
                                    len(child_ids))
        for i, cid in enumerate(child_ids):
            self.children[cid] = _Child(stream, i, len(prompt_token_ids), engine)
            req = engine_request(cid, prompt_token_ids, params, self.eos_token_ids, priority, index=i,
                                 lora_request=lora_request)
            self._send(EngineCoreRequestType.ADD, encoder.encode(req), engine)
        return stream

    def abort(self, child_ids: list[str]) -> None:
        now = time.monotonic()
        per_engine: dict[int, list[str]] = {}
        for cid in child_ids:
            child, st = self.children.pop(cid, None), self.processor.states.get(cid)
            if child is not None:
                self.balancer.finished(child.engine)
                if st is not None:
                    self.metrics.record_finished("abort", child.num_prompt, len(st.out.token_ids),
                                                 now - child.stream.arrival, child.engine)
            # a finished child needs no abort; an unknown one may be anywhere: tell every engine
            for e in [child.engine] if child is not None else range(self.num_engines):
                per_engine.setdefault(e, []).append(cid)
        self.processor.abort(child_ids)
        if not self.dead:
            for e, ids in per_engine.items():
                self._send(EngineCoreRequestType.ABORT, encoder.encode(ids), e)

    async def call(self, method: str, *args, timeout: float | None = None):
        """Run `util_<method>` in the engine process and return its result. With several
        replicas, the calls of BROADCAST_CALLS run on every replica and their results merge."""
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.num_engines == 1 or method not in BROADCAST_CALLS:
            return await self._call(0, method, args, timeout)
        if method == "admin" and args[0] in SINGLE_ENGINE_ADMIN:
            return {"status": 400, "message": f"{args[0]} is not supported with --data-parallel-size "
                    f"{self.num_engines} (a trainer's process group spans one engine's ranks)"}
        results = await asyncio.gather(*(self._call(e, method, args, timeout)
                                         for e in range(self.num_engines)))
        if method == "reset_prefix_cache":
            return all(results)
        if method == "admin":  # the first replica that refused or failed speaks for all
            bad = next((r for r in results if r.get("status") != 200), None)
            if bad is None and args[0] == "stop_profile":  # every replica's traces
                return dict(results[0], result=dict(results[0]["result"], traces=[
                    t for r in results for t in r["result"]["traces"]]))
            return bad or results[0]
        return dict(results[0], num_engines=self.num_engines)

    async def _call(self, engine: int, method: str, args, timeout: float | None):
        call_id = next(self._call_ids)
        fut = self.calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(EngineCoreRequestType.UTILITY, encoder.encode((call_id, method, list(args))), engine)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.calls.pop(call_id, None)

    def _send(self, kind: EngineCoreRequestType, payload: bytes, engine: int = 0) -> None:
        # with no high-water mark a DEALER send never blocks, so no await is needed
        self.socks[engine].send_multipart([kind.value, payload], flags=zmq.NOBLOCK)

    # ---- outputs ----------------------------------------------------------------------------
    async def _recv_loop(self, engine: int) -> None:
        sock = self.socks[engine]
        while True:
            # every message queued now (a recv that is ready does not yield to the loop), then
            # one turn for the handlers: when they fall behind, the steps that piled up merge
            # into one update per stream; the handlers never starve behind a stream of steps
            for _ in range(MAX_MESSAGES_PER_TURN):
                msg = await sock.recv()
                try:
                    self._handle(outputs_decoder.decode(msg), engine)
                except Exception:
                    log.exception("failed to process engine outputs")
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
            await asyncio.sleep(0)

    def _handle(self, outs: EngineCoreOutputs, engine: int = 0) -> None:
        if outs.engine_dead:
            which = f" (data-parallel replica {engine})" if self.num_engines > 1 else ""
            self._mark_dead(f"the engine failed{which}: {outs.engine_dead}")
            return
        if outs.utility_result is not None:
            call_id, result, err = outs.utility_result
            fut = self.calls.get(call_id)
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(err)) if err else fut.set_result(result)
        if outs.stats is not None:
            self.metrics.record_stats(outs.stats, engine)
            self.balancer.record_stats(engine, outs.stats.num_waiting, outs.stats.kv_usage)
        now = time.monotonic()
        itls: dict[int, list[float]] = {}  # engine → inter-token latencies, observed in a batch
        delivered: dict[int, int] = {}  # engine → tokens handed to clients (one counter inc each)
        for o in outs.outputs:
            child = self.children.get(o.request_id)
            if child is None:
                continue  # aborted meanwhile
            stream = child.stream
            if o.error:
                stream.put(EngineSleepingError(o.error) if o.error_status == 503
                                        else RequestError(o.error))
                continue
            ro, abort = self.processor.process(o)
            if abort:  # a stop string matched: the engine does not know
                self._send(EngineCoreRequestType.ABORT, encoder.encode([o.request_id]), engine)
            if ro is None:
                continue
            out = ro.outputs[child.index]
            em = self.metrics.engines[child.engine]
            # the tokens clients get: none past a stop string (the engine's count has them)
            delivered[child.engine] = delivered.get(child.engine, 0) + len(out.delta_token_ids)
            if o.new_token_ids:
                if child.first is None:
                    em.ttft.observe(now - stream.arrival)
                    child.first = now
                else:
                    itls.setdefault(child.engine, []).append(now - child.last)
                child.last = now
                # vLLM's phases: token times are those of the engine's output batches (the last
                # one a stop string matched in, here), not when they got here
                if o.scheduled_ts:  # the request's first output
                    child.timing = [o.queued_ts, o.scheduled_ts, outs.timestamp, outs.timestamp]
                elif child.timing is not None:
                    child.timing[3] = outs.timestamp
            stream.put(Update(child.index, out.delta_text, list(out.delta_token_ids),
                                           out.delta_logprobs, out.finish_reason, out.stop_reason,
                                           ro.num_cached_tokens,
                                           ro.prompt_logprobs if o.prompt_logprobs else None))
            if out.finish_reason is not None:
                del self.children[o.request_id]
                stream.unfinished.discard(o.request_id)
                self.balancer.finished(child.engine)
                em.record_finished(out.finish_reason, child.num_prompt, len(out.token_ids),
                                   now - stream.arrival, child.timing)
                if self.log_requests is not None:
                    log.info("Finished request %s: finish_reason=%s, prompt_tokens=%d, "
                             "generated_tokens=%d, e2e %.3f s", o.request_id, out.finish_reason,
                             child.num_prompt, len(out.token_ids), now - stream.arrival)
        for e, values in itls.items():
            observe_many(self.metrics.engines[e].itl, values)
        for e, n in delivered.items():
            self.metrics.engines[e].generation_tokens.inc(n)

    # ---- engine death -----------------------------------------------------------------------
    async def _watch(self) -> None:
        """The engine process is our parent: if we are orphaned, it died without a word."""
        while self.engine_pid is not None and not self.dead:
            await asyncio.sleep(0.5)
            if os.getppid() != self.engine_pid:
                self._mark_dead("the engine process exited")

    def end_all(self, why: str) -> None:
        """Shutdown: every unfinished request ends with ServerShutdownError (its handler
        aborts it in the engine), and no new one is accepted."""
        self.closing = why
        for stream in list(self.streams.values()):
            if stream.unfinished:
                stream.put(ServerShutdownError(why))

    def _mark_dead(self, why: str) -> None:
        if self.dead:
            return
        log.error("%s; answering 503 from now on", why)
        self.dead = why
        for stream in list(self.streams.values()):
            stream.unfinished.clear()
            stream.put(EngineDeadError(why))
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
        if self.on_dead is not None:
            self.on_dead()

