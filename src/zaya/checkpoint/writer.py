"""DCP's file writer, checksumming each file's bytes as they are written.

A checkpoint's COMMIT marker records every file's checksum. Computing it by reading the files back after
``dcp.save`` is a second pass over every byte (a third of a save's time on a CPU box); here the checksum is updated
in the same thread, on the same buffers, as they go to the file. Where the stream is used in a way this cannot
follow (a seek, a write that the record does not account for), the file is simply read back: ``checksums()`` only
returns records whose byte count equals the file's size on disk.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from zaya.checkpoint.commit import FileRecord, new_checksum


class _ChecksummingStream(io.RawIOBase):
    """A write-only stream that feeds every written buffer to a checksum before passing it to the file."""

    def __init__(self, raw: Any, algorithm: str):
        super().__init__()
        self.raw = raw
        self.digest = new_checksum(algorithm)
        self.written = 0
        self.followable = True

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = self.raw.write(view)
        if n is None or n != len(view):
            self.followable = False  # a partial write: the bytes on disk are not (only) what was hashed
        else:
            self.digest.update(view)
            self.written += n
        return len(view) if n is None else n

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.followable = False
        return self.raw.seek(offset, whence)

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()
        super().close()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self, algorithm: str):
        super().__init__()
        self.algorithm = algorithm
        self.records: dict[str, FileRecord] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with path.open(mode) as raw:
            stream = _ChecksummingStream(raw, self.algorithm)
            yield stream
        if stream.followable:
            self.records[path.name] = FileRecord(stream.written, self.algorithm, stream.digest.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        record = self.records.pop(Path(path).name, None)
        if record is not None:
            self.records[Path(new_path).name] = record


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` that checksums (``algorithm``: crc32 or sha256) what it writes, per file name."""

    def __init__(self, path: str | os.PathLike, algorithm: str, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem(algorithm)

    def checksums(self, directory: Path) -> dict[str, FileRecord]:
        """Records of the files in ``directory`` whose size on disk equals the bytes checksummed."""
        out = {}
        for name, record in self.fs.records.items():
            file = directory / name
            if file.is_file() and file.stat().st_size == record.size:
                out[name] = record
        return out
