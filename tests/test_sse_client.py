"""bench serve's streaming HTTP client (runtime/bench/sse_client.py) against raw responses: the
three body framings, chunk extensions and trailers, the request it sends."""
from __future__ import annotations

import asyncio

import pytest

from rankserve.runtime.bench.sse_client import StreamingClient

EVENTS = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]


def chunked(parts):
    out = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


RESPONSES = {
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS),
    "length": b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(b"".join(EVENTS))
              + b"".join(EVENTS),
    "close": b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + b"".join(EVENTS),
}


@pytest.mark.parametrize("framing", sorted(RESPONSES))
def test_body_framings_and_request(framing):
    seen = {}

    async def main():
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen["head"], seen["body"] = head, await reader.readexactly(n)
            for i in range(0, len(RESPONSES[framing]), 7):  # split anywhere
                writer.write(RESPONSES[framing][i:i + 7])
                await writer.drain()
            writer.close()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with StreamingClient({"Authorization": "Bearer k"}) as client:
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                     json={"x": [1, 2]}) as r:
                body = b"".join([d async for d in r.aiter_bytes()])
                status = r.status_code
        srv.close()
        return status, body
    status, body = asyncio.run(main())
    assert status == (400 if framing == "length" else 200)
    assert body == b"".join(EVENTS)
    assert seen["head"].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer k\r\n" in seen["head"] and seen["body"] == b'{"x": [1, 2]}'
