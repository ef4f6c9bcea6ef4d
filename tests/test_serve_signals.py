"""``zaya serve`` as a process: SIGTERM and SIGINT stop it within a few seconds even while requests are running
(uvicorn waited for them: a 4000-token generation, or a request hung by a bad seed, kept it up); binding an address
other machines reach without an API key prints a warning; the key from $ZAYA_API_KEY and the limits' flags apply."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dist_helpers import free_port
from serve_helpers import post_json, served_checkpoint


@pytest.fixture(scope="module")
def checkpoint(shakespeare_dataset, tmp_path_factory):
    return served_checkpoint(tmp_path_factory.mktemp("serve-ckpt") / "tiny", shakespeare_dataset / "tokenizer.json",
                             max_seq_len=4096)


def _start(checkpoint, tmp_path, *extra: str, key: str = "") -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    env = dict(os.environ, ZAYA_API_KEY=key)
    proc = subprocess.Popen([sys.executable, "-m", "zaya", "serve", "--checkpoint", str(checkpoint), "--port",
                             str(port), "--slots", "2", "--device", "cpu", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        assert time.time() < deadline, "zaya serve did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            time.sleep(0.2)


@pytest.mark.parametrize("sig,host,key", [(signal.SIGTERM, "0.0.0.0", ""), (signal.SIGINT, "127.0.0.1", "k3y")])
def test_a_signal_stops_the_server_with_requests_in_flight(checkpoint, tmp_path, sig, host, key):
    proc, url, log = _start(checkpoint, tmp_path, "--shutdown-timeout", "1", "--host", host, "--max-prompts", "1",
                            key=key)
    try:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        if key:
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "a"}).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b"]}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"
        long = {"prompt": "ROMEO:", "max_tokens": 4000, "ignore_eos": True}
        streamed = []

        def stream():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=60,
                                  headers=headers) as r:
                    for line in r.iter_lines():
                        streamed.append(line)
            except httpx.HTTPError:
                pass

        def plain():
            try:
                post_json(f"{url}/v1/completions", long, key or None, timeout=60)
            except httpx.HTTPError:
                pass

        clients = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for c in clients:
            c.start()
        deadline = time.time() + 30
        while len(streamed) < 20:
            assert time.time() < deadline and proc.poll() is None, "the streaming request did not start"
            time.sleep(0.05)
        start = time.time()
        proc.send_signal(sig)
        proc.wait(timeout=30)
        took = time.time() - start
        for c in clients:
            c.join(10)
            assert not c.is_alive()
        log.seek(0)
        output = log.read()
        assert took < 6, f"{took:.1f} s to stop after {sig.name}\n{output}"
        assert "Traceback" not in output, output
        assert "endpoint=/v1/completions index=0" in output and "finish_reason=abort" in output, output  # logged
        warned = f"warning: serving on {host}, which other machines can reach, without an API key" in output
        assert warned == (host == "0.0.0.0"), output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_signal_stops_the_server_with_half_sent_bodies(checkpoint, tmp_path):
    """Clients that sent their headers and half a body (and one that sent nothing) do not hold the server past
    --shutdown-timeout: uvicorn waited for the rest of the bodies until its own timeout, 8.3 s for a 3 s one. The
    half-sent requests get a 503 saying why."""
    import socket

    proc, url, log = _start(checkpoint, tmp_path, "--shutdown-timeout", "1")
    port = int(url.rsplit(":", 1)[1])
    sockets = []
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 50\r\n\r\n{\"prompt\": ")
            sockets.append(s)
        sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))  # connected, nothing sent
        time.sleep(0.5)
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.time() - start
        log.seek(0)
        output = log.read()
        assert took < 1 + 1.5, f"{took:.1f} s to stop after SIGTERM with a 1 s shutdown timeout\n{output}"
        assert "Traceback" not in output, output
        for s in sockets[:2]:
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503") and b"the server is stopping" in answer, answer
    finally:
        for s in sockets:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
