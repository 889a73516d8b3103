"""Hostile clients at the connection, on live `marft serve` and `marft ui` processes. A 256 MB chunked
body (no Content-Length) is refused with 413 while it streams in, never read whole: the server's peak
memory (VmHWM in /proc, reset before) grows by under 16 MB. Connections that send nothing, half their
headers, half their body, or their headers a byte at a time are closed after the read timeout (408
when part of a request had come); an idle keep-alive connection is closed; connections past
--limit-concurrency get 503 until the idle ones time out. The bounds below are the test's patience
on a loaded machine, not measurements."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time

import httpx
import pytest

from marft_bridge.serving.process import ServerProcess, free_port

KEY = "slow-key"
PATIENCE = 30.0  # seconds a socket waits for the server to close it (the timeouts here are 1-3 s)


def proc_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the kernel's peak-RSS reset: VmHWM starts again from VmRSS


def stream_chunked_until_answered(host: str, port: int, total: int, chunk: int = 1 << 20) -> tuple[bytes, int]:
    """POST a chunked body of ``total`` bytes, sending as long as the server reads and has not
    answered; returns (the answer, bytes of body sent)."""
    s = socket.create_connection((host, port), timeout=PATIENCE)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece, pending, sent = b"%x\r\n" % chunk + b" " * chunk + b"\r\n", b"", 0
    s.setblocking(False)
    try:
        while sent < total:
            readable, writable, _ = select.select([s], [s], [], PATIENCE)
            if readable:
                break  # the answer, or the close
            assert writable, "the server neither read the body nor answered"
            pending = pending or piece
            try:
                pending = pending[s.send(pending):]
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 0 if pending else chunk
        s.setblocking(True)
        s.settimeout(PATIENCE)
        return read_until_closed(s), sent
    finally:
        s.close()


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection; a socket.timeout (still open
    after PATIENCE) fails the test."""
    got = b""
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data


def stalled(port: int, sent: bytes) -> bytes:
    """Open a connection, send ``sent``, then nothing: what the server answers before closing it."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as s:
        if sent:
            s.sendall(sent)
        return read_until_closed(s)


POST_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
             + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
STALLS = {
    "nothing": (b"", b""),
    "half the headers": (POST_HEAD[:40], b"HTTP/1.1 408 "),
    "half a body": (POST_HEAD + b'{"model": "base", "mess', b"HTTP/1.1 408 "),
}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return tmp_path_factory.mktemp("slow") / "registry"


@pytest.fixture(scope="module")
def server(tiny_model_dir, registry):
    with ServerProcess(tiny_model_dir, registry, api_key=KEY, extra_args=["--threads", "1"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def impatient(tiny_model_dir, registry):
    with ServerProcess(tiny_model_dir, registry, api_key=KEY,
                       extra_args=["--threads", "1", "--header-timeout", "1", "--body-timeout", "1",
                                   "--keep-alive-timeout", "1"]) as srv:
        yield srv


def chat_works(server) -> bool:
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_a_huge_chunked_body_is_refused_as_it_streams_in(server):
    pid = server.proc.pid
    assert chat_works(server)  # everything a request touches is loaded before the baseline
    reset_peak(pid)
    rss_before = proc_kib(pid, "VmRSS")
    answer, sent = stream_chunked_until_answered(server.host, server.port, 256 << 20)
    growth_kib = proc_kib(pid, "VmHWM") - rss_before
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"request body exceeds 1048576 bytes" in answer and b"connection: close" in answer.lower()
    assert sent < 256 << 20  # the server stopped it part way
    assert growth_kib < 16 * 1024, f"peak memory grew by {growth_kib} KiB"
    assert chat_works(server)


@pytest.mark.parametrize("case", sorted(STALLS))
def test_a_stalled_connection_is_closed_after_the_read_timeout(impatient, case):
    sent, answer = STALLS[case]
    got = stalled(impatient.port, sent)
    assert got.startswith(answer) if answer else got == b"", got[:200]


def test_headers_sent_a_byte_at_a_time_do_not_extend_the_deadline(impatient):
    head = POST_HEAD[:-4] + b"".join(b"\r\nX-Pad-%d: x" % i for i in range(200)) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", impatient.port), timeout=PATIENCE) as s:
        for i in range(len(head)):
            if select.select([s], [], [], 0)[0]:
                break  # the server answered (or closed) before the headers were done
            try:
                s.send(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.02)  # ~50 bytes/s: the headers would take minutes
        assert i < len(head) - 1  # cut off part way
        assert read_until_closed(s).startswith(b"HTTP/1.1 408 ")


def test_an_idle_keep_alive_connection_is_closed_and_the_server_serves_on(impatient):
    with socket.create_connection(("127.0.0.1", impatient.port), timeout=PATIENCE) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = read_until_closed(s)  # the answer, then the close once the connection idles
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"ok"' in answer
    assert chat_works(impatient)


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    from marft_bridge.store import TraceStore

    tmp = tmp_path_factory.mktemp("ui")
    TraceStore.open(tmp / "traces.db").close()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "marft_bridge", "ui", "--store", str(tmp / "traces.db"),
                             "--registry", str(tmp / "registry"), "--port", str(port), "--header-timeout", "3",
                             "--body-timeout", "3", "--limit-concurrency", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "marft ui did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("case", ["nothing", "half the headers"])
def test_the_viewer_closes_stalled_connections(ui, case):
    sent, answer = STALLS[case]
    got = stalled(ui, sent.replace(b"POST /v1/chat/completions", b"GET /"))
    assert got.startswith(answer) if answer else got == b"", got[:200]


def test_the_viewer_sheds_connections_past_its_limit_until_the_idle_ones_time_out(ui):
    idle = [socket.create_connection(("127.0.0.1", ui), timeout=PATIENCE) for _ in range(3)]
    try:
        assert httpx.get(f"http://127.0.0.1:{ui}/", timeout=PATIENCE).status_code == 503
        for s in idle:
            assert read_until_closed(s) == b""  # closed by the header timeout
        assert httpx.get(f"http://127.0.0.1:{ui}/", timeout=PATIENCE).status_code == 200
    finally:
        for s in idle:
            s.close()


def test_the_read_deadlines_are_version_gated(monkeypatch, caplog):
    """The deadlines subclass uvicorn's h11 protocol: on a uvicorn outside the tested range the server
    runs uvicorn's own protocol and says so, rather than one that may fail on changed internals."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from marft_bridge.serving.http import limits as http_limits

    assert issubclass(http_limits.limited_h11_protocol(1.0, 1.0), H11Protocol)  # the installed one is supported
    assert [http_limits.uvicorn_supported(v) for v in ("0.29.9", "0.30.0", "0.54.0", "1.0.0", "dev")] == [
        False, True, True, False, False]
    monkeypatch.setattr(uvicorn, "__version__", "1.2.0")
    with caplog.at_level("WARNING", logger="marft_bridge.serving.http.limits"):
        assert http_limits.limited_h11_protocol(1.0, 1.0) == "h11"
    assert "uvicorn 1.2.0 is outside" in caplog.text and "without header/body read timeouts" in caplog.text
