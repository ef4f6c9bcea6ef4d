"""The allow-list unpickler for DCP's ``.metadata``: builds a checkpoint's metadata from a pickle and nothing else.

torch writes ``.metadata`` with ``pickle.dump``; ``pickle.load`` would run whatever a crafted file asks for. This
unpickler is the standard library's pure-Python one (``pickle._Unpickler``), whose instructions can be replaced one
by one (the C unpickler's cannot), with every instruction it keeps checked so that reading any file takes time
linear in its size and memory a small multiple of it (measured: at most ~75 bytes per byte read, against ~20 for a
real metadata), and changes nothing outside the objects it builds:

- **Instructions**: only those pickle protocols 2 to 5 write for DCP's metadata (measured on real DDP, ZeRO-1 and
  FSDP2 saves): no sets or frozensets, no bytes, buffers, persistent ids or extension codes, no text-form ints or
  memo indices (a memo index is at most 2**32, so no two collide in the memo's hash table), no ``INST``/``OBJ``/
  ``NEWOBJ_EX``. Any other is refused by name.
- **Names** (``GLOBAL``, ``STACK_GLOBAL``): DCP's metadata dataclasses, ``torch.Size``, the memory-format enum, the
  torch dtypes, the layout lookup (answered by a lookup of zaya's own, which caches nothing) and the path classes of
  ``checkpoint_id``.
- **Calls** (``REDUCE``): only ``torch.Size`` (one sequence of at most ``MAX_DIMS`` ints in [0, 2**62)), the enum
  (one int), the layout lookup (one short str) and the path classes (strs), their arguments checked before the call.
  ``NEWOBJ`` only creates an instance of a metadata dataclass, with no arguments.
- **State** (``BUILD``): only on an instance this unpickling created with ``NEWOBJ`` and not yet filled, once: never
  on anything a call returned (the enum's members are process-wide singletons: setting one's ``_value_`` changed
  every later DCP save of the process), a class or a function. The state is a dict of the dataclass's own field
  names (``TensorProperties``: its 5-tuple, of the types it holds).
- **Keys**: a dict key is a str (its hash is randomised per process) or a ``MetadataIndex`` whose offset is a
  ``torch.Size`` as above, checked before it is hashed (a key made of a tuple nested 500,000 deep, or of a tuple
  that refers to itself 90 times over, made hashing it crash or take 2**90 steps); and at most ``SAME_HASH`` keys of
  one dict share a hash (crafted ``MetadataIndex`` offsets can collide, which made filling the dict quadratic).
- **Ints** are within ±2**62; nothing read is hashed, compared or printed whole except checked keys.

What the result holds is then checked field by field (``reader.py``), which refuses anything deeper or other than
DCP's schema.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import pickletools
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata, _MEM_FORMAT_ENCODING)

MAX_INT = 2**62
"""Ints of a metadata lie within ±MAX_INT (sizes, offsets and lengths in bytes all do)."""
MAX_DIMS = 64
"""Dimensions of a ``torch.Size`` in a metadata."""
SAME_HASH = 8
"""Keys of one dict that may share a hash (real keys of distinct chunks share one with odds of ~2**-64)."""
MAX_NAME = 4096
"""Characters of a str argument (a path part, a layout name)."""

DATACLASSES = (Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, ChunkStorageMetadata,
               _StorageInfo)
"""What ``NEWOBJ`` may create and ``BUILD`` fill."""
PATHS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)


class Refused(pickle.UnpicklingError):
    """The pickle asks for something no DCP metadata holds (the message says what)."""


def describe(value: Any) -> str:
    """A short description of anything a file built, computed without walking it (no repr of an instance or a
    container: one may be nested a million deep or refer to itself)."""
    if isinstance(value, str):
        return repr(value[:80]) + ("..." if len(value) > 80 else "")
    if type(value) in (int, bool, float) or value is None:
        return repr(value) if type(value) is not int or abs(value) < 10**20 else f"an int of {value.bit_length()} bits"
    if isinstance(value, (type, torch.dtype, torch.layout)) or callable(value):
        name = getattr(value, "__qualname__", None)
        return f"{getattr(value, '__module__', '')}.{name}" if isinstance(name, str) else type(value).__name__
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _text(name: str) -> str:
    """A name from a file, shortened and with unprintable characters escaped, for a message."""
    short = name[:80] + ("..." if len(name) > 80 else "")
    return short if short.isprintable() else short.encode("unicode_escape").decode("ascii")


def _layout_named(name: str) -> torch.layout:
    """torch's layout of that name ("torch.strided"): what ``torch.serialization._get_layout`` answers, without its
    process-wide cache."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise Refused(f"it names the layout {describe(name)}, which torch does not have")


