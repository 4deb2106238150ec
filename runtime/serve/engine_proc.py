"""The engine side of the server: the EngineCore loop behind a ZMQ socket, plus the API child.

`serve_engine` runs in the process that owns the model (MPI rank 0 under mpirun/srun). It starts
the API process (FastAPI + uvicorn, `runtime/serve/app.py`) with subprocess, never fork: MPI may
already be initialised here. The two talk over one ZMQ ROUTER (engine) / DEALER (API) pair:

  API → engine   [EngineCoreRequestType, payload]   ADD: EngineCoreRequest, ABORT: [ids],
                                                    UTILITY: [call_id, method, args], SHUTDOWN
  engine → API   EngineCoreOutputs                  tokens, stats, utility replies, engine_dead

With data parallelism (runtime/dp.py) rank 0 serves replica 0 this way and the API also connects
to the other replicas' leaders, which run `serve_replica`: the same loop without an API child,
until rank 0 sends them SHUTDOWN.
"""
from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import msgspec
import zmq

from .. import envs
from ..config import ConfigError, EngineConfig
from ..engine_core import EngineBusyError, EngineCore, EngineSleepingError, freeze_gc_heap
from ..messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    FinishReason,
    encoder,
    request_decoder,
)
from .args import ServerArgs

log = logging.getLogger("rankserve.serve")

IDLE_POLL_MS = 100  # how long an idle engine blocks waiting for input (also the child-check period)
DRAIN_MARGIN_S = 5.0  # after SIGINT/SIGTERM the API gets --shutdown-timeout + this, then is killed
IPC_PREFIX = "rankserve-"
DEAD_GRACE_S = 2.0  # after an engine error: time for the API to answer in-flight requests


def remove_stale_sockets(directory: str | None = None) -> list[str]:
    """Remove the private ipc:// socket files (`rankserve-PID-xxxxxxxx`) of engine processes that
    no longer exist (left behind by a crash or a SIGKILL); only our own user's sockets."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(IPC_PREFIX):].split("-", 1)[0]
        if not (name.startswith(IPC_PREFIX) and pid.isdigit()):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid() or _alive(int(pid)):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def engine_addresses(engine_address: str | None) -> tuple[str, str]:
    """(address the engine binds, address the API connects to)."""
    if not engine_address:
        path = os.path.join(tempfile.gettempdir(),
                            f"{IPC_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return f"ipc://{path}", f"ipc://{path}"
    if engine_address.startswith("tcp://"):
        host, _, port = engine_address[len("tcp://"):].rpartition(":")
        local = "127.0.0.1" if host in ("0.0.0.0", "*", "") else host
        return f"tcp://{host or '*'}:{port}", f"tcp://{local}:{port}"
    return engine_address, engine_address


def start_api_process(cfg: EngineConfig, server_args: ServerArgs, connect_address: str,
                      env: dict[str, str] | None, replicas: list[str] = ()) -> subprocess.Popen:
    """Spawn `python -m rankserve.runtime.serve.app`; its settings go over stdin (keeps the API
    key out of `ps`). `replicas`: the other data-parallel replicas' engine addresses."""
    settings = {"server_args": server_args.to_dict(), "engine_address": connect_address,
                "engine_addresses": [connect_address, *replicas],
                "model": cfg.model.model, "tokenizer": cfg.model.tokenizer or cfg.model.model,
                "served_model_name": cfg.model.served_names[0],
                "served_model_names": cfg.model.served_names,
                "generation_config": cfg.model.generation_config,
                "trust_remote_code": cfg.model.trust_remote_code,
                "override_generation_config": cfg.model.override_generation_config,
                "engine_pid": os.getpid(),
                "num_speculative_tokens": cfg.spec.num_speculative_tokens if cfg.spec else 0,
                "lora": {"enable": cfg.lora.enable_lora, "max_lora_rank": cfg.lora.max_lora_rank,
                         "modules": list(cfg.lora.lora_modules or ())}}
    # its own session: a launcher that kills rank 0's process group (mpiexec after a rank died)
    # or a terminal's Ctrl-C does not reach it; it answers what is in flight with an error event
    # when this process is gone (client._watch) and is stopped by this process otherwise
    proc = subprocess.Popen([sys.executable, "-m", "rankserve.runtime.serve.app"],
                            stdin=subprocess.PIPE, env=dict(os.environ if env is None else env),
                            start_new_session=True)
    proc.stdin.write(msgspec.json.encode(settings))
    proc.stdin.close()
    return proc


