"""Process lifecycle and hardening: with the engine reached over tcp://, the API answers 503 once the engine
died, then exits. (API death stopping the engine: end of test_server_chat.py; SIGTERM: the
teardown of test_server.py.)"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import REPO, STORIES_TEXT, Server, free_port


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_engine_death_gives_503_then_api_exits():
    s = Server("--engine-address", f"tcp://127.0.0.1:{free_port()}")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon a time",
                                                        "max_tokens": 8, "temperature": 0})
        assert STORIES_TEXT.startswith(r.json()["choices"][0]["text"])
        (api,) = s.children()
        s.proc.kill()  # SIGKILL: no goodbye from the engine
        s.proc.wait()
        assert wait_for(lambda: httpx.get(s.url + "/health").status_code == 503, 10)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]

        def gone():
            try:
                return open(f"/proc/{api}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True
        assert wait_for(gone, 30)  # the orphaned API process does not linger
    finally:
        s.stop()


# ---- the API app in-process: uvicorn in a thread, stories' tokenizer, an engine client without
# an engine (nothing that reaches the engine is awaited here) ------------------------------------
STORIES = REPO / "models" / "default" / "stories260K"


class InProcess:
    def __init__(self, **args):
        import uvicorn
        from rankserve.runtime.inputs import load_tokenizer
        from rankserve.runtime.serve.app import build_app, uvicorn_config
        from rankserve.runtime.serve.args import ServerArgs
        from rankserve.runtime.serve.client import EngineClient
        from rankserve.runtime.serve.context import ServeContext
        from rankserve.runtime.serve.metrics import Metrics
        tok = load_tokenizer(str(STORIES))
        client = EngineClient("ipc://unused", tok, [2], Metrics("m"))
        client._send = lambda kind, payload: None
        client.model_info = {"max_model_len": 512, "vocab_size": 512}
        self.ctx = ServeContext(ServerArgs(**args), "m", str(STORIES), tok, client)
        self.port = free_port()
        self.url = f"{'https' if args.get('ssl_certfile') else 'http'}://127.0.0.1:{self.port}"
        self.ctx.args.port = self.port
        self.server = uvicorn.Server(uvicorn_config(build_app(self.ctx, Metrics("m")),
                                                    self.ctx.args, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, 20)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def inproc(request):
    apps = []

    def make(**args):
        apps.append(InProcess(**args))
        return apps[-1]
    yield make
    for a in apps:
        a.close()


def raw_exchange(port: int, requests: list[bytes]) -> list[tuple[int, dict, bytes]]:
    """Send HTTP/1.1 requests one after another on ONE connection; (status, headers, body) each."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        f = s.makefile("rb")
        for req in requests:
            s.sendall(req)
            status = int(f.readline().split()[1])
            headers = {}
            while (line := f.readline().strip()):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            out.append((status, headers, f.read(int(headers.get("content-length", 0)))))
    return out


