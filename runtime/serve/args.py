"""ServerArgs: the API server's own options (the engine's are in EngineConfig). The CLI flags of
`rankserve serve` are made from these fields the same way the engine flags are made from
EngineConfig (`doc` metadata is the help)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .. import envs
from ..config import opt


@dataclass
class ServerArgs:
    host: str = opt("127.0.0.1", "address the HTTP server binds (0.0.0.0: all interfaces)")
    port: int = opt(8000, "HTTP port")
    api_key: str | None = opt(None, "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) "
                                    "on every endpoint but /health, /version and /metrics; "
                                    "also from env RANKSERVE_API_KEY or VLLM_API_KEY, or "
                                    "--api-key-file (keeps it out of `ps`)")
    api_key_file: str | None = opt(None, "read the API key from this file (first line)")
    max_request_body_bytes: int = opt(8 * 1024 * 1024, "largest request body accepted; larger "
                                                       "ones get a 413")
    shutdown_timeout: float = opt(10.0, "after SIGTERM/SIGINT: new requests get a 503 and "
                                        "requests in flight get this many seconds to finish, "
                                        "then end with an error")
    renderer: str = opt("auto", "chat renderer: auto, hf (the tokenizer's chat template), "
                                "mistral, deepseek_v3")
    tool_call_parser: str | None = opt(None, "tool-call format of the model's output, e.g. "
                                             "hermes, qwen3, llama3_json, mistral, deepseek_v3")
    reasoning_parser: str | None = opt(None, "reasoning format of the model's output, e.g. qwen3, "
                                             "deepseek_v3")
    enable_auto_tool_choice: bool = opt(False, "let the model decide to call tools "
                                               "(tool_choice auto; needs --tool-call-parser)")
    exclude_tools_when_tool_choice_none: bool = opt(
        False, "leave the tools out of the prompt when a request's tool_choice is none (by "
               "default the template still shows them, as vLLM's)")
    chat_template: str | None = opt(None, "chat template for chat requests instead of the "
                                          "tokenizer's: a file path or the template itself")
    engine_address: str | None = opt(None, "ZMQ address the engine binds for the API process: "
                                           "ipc://PATH or tcp://HOST:PORT (default: a private "
                                           "ipc:// socket)")
    uvicorn_log_level: str = opt("warning", "uvicorn's log level",
                                 choices=("critical", "error", "warning", "info", "debug", "trace"))
    disable_log_stats: bool = opt(False, "no periodic engine stats line (throughput, requests, "
                                         "KV cache; every RANKSERVE_LOG_STATS_INTERVAL seconds "
                                         "with work)")
    enable_log_requests: bool = opt(False, "log each request when it arrives (id, prompt, token "
                                           "count, sampling parameters) and when it finishes")
    disable_log_requests: bool = opt(False, "log no request (the default; vLLM's older flag)")
    max_log_len: int | None = opt(None, "with --enable-log-requests: at most this many prompt "
                                        "characters (or token ids) a log line (default: all)")
    api_server_count: int = opt(1, "API server processes (vLLM's flag): rankserve runs one, "
                                   "which streams W1's 256 requests at offline speed", short="-asc")
    # as vLLM's: CORS for browsers, a path prefix behind a proxy, TLS
    allowed_origins: str = opt('["*"]', "CORS: origins allowed to call the API, a JSON list")
    allowed_methods: str = opt('["*"]', "CORS: HTTP methods allowed, a JSON list")
    allowed_headers: str = opt('["*"]', "CORS: request headers allowed, a JSON list")
    allow_credentials: bool = opt(False, "CORS: allow credentials (cookies, Authorization)")
    root_path: str | None = opt(None, "path prefix of the API behind a path-routing proxy "
                                      "(FastAPI's root_path), e.g. /llm")
    ssl_keyfile: str | None = opt(None, "serve HTTPS: the private key file (with --ssl-certfile)")
    ssl_certfile: str | None = opt(None, "serve HTTPS: the certificate file (with --ssl-keyfile)")

    def cors(self) -> dict[str, list[str]]:
        """The CORS lists, parsed (ValueError naming the flag)."""
        import json
        out = {}
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            raw, flag = getattr(self, name), "--" + name.replace("_", "-")
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]'; got {raw!r}")
            out[name] = value
        return out

    def check_port(self) -> None:
        """ValueError when --host / --port cannot be bound now: checked before the model loads
        (minutes for a large one), not found by the HTTP server once the engine is up."""
        import errno
        import socket
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(self.host, self.port,
                                                              type=socket.SOCK_STREAM)[0]
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
                s.bind(addr)
        except OSError as e:
            if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host {self.host} is not an address of this machine "
                                 f"({e.strerror or e}); use one of its addresses or hostnames, "
                                 "0.0.0.0 for all (:: for IPv6)") from None
            what = "in use" if e.errno == errno.EADDRINUSE else "not usable"
            raise ValueError(f"--port {self.port} on --host {self.host} is {what} ({e.strerror or e}); "
                             "pick another --port, or stop the process that holds it") from None
        tcp = self._engine_tcp() if self.engine_address else None
        if tcp is not None:  # the engine's socket, bound after the model loads: checked now too
            host = "0.0.0.0" if tcp[0] in ("", "*") else tcp[0]
            try:
                family, kind, proto, _, addr = socket.getaddrinfo(host, tcp[1],
                                                                  type=socket.SOCK_STREAM)[0]
                with socket.socket(family, kind, proto) as s:
                    s.bind(addr)
            except OSError as e:
                raise ValueError(f"--engine-address {self.engine_address} cannot be bound here "
                                 f"({e.strerror or e})") from None

    def _engine_tcp(self) -> tuple[str, int] | None:
        """(host, port) of a tcp:// --engine-address (None for ipc://); ValueError naming the
        flag when it is neither, or lacks a path / a port (zmq's own error came after the
        model loaded, a traceback)."""
        addr = self.engine_address
        example = "ipc://PATH or tcp://HOST:PORT"
        if addr.startswith("ipc://") and addr[len("ipc://"):]:
            return None
        if addr.startswith("tcp://"):
            host, _, port = addr[len("tcp://"):].rpartition(":")
            if port.isdigit() and 0 < int(port) < 65536:
                return host.strip("[]"), int(port)
        raise ValueError(f"--engine-address must be {example}, got {addr!r}")

    def validate(self) -> ServerArgs:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be positive")
        if not self.shutdown_timeout >= 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.api_key and self.api_key_file:  # (the file was ignored)
            raise ValueError("--api-key and --api-key-file both give the key: give one")
        if self.enable_log_requests and self.disable_log_requests:
            raise ValueError("--enable-log-requests and --disable-log-requests contradict: give one")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.api_server_count != 1:
            raise ValueError(f"--api-server-count {self.api_server_count}: rankserve runs one API "
                             "process; for more engines behind it use --data-parallel-size")
        self.cors()
        if self.root_path is not None and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with /, got {self.root_path!r}")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both, or neither")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if self.engine_address:
            self._engine_tcp()
        from ..parse import PARSERS
        from ..render import RENDERERS, load_chat_template
        if self.chat_template:
            load_chat_template(self.chat_template)  # an unreadable path fails at the CLI
        if self.renderer and self.renderer != "auto":
            try:
                RENDERERS.get(self.renderer)
            except ValueError as e:
                raise ValueError(f"--renderer: {e}") from None
        for flag, fmt, name in (("--tool-call-parser", "tools", self.tool_call_parser),
                                ("--reasoning-parser", "reasoning", self.reasoning_parser)):
            # only the parsers that have this format (deepseek_r1 has no tool calls, ...)
            names = [n for n in PARSERS.names() if getattr(PARSERS.get(n), fmt) is not None]
            if name and name not in names:
                raise ValueError(f"{flag}: unsupported parser {name!r}; supported: "
                                 f"{', '.join(names)}")
        return self

    def resolve_api_key(self, environ: dict | None = None) -> ServerArgs:
        """The key from, in order: --api-key, --api-key-file, RANKSERVE_API_KEY, VLLM_API_KEY
        (an empty value counts as unset). Returns a copy that carries it in `api_key`."""
        env = os.environ if environ is None else environ
        key = self.api_key
        if not key and self.api_key_file:
            try:
                with open(self.api_key_file) as f:
                    key = f.readline().strip()
            except OSError as e:
                raise ValueError(f"--api-key-file: {e}") from None
            if not key:
                raise ValueError(f"--api-key-file: {self.api_key_file} is empty")
        key = key or envs.get("RANKSERVE_API_KEY", env) or env.get("VLLM_API_KEY") or None
        return dataclasses.replace(self, api_key=key)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