class HostProfile:
    """RANKSERVE_HOST_PROFILE: cProfile over the first STEPS engine steps of each of the first
    BURSTS bursts (work after an idle turn), each written to PATH.<k> as text."""
    STEPS, BURSTS = 64, 3

    def __init__(self, path: str):
        self.path, self.k, self.steps, self.prof = path, 0, 0, None
        self.idle = True
        try:  # refused at start, like RANKSERVE_STEP_LOG, not at the end of the first burst
            open(f"{path}.1", "w").close()
            os.remove(f"{path}.1")
        except OSError as e:
            raise ConfigError(f"RANKSERVE_HOST_PROFILE={path}: cannot write {path}.1 ({e.strerror})") from None

    def before_step(self) -> None:
        if self.prof is None and self.idle and self.k < self.BURSTS:
            self.prof, self.steps, self.k = cProfile.Profile(), 0, self.k + 1
        self.idle = False
        if self.prof is not None:
            self.prof.enable()

    def after_step(self) -> None:
        if self.prof is None:
            return
        self.prof.disable()
        self.steps += 1
        if self.steps >= self.STEPS:
            self.write()

    def on_idle(self) -> None:
        self.idle = True
        if self.prof is not None:
            self.write()

    def write(self) -> None:
        out = io.StringIO()
        out.write(f"host profile of burst {self.k}: {self.steps} engine steps\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(self.prof, stream=out).sort_stats(key).print_stats(40)
        self.prof = None
        try:
            with open(f"{self.path}.{self.k}", "w") as f:
                f.write(out.getvalue())
        except OSError as e:  # a diagnostic never takes the engine down
            log.warning("RANKSERVE_HOST_PROFILE: cannot write %s.%d (%s)", self.path, self.k, e.strerror)


class StatsLog:
    """vLLM's periodic stats line (what a job's output file shows): every `interval` seconds
    with work, prompt / generation throughput since the last line, requests running / waiting,
    KV-cache use, prefix-cache hits (--disable-log-stats: none)."""

    def __init__(self, interval: float, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self.last = clock()
        self.prompt = self.gen = 0
        self.queries = self.hits = 0  # cumulative at the last line

    def observe(self, s) -> None:
        self.prompt += s.num_prompt_tokens
        self.gen += s.num_generation_tokens
        now = self.clock()
        if now - self.last < self.interval:
            return
        dt, busy = now - self.last, self.prompt or self.gen or s.num_running or s.num_waiting
        dq, dh = s.prefix_queries - self.queries, s.prefix_hits - self.hits
        if busy:
            log.info("engine: %.1f tokens/s prompt, %.1f tokens/s generation throughput; "
                     "%d running, %d waiting requests; KV cache %.1f %%; prefix cache hit rate "
                     "%.1f %%", self.prompt / dt, self.gen / dt, s.num_running, s.num_waiting,
                     100 * s.kv_usage, 100 * dh / dq if dq > 0 else 0.0)
        self.last, self.prompt, self.gen = now, 0, 0
        self.queries, self.hits = s.prefix_queries, s.prefix_hits


class EngineServer:
    """Drives one EngineCore from a ROUTER socket. The API's identity is learned from its first
    message (there is exactly one API process)."""

    def __init__(self, core: EngineCore, cfg: EngineConfig, bind_address: str | None = None,
                 bound: tuple | None = None, log_stats: bool = False):
        """Binds `bind_address`, or takes `bound` = (zmq context, ROUTER socket) listening already."""
        self.core, self.cfg = core, cfg
        self.stats_log = StatsLog(envs.get("RANKSERVE_LOG_STATS_INTERVAL")) if log_stats else None
        if bound is not None:
            self.ctx, self.sock = bound
        else:
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDHWM, 0)
            self.sock.setsockopt(zmq.RCVHWM, 0)
            self.sock.bind(bind_address)
        self.peer: bytes | None = None
        self.stop_requested = False
        self.ready_url: str | None = None
        path = envs.get("RANKSERVE_STEP_LOG")
        try:
            self.step_log = open(path, "a", buffering=1) if path else None  # line by line: live
        except OSError as e:
            raise ConfigError(f"RANKSERVE_STEP_LOG={path}: cannot write it ({e.strerror})") from None
        self.last_out = time.monotonic()
        path = envs.get("RANKSERVE_HOST_PROFILE")
        self.host_profile = HostProfile(path) if path else None
        freeze_gc_heap()  # this process serves this engine until it exits

    def send(self, outs: EngineCoreOutputs) -> None:
        if self.peer is not None:
            self.sock.send_multipart([self.peer, encoder.encode(outs)], copy=False)

    # ---- inputs -------------------------------------------------------------------------------
    def drain(self) -> bool:
        """Handle every queued message; True if any arrived."""
        got = False
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True
            self.peer = frames[0]
            kind, payload = frames[1], frames[2] if len(frames) > 2 else b""
            try:
                self.handle(EngineCoreRequestType(kind), payload)
            except Exception:
                log.exception("bad message from the API process")

    def handle(self, kind: EngineCoreRequestType, payload: bytes) -> None:
        if kind == EngineCoreRequestType.ADD:
            req = request_decoder.decode(payload)
            try:
                self.core.add_request(req)
            except Exception as e:  # noqa: BLE001  (refused: the client gets a 400, or 503 asleep)
                msg = str(e) if isinstance(e, (ValueError, EngineSleepingError)) else f"{type(e).__name__}: {e}"
                self.send(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    req.request_id, [], finish_reason=FinishReason.ERROR, error=msg,
                    error_status=503 if isinstance(e, EngineSleepingError) else None)]))
        elif kind == EngineCoreRequestType.ABORT:
            self.core.abort_requests(msgspec.msgpack.decode(payload, type=list[str]))
        elif kind == EngineCoreRequestType.UTILITY:
            call_id, method, args = msgspec.msgpack.decode(payload)
            try:
                result, err = getattr(self, "util_" + method)(*args), None
            except Exception as e:  # noqa: BLE001  (the error goes back to the caller)
                result, err = None, f"{type(e).__name__}: {e}"
            self.send(EngineCoreOutputs(utility_result=(call_id, result, err)))
        elif kind == EngineCoreRequestType.SHUTDOWN:
            self.stop_requested = True

    # ---- utility calls (API → engine) ---------------------------------------------------------
    def util_get_model_info(self) -> dict:
        c = self.core
        return {"max_model_len": c.max_model_len, "vocab_size": c.vocab_size,
                "num_blocks": c.num_blocks, "block_size": self.cfg.cache.block_size,
                "scheduling_policy": self.cfg.scheduler.policy,
                "max_logprobs": self.cfg.model.max_logprobs if self.cfg.model.max_logprobs >= 0
                else c.vocab_size}

    def util_check_lora(self, path: str) -> str:
        """Why the LoRA adapter at `path` cannot run on this model ("" if it can)."""
        try:
            self.core.check_lora(path)
        except ValueError as e:
            return str(e)
        return ""

    def util_reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    ADMIN = ("start_profile", "stop_profile", "sleep", "wake_up", "is_sleeping",
             "update_weights_from_disk", "init_weights_update_group", "update_weights_from_distributed",
             "destroy_weights_update_group", "collective_rpc")

    def util_admin(self, method: str, kwargs: dict) -> dict:
        """Sleep mode and weight updates: {"status": HTTP status, "result" or "message"}
        (400 bad input, 409 requests are running, 500 a failure on some rank)."""
        if method not in self.ADMIN:
            return {"status": 404, "message": f"unknown admin call {method!r}"}
        try:
            return {"status": 200, "result": getattr(self.core, method)(**kwargs)}
        except (ValueError, TypeError) as e:
            return {"status": 400, "message": str(e)}
        except EngineBusyError as e:
            return {"status": 409, "message": str(e)}
        except Exception as e:  # noqa: BLE001  (the engine lives on; the client learns why)
            log.exception("%s failed", method)
            return {"status": 500, "message": f"{method} failed: {type(e).__name__}: {e}"}

    def util_ready(self, url: str) -> bool:
        self.ready_url = url
        print(f"rankserve: serving {', '.join(self.cfg.model.served_names)} "
              f"at {url}", flush=True)
        return True

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, api: subprocess.Popen, stop: list[bool], drain_s: float) -> int:
        """Serve until the API process exits; after a signal, keep serving while the API drains
        (it stops taking requests and finishes those in flight), killing it after `drain_s`."""
        deadline = None
        while True:
            code = api.poll()
            if code is not None:
                if deadline is not None or self.stop_requested:
                    return 0
                log.error("the API process exited (code %s); stopping the engine", code)
                return 1
            if (stop[0] or self.stop_requested) and deadline is None:
                log.info("shutting down: stopping the API process")
                api.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + drain_s
            if deadline is not None and time.monotonic() > deadline:
                api.kill()
                api.wait()
                return 0
            self.turn()

    def run_replica(self) -> int:
        """A data-parallel replica's loop: no API child here; serve until SHUTDOWN arrives."""
        while not self.stop_requested:
            self.turn()
        return 0

    def turn(self) -> None:
        """Wait for input while idle, take what arrived, run a step if there is work."""
        if not self.core.has_work:
            self.sock.poll(IDLE_POLL_MS)  # block: no busy-spinning while idle
        t0 = time.monotonic()
        changed = self.drain()
        prof = self.host_profile
        if self.core.has_work:
            t1 = time.monotonic()
            if prof is not None:
                prof.before_step()
            outs = self.core.step()
            if prof is not None:
                prof.after_step()
            if outs.outputs or outs.stats is not None:  # (a PP submit returns neither)
                t2 = time.monotonic()
                self.send(outs)
                if self.stats_log is not None and outs.stats is not None:
                    self.stats_log.observe(outs.stats)
                if self.step_log is not None and outs.stats is not None:
                    now, s = time.monotonic(), outs.stats
                    phases = ",".join(f"{x:.6f}" for x in (t1 - t0, *self.core.last_phases, now - t2))
                    self.step_log.write(f"{now:.6f},{now - self.last_out:.6f},{s.num_prompt_tokens},"
                                        f"{s.num_generation_tokens},{s.num_running},{s.num_waiting},"
                                        f"{phases}\n")
                    self.last_out = now
        else:
            if prof is not None:
                prof.on_idle()
            if changed:  # e.g. an abort freed blocks: let the metrics see it
                self.send(EngineCoreOutputs(stats=self.core.scheduler.stats(), timestamp=time.monotonic()))

    def close(self) -> None:
        if self.step_log is not None:
            self.step_log.close()
        self.sock.close(0)
        self.ctx.term()