def _is_int(value: Any) -> bool:
    return type(value) is int and -MAX_INT < value < MAX_INT


def dims_problem(value: Any) -> str | None:
    """Why ``value`` is not a sequence of at most MAX_DIMS ints in [0, MAX_INT) (a ``torch.Size``'s content)."""
    if type(value) not in (tuple, list, torch.Size) or len(value) > MAX_DIMS:
        return f"{describe(value)} is not a size of at most {MAX_DIMS} dimensions"
    if not all(type(v) is int and 0 <= v < MAX_INT for v in value):
        return f"{describe(value)} holds something other than ints in [0, 2**62)"
    return None


def _size_args(args: tuple) -> str | None:
    if len(args) != 1:
        return "torch.Size takes one argument"
    return dims_problem(args[0])


def _enum_args(args: tuple) -> str | None:
    return None if len(args) == 1 and type(args[0]) is int else "the memory-format enum takes one int"


def _name_args(args: tuple) -> str | None:
    ok = len(args) == 1 and type(args[0]) is str and len(args[0]) <= 64
    return None if ok else "the layout lookup takes one short str"


def _path_args(args: tuple) -> str | None:
    ok = len(args) <= MAX_NAME and all(type(a) is str and len(a) <= MAX_NAME for a in args)
    return None if ok else "a path takes strs"


CALLS: dict[Any, Callable[[tuple], str | None]] = {torch.Size: _size_args, _MEM_FORMAT_ENCODING: _enum_args,
                                                   _layout_named: _name_args, **{p: _path_args for p in PATHS}}
"""What ``REDUCE`` may call, each with the check of its arguments."""

_GLOBALS: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c
                                        for c in (*DATACLASSES, torch.Size, _MEM_FORMAT_ENCODING, *PATHS)}
_GLOBALS.update({(module, c.__name__): c for c in PATHS for module in ("pathlib", "pathlib._local")})
_GLOBALS[("torch.serialization", "_get_layout")] = _layout_named
_GLOBALS.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})

_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in DATACLASSES}
_PROPERTIES_STATE = (torch.dtype, torch.layout, bool, _MEM_FORMAT_ENCODING, bool)
"""The types of ``TensorProperties.__getstate__``'s tuple."""

