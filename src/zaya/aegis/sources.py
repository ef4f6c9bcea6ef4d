"""What the supervisor watches besides heartbeats: log files (tailed from where they ended at launch), the kernel
log (``/dev/kmsg``, where this user may read it), the ranks' processes and the run directory's disk (psutil), and
the GPUs' uncorrectable ECC counters (NVML through ``pynvml``, or ``amd-smi``). Each optional source is skipped
cleanly, with a note saying why, when its tool or permission is missing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from zaya.aegis.detectors import Line
from zaya.aegis.heartbeat import rank_process


class LogTail:
    """New complete lines of a file since the last read; a file that appears later is read from its start."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
        self.partial = ""

    def read(self) -> list[Line]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:  # rotated or truncated
            self.offset = 0
        if size == self.offset:
            return []
        with open(self.path, "r", encoding="utf-8", errors="replace") as fh:
            fh.seek(self.offset)
            text = fh.read()
            self.offset = fh.tell()
        text, self.partial = self.partial + text, ""
        lines = text.split("\n")
        self.partial = lines.pop()
        now = time.time()
        return [Line(now, str(self.path), ln) for ln in lines if ln]


class KernelLog:
    """``/dev/kmsg`` from its current end; ``available`` is False (with ``why``) where it cannot be read."""

    def __init__(self, path: str = "/dev/kmsg"):
        self.fd, self.why = None, ""
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError as exc:
            if self.fd is not None:
                os.close(self.fd)
            self.fd, self.why = None, f"{path}: {exc.strerror or exc}"

    @property
    def available(self) -> bool:
        return self.fd is not None

    def read(self) -> list[Line]:
        out = []
        while self.fd is not None:
            try:
                record = os.read(self.fd, 8192).decode("utf-8", "replace")
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten records: carry on with the next
                    continue
                break  # EAGAIN: nothing more now
            if not record:
                break
            out.append(Line(time.time(), "kernel", record.split(";", 1)[-1].strip()))
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class GpuCounters:
    """Uncorrectable ECC counts per GPU; a rise becomes a line the GPU rule reads. NVML first, then amd-smi."""

    def __init__(self, every_s: float = 30.0):
        self.every_s, self.last_poll, self.counts = every_s, 0.0, {}
        self.kind, self.why = None, ""
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            self.nvml, self.kind = pynvml, "NVML"
        except Exception as exc:  # noqa: BLE001 - optional: no package, no driver
            self.why = f"NVML unavailable ({type(exc).__name__})"
            if shutil.which("amd-smi"):
                self.kind = "amd-smi"
            else:
                self.why += "; amd-smi not found"

    def read(self) -> list[Line]:
        now = time.time()
        if self.kind is None or now - self.last_poll < self.every_s:
            return []
        self.last_poll = now
        try:
            counts = self._nvml() if self.kind == "NVML" else self._amd()
        except Exception:  # noqa: BLE001 - a failing query is no evidence of a fault
            return []
        out = []
        for device, n in counts.items():
            if n > self.counts.get(device, n):
                out.append(Line(now, self.kind, f"aegis: {self.kind} uncorrectable ECC count of GPU {device} rose "
                                               f"to {n}"))
            self.counts[device] = n
        return out

    def _nvml(self) -> dict[str, int]:
        nv, out = self.nvml, {}
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            bus = nv.nvmlDeviceGetPciInfo(h).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            out[bus] = int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                          nv.NVML_VOLATILE_ECC))
        return out

    def _amd(self) -> dict[str, int]:
        done = subprocess.run(["amd-smi", "metric", "--ecc", "--json"], capture_output=True, text=True, timeout=20)
        out = {}
        for i, gpu in enumerate(json.loads(done.stdout or "[]")):
            ecc = gpu.get("ecc", {}) if isinstance(gpu, dict) else {}
            n = ecc.get("total_uncorrectable_count", 0)
            out[str(gpu.get("bdf", gpu.get("gpu", i)))] = int(n if isinstance(n, (int, float)) else 0)
        return out


def process_status(beats: dict[int, dict[str, Any]]) -> dict[int, str]:
    """psutil status of each rank on this host, by its heartbeat ("gone" when its pid no longer is that rank:
    ``heartbeat.rank_process``); ranks on other hosts are left out."""
    out = {}
    for rank, hb in beats.items():
        if hb.get("host") != socket.gethostname():
            continue
        proc, _ = rank_process(hb)
        try:
            out[rank] = proc.status() if proc is not None else "gone"
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            out[rank] = "gone"
    return out


def disk_free_mb(path: str | Path) -> float | None:
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return psutil.disk_usage(str(probe)).free / 2**20
    except OSError:
        return None
