"""A minimal streaming HTTP/1.1 POST client on asyncio streams for `rankserve bench serve`.

The measuring client must cost far less than the server it measures: with 256 streams of one
token per ~5 ms engine step, it reads ~50,000 SSE chunks a second. httpx spends tens of µs on
each (h11 events, its stream wrappers) and, in one process, became the bottleneck of the online
benchmark (chunks queued in the socket, then read in bursts: ITL p50 ~0 ms, p99 of hundreds of
ms, and fewer tokens/s than the server sent; `python -m rankserve.runtime.bench.frontend
--client bench-serve` shows it). This one reads the body framing (chunked, Content-Length or
until close) directly off the socket. Plain http:// only; https goes through httpx."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPStream:
    """The response to one POST: `status`, `headers` (lower-case names), and the body as it
    arrives (`aiter_bytes`, or `aread` for all of it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.status_code = 0
        self.headers: dict[str, str] = {}

    async def _start(self) -> None:
        line = await self.reader.readline()
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ConnectionError(f"not an HTTP response: {line[:100]!r}")
        self.status_code = int(parts[1])
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        r = self.reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await r.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                data = await r.readexactly(size)
                await r.readexactly(2)
                yield data
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await r.read(min(left, 1 << 16))
                if not data:
                    raise ConnectionError("the connection closed inside the body")
                left -= len(data)
                yield data
        else:  # until the server closes the connection
            while data := await r.read(1 << 16):
                yield data

    async def aread(self) -> bytes:
        return b"".join([d async for d in self.aiter_bytes()])

    def close(self) -> None:
        self.writer.close()


class StreamingClient:
    """`client.stream("POST", url, json=body)` as an async context manager, like httpx's, over a
    new connection per request (`Connection: close`)."""

    def __init__(self, headers: dict[str, str] | None = None):
        self.headers = headers or {}

    def stream(self, method: str, url: str, json=None):
        import json as _json
        return _Request(self, method, url, _json.dumps(json).encode())

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class _Request:
    def __init__(self, client: StreamingClient, method: str, url: str, body: bytes):
        self.client, self.method, self.url, self.body = client, method, url, body
        self.resp: HTTPStream | None = None

    async def __aenter__(self) -> HTTPStream:
        u = urlsplit(self.url)
        if u.scheme != "http":
            raise ValueError(f"StreamingClient speaks plain http://, not {u.scheme}://")
        host, port = u.hostname, u.port or 80
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 60)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = [f"{self.method} {path} HTTP/1.1", f"Host: {u.netloc}",
                "Content-Type: application/json", "Accept: text/event-stream",
                "Connection: close", f"Content-Length: {len(self.body)}"]
        head += [f"{k}: {v}" for k, v in self.client.headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body)
        self.resp = HTTPStream(reader, writer)
        await self.resp._start()
        return self.resp

    async def __aexit__(self, *exc):
        if self.resp is not None:
            self.resp.close()
        return False