def http_req(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n").encode() + body


def test_unexpected_exception_is_json_in_the_routes_format_and_keeps_the_connection(
        inproc, monkeypatch):
    from rankserve.runtime.serve import anthropic_api, openai_api

    def boom(*a, **k):
        raise RuntimeError("boom \ud800")  # even a message that cannot be UTF-8 encoded
    monkeypatch.setattr(openai_api, "detokenize", boom)
    monkeypatch.setattr(anthropic_api, "count_tokens", boom)
    app = inproc()
    (s1, h1, b1), (s2, _, _), (s3, _, b3), (s4, _, _) = raw_exchange(app.port, [
        http_req("POST", "/detokenize", b'{"tokens": [1, 2]}'),
        http_req("GET", "/health"),
        http_req("POST", "/v1/messages/count_tokens", b'{"model": "m", "messages": [{"role": "user", '
                 b'"content": "hi"}]}'),
        http_req("GET", "/version")])
    assert s1 == 500 and json.loads(b1)["error"]["type"] == "server_error"
    assert "boom" in json.loads(b1)["error"]["message"]
    assert h1.get("connection") != "close"
    assert s2 == 200  # the same connection, still usable
    assert s3 == 500 and json.loads(b3)["type"] == "error"  # Anthropic's format on /v1/messages
    assert json.loads(b3)["error"]["type"] == "server_error"
    assert s4 == 200
    r = httpx.post(app.url + "/v1/completions", content=b'{"prompt": "x", "model": "\\ud800"}',
                   headers={"Content-Type": "application/json"})
    # a lone surrogate anywhere in the body is bad input (400), and the error body still encodes
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"].lower()


def test_api_key_guards_every_compute_and_state_route(inproc):
    app = inproc(api_key="k3y")
    for method, path, body in [("POST", "/reset_prefix_cache", None),
                               ("POST", "/tokenize", {"prompt": "hi"}),
                               ("POST", "/detokenize", {"tokens": [1]}),
                               ("POST", "/v1/completions/render", {"prompt": "hi"}),
                               ("POST", "/v1/chat/completions/derender", {"token_ids": [1]}),
                               ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("GET", "/v1/models", None), ("GET", "/openapi.json", None),
                               # sleep mode and weight updates (admin)
                               ("POST", "/sleep", None), ("POST", "/wake_up", None),
                               ("GET", "/is_sleeping", None),
                               ("POST", "/update_weights_from_disk", {"model_path": "/m"}),
                               ("POST", "/init_weights_update_group", {}),
                               ("POST", "/update_weights_from_distributed", {}),
                               ("POST", "/destroy_weights_update_group", {}),
                               ("GET", "/nope", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "k3y-"}):
            r = httpx.request(method, app.url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(app.url + "/v1/messages", json={}, headers={"x-api-key": "bad"})
    assert r.status_code == 401 and r.json()["type"] == "error"  # Anthropic's format
    for path in ("/health", "/version", "/metrics"):  # open, documented in the README
        assert httpx.get(app.url + path).status_code == 200
    for headers in ({"Authorization": "Bearer k3y"}, {"x-api-key": "k3y"}):
        r = httpx.post(app.url + "/tokenize", json={"prompt": "Once"}, headers=headers)
        assert r.status_code == 200 and r.json()["tokens"]


def test_api_key_sources(tmp_path):
    from rankserve.runtime.serve.args import ServerArgs
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert ServerArgs(api_key="cli", api_key_file=str(f)).resolve_api_key({}).api_key == "cli"
    assert ServerArgs(api_key_file=str(f)).resolve_api_key(
        {"RANKSERVE_API_KEY": "env"}).api_key == "from-file"
    assert ServerArgs().resolve_api_key({"RANKSERVE_API_KEY": "env", "VLLM_API_KEY": "v"}
                                        ).api_key == "env"
    assert ServerArgs().resolve_api_key({"VLLM_API_KEY": "v"}).api_key == "v"
    assert ServerArgs().resolve_api_key({"VLLM_API_KEY": ""}).api_key is None
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ValueError, match="--api-key-file"):
            ServerArgs(api_key_file=str(path)).resolve_api_key({})


def test_body_limit_413_in_the_routes_format(inproc):
    app = inproc(max_request_body_bytes=1000)
    big = {"prompt": "x" * 2000}
    r = httpx.post(app.url + "/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(app.url + "/v1/messages", json={"messages": [{"role": "user",
                                                                  "content": "x" * 2000}]})
    assert r.status_code == 413 and r.json()["type"] == "error"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 200
    r = httpx.post(app.url + "/tokenize", content=chunks())
    assert r.status_code == 413
    assert httpx.post(app.url + "/tokenize", json={"prompt": "Once"}).status_code == 200