_KEPT = ("PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1",
         "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2",
         "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "GLOBAL", "STACK_GLOBAL",
         "REDUCE", "NEWOBJ", "BUILD", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET")
"""The instructions a DCP metadata pickle uses (protocols 2 to 5); every other one is refused."""
_NAMES = {getattr(pickle, name)[0]: name for name in dir(pickle)
          if name.isupper() and isinstance(getattr(pickle, name), bytes) and len(getattr(pickle, name)) == 1}


class MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - the only unpickler whose opcodes can be overridden
    """Unpickles a DCP metadata and nothing else (see the module docstring). ``data``: the whole file."""

    dispatch: dict[int, Callable] = {}

    def __init__(self, data: bytes):
        self._source = io.BytesIO(data)
        super().__init__(self._source)
        self._fresh: dict[int, Any] = {}  # id -> instance created by NEWOBJ, not yet filled by BUILD
        self._key_hashes: dict[int, tuple[dict, dict[int, int]]] = {}  # id(dict) -> (dict, hash -> keys)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[(module, name)]
        except KeyError:
            raise Refused(f"it asks for {_text(module)}.{_text(name)}, which no checkpoint metadata holds") from None

    def _refuse(self, code: int) -> None:
        name = _NAMES.get(code, f"0x{code:02x}")
        raise Refused(f"it uses the pickle instruction {name}, which no checkpoint metadata uses")

    # ---------------------------------------------------------------------------------------------- values
    def _long1(self) -> None:
        n = self.read(1)[0]
        if n > 8:
            raise Refused(f"it holds an int of {n} bytes; a checkpoint metadata's ints are within ±2**62")
        value = pickle.decode_long(self.read(n))
        if not _is_int(value):
            raise Refused(f"it holds the int {value}; a checkpoint metadata's ints are within ±2**62")
        self.append(value)

    # ------------------------------------------------------------------------------------------ containers
    def _key(self, target: dict, key: Any) -> None:
        """Refuse a key that is not a str or a checked MetadataIndex, before anything hashes it; count hashes."""
        if type(key) is str:
            return
        if type(key) is not MetadataIndex:
            raise Refused(f"it uses {describe(key)} as a dictionary key; a checkpoint metadata's keys are names "
                          "and tensor locations")
        state = vars(key)
        offset = state.get("offset")
        if type(state.get("fqn")) is not str or not (offset is None or (type(offset) is torch.Size and
                                                                         dims_problem(offset) is None)) \
                or not (state.get("index") is None or _is_int(state.get("index"))):
            raise Refused("it uses a tensor location whose name or offset is invalid as a dictionary key")
        _, counts = self._key_hashes.setdefault(id(target), (target, {}))
        h = hash(key)
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > SAME_HASH:
            raise Refused(f"more than {SAME_HASH} of its tensor locations share one hash (crafted to make reading "
                          "it slow)")

    def _target_dict(self) -> dict:
        target = self.stack[-1]
        if type(target) is not dict:
            raise Refused(f"it sets items of {describe(target)}, which is not a dictionary")
        return target

    def _setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self._target_dict()
        self._key(target, key)
        target[key] = value

    def _setitems(self) -> None:
        items = self.pop_mark()
        target = self._target_dict()
        if len(items) % 2:
            raise Refused("it sets a key without a value")
        for i in range(0, len(items), 2):
            self._key(target, items[i])
            target[items[i]] = items[i + 1]

    def _target_list(self) -> list:
        target = self.stack[-1]
        if type(target) is not list:
            raise Refused(f"it appends to {describe(target)}, which is not a list")
        return target

    def _append(self) -> None:
        value = self.stack.pop()
        self._target_list().append(value)

    def _appends(self) -> None:
        items = self.pop_mark()
        self._target_list().extend(items)

    # --------------------------------------------------------------------------------------- calls, state
    def _reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        check = next((c for f, c in CALLS.items() if f is func), None)
        if check is None:
            raise Refused(f"it calls {describe(func)}, which no checkpoint metadata calls")
        problem = "its arguments are not a tuple" if type(args) is not tuple else check(args)
        if problem is not None:
            raise Refused(f"it calls {describe(func)} with arguments no checkpoint metadata holds ({problem})")
        self.stack[-1] = func(*args)

    def _newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not any(cls is c for c in DATACLASSES) or type(args) is not tuple or len(args):
            raise Refused(f"it creates {describe(cls)}, which no checkpoint metadata holds")
        obj = cls.__new__(cls)
        self._fresh[id(obj)] = obj
        self.append(obj)

    def _build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if self._fresh.pop(id(target), None) is not target:
            raise Refused(f"it sets the state of {describe(target)}, which it did not just create (only a new "
                          "instance of a metadata class is filled, once)")
        cls = type(target)
        if cls is TensorProperties:
            if type(state) is not tuple or len(state) != len(_PROPERTIES_STATE) or not all(
                    type(v) is t or (t is _MEM_FORMAT_ENCODING and isinstance(v, t))
                    for v, t in zip(state, _PROPERTIES_STATE)):
                raise Refused(f"it gives tensor properties the state {describe(state)}, which is not theirs")
            target.__setstate__(state)
            return
        if type(state) is not dict or not all(type(k) is str and k in _FIELDS[cls] for k in state):
            raise Refused(f"it gives a {cls.__name__} a state other than its fields")
        vars(target).update(state)

    def unread(self) -> int:
        """Bytes of the file after the end of the pickle (after ``load``)."""
        frame = self._unframer.current_frame
        in_frame = len(frame.getbuffer()) - frame.tell() if frame is not None else 0
        return len(self._source.getbuffer()) - self._source.tell() + in_frame

    def pop_mark(self) -> list:
        if not self.metastack:
            raise Refused("it closes a mark it never opened")
        return super().pop_mark()


def _install() -> None:
    base = pickle._Unpickler.dispatch  # noqa: SLF001
    table = MetadataUnpickler.dispatch
    for code in range(256):
        table[code] = lambda self, code=code: self._refuse(code)  # noqa: SLF001
    for name in _KEPT:
        code = getattr(pickle, name)[0]
        table[code] = base[code]
    replaced = {"LONG1": MetadataUnpickler._long1, "SETITEM": MetadataUnpickler._setitem,
                "SETITEMS": MetadataUnpickler._setitems, "APPEND": MetadataUnpickler._append,
                "APPENDS": MetadataUnpickler._appends, "REDUCE": MetadataUnpickler._reduce,
                "NEWOBJ": MetadataUnpickler._newobj, "BUILD": MetadataUnpickler._build}
    for name, method in replaced.items():
        table[getattr(pickle, name)[0]] = method


_install()


def unpickle_metadata(data: bytes) -> Any:
    """The object the pickle ``data`` holds, built under the rules above; ``Refused`` (or any exception a damaged
    pickle raises) otherwise, also when anything follows the pickle's end (DCP writes nothing there)."""
    unpickler = MetadataUnpickler(data)
    result = unpickler.load()
    if unpickler.unread():
        raise Refused(f"{unpickler.unread():,} bytes follow the end of its pickle")
    return result


# ----------------------------------------------------------------------------------------------- tensor items
MAX_ITEM_PICKLE = 4096
"""Bytes of a tensor item's ``data.pkl`` (a tensor's is ~150; 64 dimensions of 8-byte ints stay far below)."""
_ITEM_OPS = frozenset({"PROTO", "FRAME", "STOP", "MARK", "GLOBAL", "SHORT_BINUNICODE", "BINUNICODE",
                       "BINPUT", "LONG_BINPUT", "MEMOIZE", "BININT", "BININT1", "BININT2", "LONG1", "NEWFALSE",
                       "NEWTRUE", "NONE", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINPERSID",
                       "REDUCE"})
"""What ``torch.save`` (pickle protocol 2) writes for one tensor: ``_rebuild_tensor_v2(storage, offset, size,
stride, ...)``."""
_ITEM_NAMES = frozenset({"torch._utils _rebuild_tensor_v2", "collections OrderedDict"})
"""The names a tensor's pickle uses besides its storage class (``torch FloatStorage``, ...)."""
STORAGE_DTYPES = {f"torch {name}": dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
"""``torch FloatStorage`` -> torch.float32, ...: the storage class a tensor's pickle names says its dtype."""


def item_pickle_problem(data: bytes, dtype: torch.dtype | None = None) -> str | None:
    """Why ``data`` (the ``data.pkl`` of one tensor item of a ``.distcp`` file) is not a tensor's pickle, or None.

    DCP reads each item with ``torch.load(weights_only=True)``, whose unpickler hashes whatever a dict key or an
    ``OrderedDict`` argument holds: a 300-byte item holding a tuple that refers to itself 90 times over hung it, one
    nested 500,000 deep crashed the process. Here, before torch sees it: at most MAX_ITEM_PICKLE bytes, only the
    instructions a tensor's pickle uses (no dicts, lists or sets) and no memo reads, so every object is built once
    and used once: what torch then hashes is a tree of at most a few thousand nodes. Names only those a tensor's
    pickle names (torch's own refusal of any other says to retry with weights_only=False), and one storage class,
    of ``dtype`` when given (the dtype the metadata declares: an int8 item was copied into a float32 weight)."""
    if len(data) > MAX_ITEM_PICKLE:
        return f"its pickle has {len(data):,} bytes; a tensor's has a few hundred"
    storages = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name not in _ITEM_OPS:
                return f"its pickle uses the instruction {opcode.name}, which a tensor's does not"
            if opcode.name == "GLOBAL" and arg not in _ITEM_NAMES:
                if arg not in STORAGE_DTYPES:
                    return f"its pickle asks for {describe(arg)}, which a tensor's does not"
                storages.append(STORAGE_DTYPES[arg])
    except Exception as exc:  # noqa: BLE001 - pickletools raises ValueError and more on a damaged stream
        return f"its pickle is damaged ({type(exc).__name__}: {str(exc)[:120]})"
    if len(storages) != 1:
        return f"its pickle names {len(storages)} storage classes; a tensor's names one"
    if dtype is not None and storages[0] != dtype:
        return (f"it holds {str(storages[0]).removeprefix('torch.')} values where the metadata declares "
                f"{str(dtype).removeprefix('torch.')}")
    return None