def serve_engine(cfg: EngineConfig, server_args: ServerArgs, executor, *,
                 api_env: dict[str, str] | None = None, on_drain=None) -> int:
    """Serve `cfg`'s model over HTTP until SIGINT/SIGTERM; returns the exit code.

    Runs the EngineCore on `executor` (UniprocExecutor, or an MPI executor whose workers run on the
    other ranks) in this process and the API server in a child process. `api_env` is the child's
    environment: pass it scrubbed of MPI/PMI/Slurm variables (launch.discovery.scrub_launcher_env)
    so that the child never takes itself for an MPI rank. The caller owns `executor` (and shuts
    it down). Exit code 0 after a signal, 1 when the engine failed or the API process died.
    `on_drain(callback)`: multi-rank, where the launcher's failure handlers take every rank's
    signals (launch/failure.py); `callback()` then starts the drain instead of a handler here."""
    server_args = server_args.validate().resolve_api_key()
    drain_s = server_args.shutdown_timeout + DRAIN_MARGIN_S
    for path in remove_stale_sockets():
        log.info("removed the stale socket %s", path)
    bind, connect = engine_addresses(server_args.engine_address)
    stop = [False]
    children: list[subprocess.Popen] = []
    dp = getattr(executor, "dp", None)
    replicas = dp.addresses if dp is not None else []

    def on_signal(signum, frame):
        if stop[0] and signum == signal.SIGINT and children:  # the second Ctrl-C: now
            children[0].send_signal(signal.SIGINT)  # (the API is in its own session)
        stop[0] = True
    old = {}
    if on_drain is not None:
        on_drain(lambda: stop.__setitem__(0, True))
    else:
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    api = start_api_process(cfg, server_args, connect, api_env, replicas)  # loads its tokenizer meanwhile
    children.append(api)
    server = None
    try:
        server = EngineServer(EngineCore(cfg, executor), cfg, bind,
                              log_stats=not server_args.disable_log_stats)
        try:
            return server.run(api, stop, drain_s)
        except Exception as e:  # noqa: BLE001  (tell the API, which answers 503, then exit)
            log.error("engine failed:\n%s", traceback.format_exc())
            server.send(EngineCoreOutputs(engine_dead=f"{type(e).__name__}: {e}"))
            time.sleep(DEAD_GRACE_S)
            return 1
    finally:
        if api.poll() is None:
            api.terminate()
            try:
                api.wait(drain_s)
            except subprocess.TimeoutExpired:
                api.kill()
                api.wait()
        if server is not None:
            server.close()
        stop_replicas(replicas)
        if bind.startswith("ipc://"):
            try:
                os.unlink(bind[len("ipc://"):])
            except OSError:
                pass
        for s, h in old.items():
            signal.signal(s, h)


def stop_replicas(addresses: list[str]) -> None:
    """Send SHUTDOWN to the other data-parallel replicas' engines (rank 0, when it stops)."""
    if not addresses:
        return
    ctx = zmq.Context()
    try:
        for address in addresses:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)  # long enough to deliver, never a hang
            sock.connect(address)
            sock.send_multipart([EngineCoreRequestType.SHUTDOWN.value, b""])
            sock.close()
    finally:
        ctx.term()


def serve_replica(cfg: EngineConfig, executor) -> int:
    """Data-parallel replica k > 0, on its first rank: an EngineCore behind the socket bound in
    runtime/dp.py, serving the API on rank 0 until it sends SHUTDOWN. An engine error is told to
    the API (it answers 503), then raised: the failure handlers take the job down, naming this
    rank, like any rank's failure."""
    server = EngineServer(EngineCore(cfg, executor), cfg, bound=executor.dp.bound)
    try:
        return server.run_replica()
    except Exception as e:
        log.error("data-parallel replica %d failed", executor.dp.dp_rank)
        server.send(EngineCoreOutputs(engine_dead=f"{type(e).__name__}: {e}"))
        raise
    finally:
        server.close()
