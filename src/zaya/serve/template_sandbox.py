"""Rendering a chat template that came with a checkpoint, which zaya does not trust.

Two bounds, because a template is code:

- **What it may do**: Jinja's immutable sandbox (``jinja2.sandbox.ImmutableSandboxedEnvironment``, as Hugging Face
  transformers renders chat templates): no attribute that starts with ``_`` (so no ``__globals__``,
  ``__subclasses__``, ``__import__``), no method that changes a list or dict, ``str.format`` checked. What real chat
  templates use is there: ``trim_blocks`` / ``lstrip_blocks``, the loop controls (``break``, ``continue``),
  ``namespace``, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception(message)`` (a template refusing
  the messages, e.g. roles that do not alternate) and ``strftime_now(format)``.
- **What it may cost**: it renders in a child process (``python -m zaya.serve.template_sandbox``) with an address
  space limit, a wall-clock alarm per render and a limit on the rendered text; the parent (``TemplateProcess``)
  kills and restarts a child that does not answer in time. A template with a loop of 10**10 empty iterations, or
  one that doubles a string forty times, fails that request and nothing else.

The child reads one JSON line with the template, then one JSON line per render (the template's variables) and
answers each with one JSON line: ``{"text": ...}`` or ``{"error": kind, "message": ...}``, where kind is
``refused`` (``raise_exception``), ``unsafe`` (the sandbox stopped it), ``timeout``, ``too_large``, ``memory`` or
``failed`` (any other error in the template).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

MAX_MEMORY = 1 << 30
"""The child's address space limit (bytes): a template that builds a huge string gets a MemoryError there."""


class TemplateRefused(Exception):
    """Raised by ``raise_exception(message)`` inside a template."""


class RenderError(Exception):
    """A render that failed: ``kind`` as in the module docstring, ``message`` what the template or the bound said."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def environment():
    """The sandboxed Jinja environment chat templates render in."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateRefused(str(message))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson  # Jinja's own escapes HTML characters, which a prompt must not get
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def compile_template(source: str):
    """The compiled template (parsing runs nothing); ``jinja2.TemplateSyntaxError`` for a malformed one."""
    return environment().from_string(source)


def render(template, variables: dict, max_chars: int) -> str:
    """Render, stopping as soon as the text passes ``max_chars`` (``RenderError("too_large")``)."""
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece)
        if size > max_chars:
            raise RenderError("too_large", f"the rendered prompt passed {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


# ----------------------------------------------------------------------------------------------- the child
class _Alarm(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Alarm()


def _render_one(template, request: dict) -> dict:
    from jinja2.exceptions import SecurityError

    signal.setitimer(signal.ITIMER_REAL, request["timeout"])
    try:
        return {"text": render(template, request["variables"], request["max_chars"])}
    except _Alarm:
        return {"error": "timeout", "message": f"rendering took longer than {request['timeout']:g} s"}
    except TemplateRefused as exc:
        return {"error": "refused", "message": exc.args[0] if exc.args else "raise_exception was called"}
    except SecurityError as exc:
        return {"error": "unsafe", "message": f"the sandbox refused an operation: {exc}"}
    except RenderError as exc:
        return {"error": exc.kind, "message": exc.message}
    except MemoryError:
        return {"error": "memory", "message": f"rendering needed more than {MAX_MEMORY >> 20} MiB"}
    except RecursionError:
        return {"error": "failed", "message": "the template recursed too deeply"}
    except Exception as exc:  # noqa: BLE001 - whatever the template did wrong is this render's answer
        return {"error": "failed", "message": f"{type(exc).__name__}: {exc}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    """The child: limit the address space, compile the template, answer renders until stdin closes."""
    import resource

    limit = int(sys.argv[1]) if len(sys.argv) > 1 else MAX_MEMORY
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the parent's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    template = compile_template(json.loads(stdin.readline())["template"])
    for line in stdin:
        try:
            reply = _render_one(template, json.loads(line))
        except _Alarm:  # fired between the render's end and the timer's reset
            reply = {"error": "timeout", "message": "rendering took too long"}
        stdout.write(json.dumps(reply, ensure_ascii=True).encode() + b"\n")
        stdout.flush()


# ----------------------------------------------------------------------------------------------- the parent
class TemplateProcess:
    """Renders one template in a child process, one render at a time (thread-safe). ``render`` raises
    ``RenderError``; a child that does not answer within ``timeout`` (plus a second for the pipe) is killed and a
    new one started for the next render."""

    def __init__(self, source: str, timeout: float, max_chars: int, max_memory: int = MAX_MEMORY) -> None:
        self.source, self.timeout, self.max_chars, self.max_memory = source, timeout, max_chars, max_memory
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def _start(self) -> subprocess.Popen:
        import zaya

        root = os.path.dirname(os.path.dirname(os.path.abspath(zaya.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.Popen([sys.executable, "-m", "zaya.serve.template_sandbox", str(self.max_memory)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        proc.stdin.write(json.dumps({"template": self.source}).encode() + b"\n")
        proc.stdin.flush()
        self._buffer = b""
        return proc

    def render(self, variables: dict) -> str:
        line = json.dumps({"variables": variables, "timeout": self.timeout, "max_chars": self.max_chars},
                          ensure_ascii=True).encode() + b"\n"
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            try:
                self._proc.stdin.write(line)
                self._proc.stdin.flush()
                reply = self._read_line(time.monotonic() + self.timeout + 1.0)
            except OSError:  # the child died (a broken pipe)
                reply = None
            if reply is None:
                self._kill()
                raise RenderError("timeout", f"the template process gave no answer within {self.timeout:g} s "
                                             "(killed; a new one renders the next request)")
        answer = json.loads(reply)
        if "error" in answer:
            raise RenderError(answer["error"], answer["message"])
        return answer["text"]

    def _read_line(self, deadline: float) -> bytes | None:
        """The child's next line, or None when it dies or the deadline passes."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()


if __name__ == "__main__":
    main()
