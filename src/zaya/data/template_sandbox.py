"""Rendering a chat template that came with a checkpoint, which zaya does not trust.

Two bounds, because a template is code:

- **What it may do**: Jinja's immutable sandbox (``jinja2.sandbox.ImmutableSandboxedEnvironment``, as Hugging Face
  transformers renders chat templates): no attribute that starts with ``_`` (so no ``__globals__``,
  ``__subclasses__``, ``__import__``; naming one is an error at once, also through ``map(attribute=...)`` or
  ``selectattr``), no method that changes a list or dict, ``str.format`` checked. What real chat
  templates use is there: ``trim_blocks`` / ``lstrip_blocks``, the loop controls (``break``, ``continue``),
  ``namespace``, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception(message)`` (a template refusing
  the messages, e.g. roles that do not alternate) and ``strftime_now(format)``.
- **What it may cost**: it is compiled and rendered only in a child process (this file run as a script) with an
  address space limit, a wall-clock alarm per compile and per render and a limit on the rendered text; the parent (``TemplateProcess``) never compiles it, and kills and restarts a child
  that does not answer in time. A template with a loop of 10**10 empty iterations, or one that doubles a string
  forty times, fails that request and nothing else.
- **Nothing runs while compiling**: Jinja evaluates constant expressions when it compiles a template (its optimizer,
  and the output of ``{{ ... }}`` whose operands are literals), so ``{{ 'x' * 10000000000 }}`` allocated 10 GB and
  ``{{ 'x'|center(500000000) }}`` took 9 s and 1.9 GB while compiling. The environment compiles without the
  optimizer and with a ``finalize`` that needs the render's context, which Jinja cannot fold; every expression is
  then evaluated when rendering, inside the bounds.

The child reads one JSON line with the template and the compile timeout and answers ``{"compiled": true}`` or
``{"error": kind, "message": ..., "line": n}`` (kind ``syntax`` for a template that does not parse, after which the
child exits); then one JSON line per render (the template's variables), each answered with one JSON line:
``{"text": ...}`` or ``{"error": kind, "message": ...}``, where kind is ``refused`` (``raise_exception``),
``unsafe`` (the sandbox stopped it), ``timeout``, ``too_large``, ``memory`` or ``failed`` (any other error in the
template).
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
STARTUP_S = 10.0
"""Seconds a new child may take to start (an interpreter, Jinja) on top of the compile timeout."""


class TemplateRefused(Exception):
    """Raised by ``raise_exception(message)`` inside a template."""


class RenderError(Exception):
    """A compile or render that failed: ``kind`` as in the module docstring, ``message`` what the template or the
    bound said, ``line`` the template's line of a syntax error (when known)."""

    def __init__(self, kind: str, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.line = kind, message, line


def environment():
    """The sandboxed Jinja environment chat templates render in."""
    import jinja2.ext
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    def raise_exception(message):
        raise TemplateRefused(str(message))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    @jinja2.pass_context
    def finalize(context, value):  # needs the context, so Jinja cannot fold {{ <literal expression> }} when compiling
        return value

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj, attribute):
            """Refuse an unsafe attribute when it is named (Jinja's own gives an undefined value, which
            ``map(attribute='__class__')`` or ``selectattr`` print as nothing instead of failing)."""
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    class SafeNamespace(Namespace):
        def __setitem__(self, name, value):  # {% set ns.__class__ = ... %} set a key Jinja never refused
            if name.startswith("_"):
                raise SecurityError(f"setting the attribute {name!r} of a namespace is unsafe")
            super().__setitem__(name, value)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], optimized=False,
                  finalize=finalize)
    env.globals["namespace"] = SafeNamespace
    env.filters["tojson"] = tojson  # Jinja's own escapes HTML characters, which a prompt must not get
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def compile_template(source: str):
    """The compiled template (evaluating none of its expressions, see the module docstring);
    ``jinja2.TemplateSyntaxError`` for a malformed one. Called in the child only."""
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


