"""ServerArgs: the API server's own options (the engine's are in EngineConfig). The CLI flags of
`rankserve serve` are made from these fields the same way the engine flags are made from
EngineConfig (`doc` metadata is the help)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import opt


@dataclass
class ServerArgs:
    host: str = opt("127.0.0.1", "address the HTTP server binds (0.0.0.0: all interfaces)")
    port: int = opt(8000, "HTTP port")
    api_key: str | None = opt(None, "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) "
                                    "on /v1 endpoints")
    renderer: str = opt("auto", "chat renderer: auto, hf (the tokenizer's chat template), "
                                "mistral, deepseek_v3")
    tool_call_parser: str | None = opt(None, "tool-call format of the model's output, e.g. "
                                             "hermes, qwen3, llama3_json, mistral, deepseek_v3")
    reasoning_parser: str | None = opt(None, "reasoning format of the model's output, e.g. qwen3, "
                                             "deepseek_v3")
    enable_auto_tool_choice: bool = opt(False, "let the model decide to call tools "
                                               "(tool_choice auto; needs --tool-call-parser)")
    chat_template: str | None = opt(None, "chat template for chat requests instead of the "
                                          "tokenizer's: a file path or the template itself")
    engine_address: str | None = opt(None, "ZMQ address the engine binds for the API process: "
                                           "ipc://PATH or tcp://HOST:PORT (default: a private "
                                           "ipc:// socket)")
    uvicorn_log_level: str = opt("warning", "uvicorn's log level",
                                 choices=("critical", "error", "warning", "info", "debug"))

    def validate(self) -> "ServerArgs":
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.engine_address and not self.engine_address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"--engine-address must start with ipc:// or tcp://, "
                             f"got {self.engine_address!r}")
        from ..parse import PARSERS
        from ..render import RENDERERS, load_chat_template
        if self.chat_template:
            load_chat_template(self.chat_template)  # an unreadable path fails at the CLI
        for flag, registry, name in (("--renderer", RENDERERS, self.renderer),
                                     ("--tool-call-parser", PARSERS, self.tool_call_parser),
                                     ("--reasoning-parser", PARSERS, self.reasoning_parser)):
            if name and name != "auto":
                try:
                    registry.get(name)
                except ValueError as e:
                    raise ValueError(f"{flag}: {e}") from None
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