def test_too_long_prompt_refused_before_tokenizing(inproc, monkeypatch):
    app = inproc()
    calls = []
    render = app.ctx.renderer.render_completion
    monkeypatch.setattr(app.ctx.renderer, "render_completion",
                        lambda p: calls.append(p) or render(p))
    limit = app.ctx.max_prompt_chars
    assert limit and limit < 100_000
    for path, body in [("/v1/completions", {"prompt": "a " * limit}),
                       ("/tokenize", {"prompt": "a " * limit}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "a " * limit}]}),
                       ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
                           {"role": "user", "content": "a " * limit}]})]:
        t = time.monotonic()
        r = httpx.post(app.url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert "too long" in r.text and time.monotonic() - t < 5
    assert not calls


def test_tokenization_runs_off_the_event_loop(inproc, monkeypatch):
    from rankserve.runtime.serve import openai_api
    app = inproc()

    def slow(p):
        time.sleep(1.5)
        return [1, 2, 3]
    monkeypatch.setattr(app.ctx.renderer, "render_completion", slow)
    slow_tokenize = openai_api.tokenize

    def tokenize(ctx, req):
        time.sleep(1.5)
        return slow_tokenize(ctx, req)
    monkeypatch.setattr(openai_api, "tokenize", tokenize)
    threads = [threading.Thread(target=lambda: httpx.post(app.url + "/tokenize",
                                                          json={"prompt": "Once"}, timeout=10)),
               threading.Thread(target=lambda: httpx.post(
                   app.url + "/v1/completions", json={"prompt": "Once", "stream": True},
                   timeout=3).status_code if False else _ignore(lambda: httpx.post(
                       app.url + "/v1/completions", json={"prompt": "Once"}, timeout=3)))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    worst = 0.0
    for _ in range(5):  # both slow steps are running now
        t = time.monotonic()
        assert httpx.get(app.url + "/health", timeout=5).status_code == 200
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.1)
    assert worst < 0.5, worst
    for t in threads:
        t.join()


def _ignore(fn):
    try:
        fn()
    except httpx.HTTPError:
        pass


# ---- SIGTERM: drain, then end what is left with an error --------------------------------------
def _sse_stream(url: str, body: dict, out: dict) -> None:
    """Read a streamed completion; out: events (parsed), times, status."""
    out["events"], out["times"] = [], []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    out["events"].append(data if data == "[DONE]" else json.loads(data))
                    out["times"].append(time.monotonic())
    except httpx.HTTPError as e:
        out["exc"] = repr(e)


def test_sigterm_drains_then_ends_the_rest_with_errors():
    grace = 3.0
    s = Server("--shutdown-timeout", str(grace), "--max-num-seqs", "2")
    long = {"prompt": "Once", "max_tokens": 500, "ignore_eos": True, "n": 16}  # ≫ grace
    short, streamed, plain = {}, {}, {}

    def post_plain():
        r = httpx.post(s.url + "/v1/completions", json=long, timeout=60)
        plain.update(status=r.status_code, body=r.json(), t=time.monotonic())
    threads = [threading.Thread(target=_sse_stream, args=(s.url, {"prompt": "Once upon a time",
                                "max_tokens": 60, "ignore_eos": True}, short)),
               threading.Thread(target=_sse_stream, args=(s.url, long, streamed)),
               threading.Thread(target=post_plain)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.2)
        assert wait_for(lambda: short.get("events") and streamed.get("events"), 30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the engine passes it on to the API process
        assert wait_for(lambda: httpx.post(s.url + "/v1/completions", json={
            "prompt": "Once", "max_tokens": 2}).status_code == 503, 5)  # no new work
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        assert "shutting down" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        for t in threads:
            t.join(30)
        # in flight and short: finished normally within the grace period
        assert short["events"][-1] == "[DONE]"
        assert short["events"][-2]["choices"][0]["finish_reason"] == "length"
        # too long: an error event, then [DONE], once the grace period is over
        assert streamed["events"][-1] == "[DONE]", streamed
        err = streamed["events"][-2]["error"]
        assert err["type"] == "service_unavailable" and "shutting down" in err["message"]
        assert grace - 0.5 < streamed["times"][-1] - t0 < grace + 4
        assert plain["status"] == 503 and "shutting down" in plain["body"]["error"]["message"]
        assert s.proc.wait(15) == 0
        assert time.monotonic() - t0 < grace + 8
        assert not list(Path(tempfile.gettempdir()).glob(f"rankserve-{s.proc.pid}-*"))
    finally:
        s.stop()
        for t in threads:
            t.join(5)


def test_stale_ipc_sockets_are_removed(tmp_path):
    from rankserve.runtime.serve.engine_proc import remove_stale_sockets
    dead = subprocess.Popen(["true"])
    dead.wait()

    def sock(name):
        with socket.socket(socket.AF_UNIX) as u:
            u.bind(str(tmp_path / name))  # the file outlives the socket, as after a crash
        return tmp_path / name
    stale = sock(f"rankserve-{dead.pid}-0123abcd")
    live = sock(f"rankserve-{os.getpid()}-0123abcd")
    other = sock("unrelated-1-x")
    plain = tmp_path / f"rankserve-{dead.pid}-notasocket"
    plain.write_text("")
    assert remove_stale_sockets(str(tmp_path)) == [str(stale)]
    assert live.exists() and other.exists() and plain.exists() and not stale.exists()


def test_port_in_use_is_refused_before_the_model_loads(monkeypatch):
    """`serve --port P` with P taken: a clear error naming --port, before any weight loads (on
    a cluster that can be minutes), not uvicorn's bind error after the engine started."""
    from click.testing import CliRunner
    from rankserve.launch.cli import main
    from rankserve.runtime import executor

    def no_engine(*a, **kw):
        raise AssertionError("the engine started before the port was checked")
    monkeypatch.setattr(executor, "UniprocExecutor", no_engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", "--port", str(port)])
    assert r.exit_code == 2, r.output + repr(r.exception)
    assert f"--port {port}" in r.output and "in use" in r.output, r.output


def test_cors_as_vllm(inproc):
    """Browsers may call the API: any origin by default (vLLM's default), only the listed ones
    with --allowed-origins; a preflight names the allowed methods."""
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    a = inproc()
    r = httpx.options(a.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.get(a.url + "/v1/models", headers={"Origin": "http://ui.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    b = inproc(allowed_origins='["http://ok.example"]', allowed_methods='["POST"]')
    r = httpx.options(b.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.options(b.url + "/v1/chat/completions", headers=dict(pre, Origin="http://ok.example"))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    assert "POST" in r.headers["access-control-allow-methods"]


def test_root_path_and_tls(inproc, tmp_path):
    """--root-path: the app behind a proxy that strips the prefix (its OpenAPI document names
    it); --ssl-keyfile / --ssl-certfile: HTTPS."""
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    a = inproc(root_path="/llm", ssl_keyfile=str(key), ssl_certfile=str(cert))
    assert a.url.startswith("https://")
    r = httpx.get(a.url + "/v1/models", verify=False)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
    r = httpx.get(a.url + "/openapi.json", verify=False)
    assert r.json()["servers"] == [{"url": "/llm"}]
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
        httpx.get(a.url.replace("https", "http") + "/v1/models", timeout=5)


@pytest.mark.parametrize("kw, msg", [
    (dict(allowed_origins="*"), "--allowed-origins must be a JSON list"),
    (dict(allowed_headers='["a", 1]'), "--allowed-headers must be a JSON list"),
    (dict(root_path="llm"), "--root-path must start with /"),
    (dict(ssl_keyfile="/nonexistent"), "--ssl-keyfile and --ssl-certfile go together"),
    (dict(ssl_keyfile="/nonexistent", ssl_certfile="/nonexistent"), "--ssl-keyfile /nonexistent: no such file"),
])
def test_cors_proxy_and_tls_flags_are_checked(kw, msg):
    from rankserve.runtime.serve.args import ServerArgs
    with pytest.raises(ValueError, match=msg):
        ServerArgs(**kw).validate()


def test_request_logging_as_vllm():
    """--enable-log-requests: each request is logged when it arrives (id, prompt cut to
    --max-log-len characters, token count, sampling parameters) and when it finishes; without it
    nothing is logged per request (vLLM's default; its older --disable-log-requests says so)."""
    prompt = "Once upon a time, " + STORIES_TEXT
    s = Server("--enable-log-requests", "--max-log-len", "12", "--max-model-len", "256")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5,
                                                        "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert wait_for(lambda: any("Finished request" in line for line in s.lines), 10), s.lines[-20:]
    finally:
        s.stop()
    [got] = [line for line in s.lines if "Received request" in line]
    import ast
    import re
    shown = ast.literal_eval(re.search(r"prompt: ('.*?'), prompt_tokens", got).group(1))
    assert len(shown) == 12 and "Once upo" in shown, got  # what the model reads: BOS first
    assert "prompt_tokens=" in got and "max_tokens=5" in got and "temperature=0" in got, got
    [done] = [line for line in s.lines if "Finished request" in line]
    assert "finish_reason=length" in done and "generated_tokens=5" in done, done


@pytest.mark.parametrize("args, msg", [
    (["--enable-log-requests", "--disable-log-requests"], "--enable-log-requests and --disable-log-requests"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0"),
    (["--api-server-count", "2"], "--api-server-count 2"),
])
def test_request_log_flags_are_checked(args, msg):
    from click.testing import CliRunner
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["serve", *args])
    assert r.exit_code == 2 and msg in r.output, r.output + repr(r.exception)


def test_no_request_log_by_default(inproc, caplog):
    a = inproc(disable_log_requests=True)  # vLLM's older flag: the default, accepted
    with caplog.at_level("INFO", logger="rankserve.serve"):
        try:  # the fake engine never answers
            httpx.post(a.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=2)
        except httpx.TimeoutException:
            pass
    assert not [r for r in caplog.records if "request" in r.getMessage().lower()]