def _compile_one(source: str, timeout: float):
    """(the compiled template or None, the reply to the parent)."""
    from jinja2 import TemplateSyntaxError

    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return compile_template(source), {"compiled": True}
    except TemplateSyntaxError as exc:  # TemplateAssertionError too (an unknown filter, a block defined twice)
        return None, {"error": "syntax", "message": f"{type(exc).__name__}: {exc.message}", "line": exc.lineno}
    except RecursionError:
        return None, {"error": "syntax", "message": "the template nests too deeply to parse"}
    except _Alarm:
        return None, {"error": "timeout", "message": f"compiling the template took longer than {timeout:g} s"}
    except MemoryError:
        return None, {"error": "memory", "message": "compiling the template ran out of memory"}
    except Exception as exc:  # noqa: BLE001 - whatever else the compiler raised is this template's answer
        return None, {"error": "failed", "message": f"compiling the template: {type(exc).__name__}: {exc}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    """The child: limit the address space, compile the template (answering whether it compiled; exiting when it did
    not), answer renders until stdin closes."""
    import resource

    limit = int(sys.argv[1]) if len(sys.argv) > 1 else MAX_MEMORY
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the parent's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def answer(reply: dict) -> None:
        stdout.write(json.dumps(reply, ensure_ascii=True).encode() + b"\n")
        stdout.flush()

    first = json.loads(stdin.readline())
    try:
        template, reply = _compile_one(first["template"], first["timeout"])
    except _Alarm:  # fired between the compile's end and the timer's reset
        template, reply = None, {"error": "timeout", "message": "compiling the template took too long"}
    answer(reply)
    if template is None:
        return
    for line in stdin:
        try:
            reply = _render_one(template, json.loads(line))
        except _Alarm:  # fired between the render's end and the timer's reset
            reply = {"error": "timeout", "message": "rendering took too long"}
        answer(reply)


# ----------------------------------------------------------------------------------------------- the parent
class TemplateProcess:
    """Compiles and renders one template in a child process, one render at a time (thread-safe). ``check`` starts
    the child and compiles the template; ``render`` (starting a child when there is none) raises ``RenderError``. A
    child that does not answer within ``timeout`` (plus a second for the pipe; plus ``STARTUP_S`` while it starts)
    is killed and a new one started for the next render."""

    def __init__(self, source: str, timeout: float, max_chars: int, max_memory: int = MAX_MEMORY) -> None:
        self.source, self.timeout, self.max_chars, self.max_memory = source, timeout, max_chars, max_memory
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def check(self) -> None:
        """Start a child and compile the template in it: ``RenderError`` when it does not compile (kind ``syntax``:
        it does not parse, with ``line``; ``timeout`` or ``memory``: the compile passed the bounds)."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        """A live child that compiled the template: the one there is, or a new one."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._kill()
        # This file as a script, isolated (-I: neither its directory nor PYTHONPATH on the path): it needs only the
        # standard library and Jinja, and importing the zaya.data package would bring numpy's 120 MB of address
        # space into the child's limit.
        self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(self.max_memory)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer = b""
        wait = STARTUP_S + self.timeout
        answer = self._ask({"template": self.source, "timeout": self.timeout}, wait,
                           f"did not compile the template within {wait:g} s (killed; a new one tries again for the "
                           "next request)")
        if "error" in answer:
            self._kill()
            raise RenderError(answer["error"], answer["message"], answer.get("line"))

    def render(self, variables: dict) -> str:
        with self._lock:
            self._ensure()
            answer = self._ask({"variables": variables, "timeout": self.timeout, "max_chars": self.max_chars},
                               self.timeout + 1.0, f"gave no answer within {self.timeout:g} s (killed; a new one "
                                                   "renders the next request)")
        if "error" in answer:
            raise RenderError(answer["error"], answer["message"])
        return answer["text"]

    def _ask(self, request: dict, wait: float, silence: str) -> dict:
        """Send the child one line and read its answer; a child that dies or does not answer within ``wait``
        seconds is killed (``RenderError("timeout", "the template process " + silence)``)."""
        try:
            self._proc.stdin.write(json.dumps(request, ensure_ascii=True).encode() + b"\n")
            self._proc.stdin.flush()
            reply = self._read_line(time.monotonic() + wait)
        except OSError:  # the child died (a broken pipe)
            reply = None
        if reply is None:
            self._kill()
            raise RenderError("timeout", f"the template process {silence}")
        return json.loads(reply)

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
