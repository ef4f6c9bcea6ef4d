"""The engine's thread: ``EngineWorker`` owns an ``Engine`` and steps it while any request is queued or running.

HTTP handlers ``submit`` requests and are told of their progress through the ``notify`` callback they passed,
called on the worker thread after every step that changed the request and once when it finishes. The promise the
handlers rely on: **every request the worker takes is finished** (output, "error", or "abort" when the server stops)
and its ``notify`` called, whatever fails. A request the engine refuses or fails is finished with an error alone
(see ``zaya.serve.engine``); an exception that escapes a step (a bug) fails the requests the engine holds, and the
worker goes on serving new ones.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from zaya.serve.engine import Engine
from zaya.serve.request import Request

log = logging.getLogger("zaya.serve")


class EngineWorker:
    """Owns ``engine`` on a daemon thread. ``submit(request, notify)`` queues a request (checked again by the
    engine); ``abort(request)`` stops one; ``stop_requests()`` finishes every request held with finish reason
    "abort" and every later one at once (the server is stopping); ``close()`` also stops the thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._taken: dict[int, tuple[Request, Callable[[], None]]] = {}
        """Every request submitted and not yet finished, with its notify."""
        self._lock = threading.Lock()
        self._closed = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="zaya-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, notify: Callable[[], None]) -> None:
        with self._lock:
            if not self._closed:
                self._inbox.put(("submit", request, notify))
                self._wake.set()
                return
        _finish(request, "abort", "the server is stopping")
        _call(notify)

    def abort(self, request: Request) -> None:
        self._inbox.put(("abort", request, None))
        self._wake.set()

    def stop_requests(self) -> None:
        with self._lock:
            self._closed = True
        self._inbox.put(("stop", None, None))
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        self.stop_requests()
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout)

    # ------------------------------------------------------------------------------------------- the thread
    def _loop(self) -> None:
        try:
            while not self._stop:
                try:
                    self._turn()
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # noqa: BLE001 - a bug in a step (or a Rust panic in the tokenizer,
                    # which is a BaseException) must not take the server down
                    log.error("the engine step failed; failing the requests it held", exc_info=exc)
                    for request, _ in list(self._taken.values()):
                        self.engine.fail(request, "the engine step", exc)
                    self._notify_finished()
        finally:
            with self._lock:
                self._closed = True
            self._drain()
            self._abort_all()

    def _abort_all(self) -> None:
        for request, _ in list(self._taken.values()):
            self.engine.abort(request)
            _finish(request, "abort", "the server is stopping")
        self._notify_finished()

    def _turn(self) -> None:
        self._drain()
        self._notify_finished()
        if not self.engine.busy:
            self._wake.wait(0.5)
            self._wake.clear()
            return
        for request in self.engine.step():
            entry = self._taken.get(request.id)
            if entry is not None and not request.finished:
                _call(entry[1])
        self._notify_finished()

    def _drain(self) -> None:
        """Take the inbox: submissions the engine refuses are finished with their error at once."""
        while True:
            try:
                kind, request, notify = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(request)
                continue
            if kind == "stop":
                self._abort_all()
                continue
            self._taken[request.id] = (request, notify)
            if self._closed:
                continue  # finished by the loop's exit
            try:
                self.engine.submit(request)
            except Exception as exc:  # noqa: BLE001 - the handler checked it; a refusal fails it alone
                _finish(request, "error", f"the engine refused the request: {exc}")

    def _notify_finished(self) -> None:
        """Notify and forget every taken request that has finished."""
        for rid, (request, notify) in list(self._taken.items()):
            if request.finished:
                del self._taken[rid]
                _call(notify)


def _finish(request: Request, reason: str, error: str) -> None:
    if not request.finished:
        request.error = error
        request.finish_reason = reason


def _call(notify: Callable[[], None]) -> None:
    try:
        notify()
    except Exception as exc:  # noqa: BLE001 - a handler's callback (its event loop closed) must not stop the engine
        log.warning("a request's progress callback failed: %s", exc)
