"""Packed, shuffled, sharded, resumable batches from prepared datasets, with mixtures and stages.

**Sequences.** Each bundle's token stream (documents back to back, each ended by eos) is cut into windows of
``seq_len + 1`` tokens that overlap by one token (the last target of a window is the first input of the next), so
every token is an input exactly once per epoch. Windows never straddle bundles; a bundle's final partial window
(< ``seq_len`` tokens) is dropped. Optionally each batch carries ``position_ids`` that restart at 0 at every
document start, from which attention can be masked per document.

**Loss masks.** A dataset prepared in the chat format carries a loss mask (``PreparedDataset.loss_mask``): a label
whose token is not a target (anything but the assistant's replies) is -100, which the loss ignores, through packing
and window cuts alike; a dataset without one has every label a target, also in a mixture with masked ones. Each
batch counts its targets on this rank and over all ranks (``num_targets``, ``global_targets``: what the step's loss
is averaged over), the latter from per-window counts cached per bundle, so no collective is needed. Packed
conversations must not see each other: masked data needs ``data.document_positions`` and ``data.document_mask``.

**Shuffle.** Sequence ``i`` of epoch ``e`` is ``P_e(i)``, a keyed pseudo-random permutation of ``[0, n)`` (a Feistel
network with cycle-walking): computed on demand, O(1) memory at any dataset size, identical on every machine.

**Global order and sharding.** The loader walks *global slots*: slot ``t`` of a stage belongs to one dataset of the
mixture, chosen by a low-discrepancy sequence (slot ``t`` -> ``frac(t * golden ratio)`` against the cumulative
weights), so the realised mixture tracks the weights within a few sequences at any point. A micro-batch consumes
``world_size * micro_batch_size`` consecutive slots and rank ``r`` takes the ``r``-th block of them. The state is
global (slots and per-dataset counts, the same on every rank), so the ranks never overlap or leave gaps, and a run
resumed at a different world size continues the same global order: every sequence of an epoch is still seen once.

**Stages.** A schedule of stages, each with a token budget, sequence length, micro-batch size and mixture
weights; a micro-batch belongs to the stage in which its first token falls (counted globally). Entering a stage
starts its datasets at the beginning of a fresh permutation.

**Prefetch.** A background thread computes batches ahead into a bounded queue. ``state_dict()`` describes the
batches *delivered* so far, not those computed ahead, so resuming from it gives exactly the next batch.
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from zaya.data.bundle import DatasetError, PreparedDataset, Split

STATE_VERSION = 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: frac(t * phi) in fixed point


# --- the permutation -----------------------------------------------------------------------------------------------
def _key(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixed 64-bit hash (uint64 arithmetic wraps, which is intended)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A seeded bijection of ``[0, n)`` evaluated pointwise: balanced Feistel network plus cycle-walking."""

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        if n <= 0:
            raise ValueError("a permutation needs n >= 1")
        self.n = n
        half = max(1, math.ceil(math.log2(max(n, 2)) / 2))
        self.half_bits = np.uint64(half)
        self.mask = np.uint64((1 << half) - 1)
        self.keys = [np.uint64(_key(key, r)) for r in range(self.ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half_bits, x & self.mask
        with np.errstate(over="ignore"):
            for k in self.keys:
                left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half_bits) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        x = np.asarray(index, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"permutation index out of range [0, {self.n})")
        x = self._encrypt(x)
        out = x >= np.uint64(self.n)
        while out.any():  # walk the cycle until it re-enters [0, n): terminates because it is a permutation
            x[out] = self._encrypt(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)


# --- one dataset split as sequences --------------------------------------------------------------------------------
class SequenceSource:
    """A split cut into windows of ``seq_len + 1`` tokens (see the module docstring). With ``vocab_size``, every
    read is checked to hold ids in ``[0, vocab_size)``: a corrupt bundle is a DataError naming it, never an index
    error inside the model (one min and one max over the rows read: nothing per token in Python)."""

    def __init__(self, split: Split, seq_len: int, name: str = "", vocab_size: int | None = None):
        self.split, self.seq_len, self.name, self.vocab_size = split, seq_len, name, vocab_size
        per_bundle = np.array([max(0, (b.num_tokens - 1) // seq_len) for b in split.bundles], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(per_bundle)])
        self.num_sequences = int(self.offsets[-1])
        if self.num_sequences == 0:
            longest = max((b.num_tokens for b in split.bundles), default=0)
            raise DatasetError(
                f"dataset {name or split.name!r}: seq_len {seq_len} is longer than any of its token streams can "
                f"fill (largest bundle: {longest:,} tokens, a sequence needs {seq_len + 1}); use a shorter seq_len "
                "or prepare more text (or larger bundles with --bundle-mb)")
        self.masked = any(b.mask is not None for b in split.bundles)
        self._targets: dict[int, np.ndarray] = {}
        dropped = split.num_tokens - self.num_sequences * seq_len
        if dropped > 0.05 * split.num_tokens:
            warnings.warn(f"dataset {name or split.name!r}: {dropped:,} of {split.num_tokens:,} tokens "
                          f"({dropped / split.num_tokens:.0%}) fall in the partial last window of a bundle at "
                          f"seq_len {seq_len} and are never used", stacklevel=2)

    def read(self, indices: np.ndarray, out: np.ndarray, positions: np.ndarray | None,
             keep: np.ndarray | None = None) -> None:
        """Copy sequences ``indices`` into rows of ``out`` [len, seq_len + 1]; fill ``positions`` if given, and
        ``keep`` [len, seq_len + 1] with each token's loss mask (1: a target) if given."""
        bundles = np.searchsorted(self.offsets, indices, side="right") - 1
        L = self.seq_len
        for row, (i, b) in enumerate(zip(indices.tolist(), bundles.tolist())):
            bundle = self.split.bundles[b]
            start = (i - int(self.offsets[b])) * L
            out[row] = bundle.tokens[start:start + L + 1]
            if keep is not None:
                keep[row] = 1 if bundle.mask is None else bundle.mask[start:start + L + 1]
            if positions is not None:
                # Last document start at or before each input token -> the token's position within its document.
                # uint64 keys: a Python int against the uint64 index would promote both to float64, converting
                # the whole index on every call (O(documents in the bundle) per row).
                idx = bundle.index
                lo = int(np.searchsorted(idx, np.uint64(start), side="right")) - 1
                hi = int(np.searchsorted(idx, np.uint64(start + L), side="left"))
                doc_starts = np.asarray(idx[lo:hi], dtype=np.int64) - start
                marks = np.zeros(L, dtype=np.int64)
                inside = doc_starts[(doc_starts > 0) & (doc_starts < L)]  # a corrupt index cannot reach past L
                marks[inside] = inside
                positions[row] = np.arange(L) - np.maximum.accumulate(marks)
        if self.vocab_size is not None and len(indices):
            self._check_ids(out[:len(indices)], indices, bundles)

    def targets(self, indices: np.ndarray) -> np.ndarray:
        """How many labels of each sequence in ``indices`` are targets (``seq_len`` without a mask)."""
        if not self.masked:
            return np.full(len(indices), self.seq_len, dtype=np.int64)
        bundles = np.searchsorted(self.offsets, indices, side="right") - 1
        counts = np.empty(len(indices), dtype=np.int64)
        for b in np.unique(bundles).tolist():
            at = bundles == b
            counts[at] = self._bundle_targets(b)[indices[at] - int(self.offsets[b])]
        return counts

    def _bundle_targets(self, b: int, rows: int = 1 << 14) -> np.ndarray:
        """Targets per window of bundle ``b`` (its labels are tokens 1 .. L of the window), computed once, a
        chunk of windows at a time."""
        if b not in self._targets:
            bundle, L = self.split.bundles[b], self.seq_len
            n = int(self.offsets[b + 1] - self.offsets[b])
            if bundle.mask is None:
                self._targets[b] = np.full(n, L, dtype=np.int64)
            else:
                counts = np.empty(n, dtype=np.int64)
                for first in range(0, n, rows):
                    last = min(n, first + rows)
                    window = np.asarray(bundle.mask[first * L + 1:last * L + 1]).reshape(last - first, L)
                    counts[first:last] = window.sum(axis=1, dtype=np.int64)
                self._targets[b] = counts
        return self._targets[b]

    def _check_ids(self, rows: np.ndarray, indices: np.ndarray, bundles: np.ndarray) -> None:
        if int(rows.min()) >= 0 and int(rows.max()) < self.vocab_size:
            return
        bad = np.argwhere((rows < 0) | (rows >= self.vocab_size))[0]
        row, column = int(bad[0]), int(bad[1])
        b = int(bundles[row])
        at = (int(indices[row]) - int(self.offsets[b])) * self.seq_len + column
        raise DatasetError(f"{self.split.bundles[b].path}: token {at:,} has id {int(rows[row, column]):,}, outside "
                           f"the dataset's vocabulary of {self.vocab_size:,} ids: the bundle is corrupt or was "
                           "written with another tokenizer; prepare the dataset again (`zaya data inspect --verify "
                           "DIR` checks every bundle)")


# --- schedule ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One phase of the data schedule.

    tokens: global token budget of the stage (0 = unlimited; only the last stage may be unlimited).
    seq_len: tokens per sequence. micro_batch_size: sequences per rank per micro-batch.
    weights: dataset name -> mixture weight (normalised; zero weights allowed).
    """

    name: str
    seq_len: int
    micro_batch_size: int
    weights: Mapping[str, float]
    tokens: int = 0

    def __post_init__(self):
        if self.seq_len < 1 or self.micro_batch_size < 1:
            raise ValueError(f"stage {self.name!r}: seq_len and micro_batch_size must be >= 1")
        if self.tokens < 0:
            raise ValueError(f"stage {self.name!r}: tokens must be >= 0")
        if not self.weights or any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"stage {self.name!r}: mixture weights must be non-negative with a positive sum "
                             f"(got {dict(self.weights)})")


@dataclass
class Batch:
    """One rank's micro-batch. ``input_ids``/``labels``/``position_ids`` are int64 [micro_batch, seq_len]."""

    input_ids: Any
    labels: Any
    position_ids: Any | None
    stage: str
    global_tokens: int                       # tokens in this micro-batch summed over all ranks
    sources: dict[str, int] = field(default_factory=dict)   # sequences per dataset in this rank's rows
    num_targets: int = 0
    """Labels of this rank's rows that count towards the loss (not -100: every one of them without a loss mask)."""
    global_targets: int = 0
    """The same summed over all ranks: what the step's loss is averaged over (no collective needed to know it)."""


def _assign(slots: np.ndarray, weights: Mapping[str, float], names: list[str]) -> np.ndarray:
    """Dataset index of each global slot: ``frac(slot * golden ratio)`` against the cumulative weights."""
    w = [float(weights.get(n, 0.0)) for n in names]
    total = sum(w)
    bounds, acc = [], 0.0
    for x in w:
        acc += x
        bounds.append(min(int(acc / total * 2.0**64), 2**64 - 1))
    with np.errstate(over="ignore"):
        u = slots.astype(np.uint64) * _GOLDEN
    which = np.searchsorted(np.array(bounds, dtype=np.uint64), u, side="right")
    which[which >= len(names)] = max(i for i, x in enumerate(w) if x > 0)  # u beyond the last rounded bound
    return which


class DataLoader:
    """Batches for one data-parallel rank; iterate it, or call ``next()``. See the module docstring.

    datasets: name -> PreparedDataset or a directory. split: "train" (shuffled, endless per stage).
    """

    def __init__(self, datasets: Mapping[str, PreparedDataset | str | Path], stages: list[Stage],
                 rank: int = 0, world_size: int = 1, seed: int = 0, split: str = "train",
                 document_positions: bool = False, prefetch: int = 4, pin_memory: bool = False,
                 document_mask: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if not stages:
            raise ValueError("the data schedule needs at least one stage")
        for s in stages[:-1]:
            if s.tokens == 0:
                raise ValueError(f"stage {s.name!r} has no token budget (tokens = 0) but is not the last stage")
        self.datasets = {n: d if isinstance(d, PreparedDataset) else PreparedDataset(d) for n, d in datasets.items()}
        for s in stages:
            unknown = sorted(set(s.weights) - set(self.datasets))
            if unknown:
                raise ValueError(f"stage {s.name!r}: mixture names unknown dataset(s) {unknown}; "
                                 f"known: {sorted(self.datasets)}")
        eos = {d.eos_id for d in self.datasets.values()}
        vocab = {d.manifest["tokenizer"]["sha256"] for d in self.datasets.values()}
        if len(vocab) > 1:
            raise DatasetError("the mixture's datasets were prepared with different tokenizers: "
                               + ", ".join(f"{n} ({d.directory})" for n, d in self.datasets.items()))
        self.eos_id = eos.pop()
        masked = sorted(n for n, d in self.datasets.items() if d.loss_mask)
        if masked and not (document_positions and document_mask):
            raise DatasetError(f"dataset(s) {', '.join(masked)} hold chat data with loss masks: set "
                               "data.document_positions = true and data.document_mask = true, so that packed "
                               "conversations do not attend to each other")
        self.masked = bool(masked)
        self.stages, self.rank, self.world_size, self.seed = list(stages), rank, world_size, seed
        self.split, self.document_positions, self.prefetch = split, document_positions, prefetch
        self.pin_memory = pin_memory  # batches in page-locked memory, for asynchronous copies to a GPU
        self.names = sorted(self.datasets)
        self._sources: dict[tuple[str, int], SequenceSource] = {}
        self._perms: dict[tuple, Permutation] = {}
        for s in self.stages:  # fail now, not hours in, when a stage's seq_len cannot be filled
            for n in s.weights:
                if s.weights[n] > 0:
                    self._source(n, s.seq_len)
        self._state = self._initial_state()
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    # --- state ------------------------------------------------------------------------------------------------
    def _initial_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "seed": self.seed, "tokens": 0, "stage": 0, "stage_tokens": 0, "slot": 0,
                "counts": {n: 0 for n in self.names}, "batches": 0}

    def state_dict(self) -> dict[str, Any]:
        """Position after the last delivered batch; the same on every rank, valid at any world size."""
        s = dict(self._state)
        s["counts"] = dict(s["counts"])
        return s

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')!r}; this zaya reads {STATE_VERSION}")
        if state.get("seed") != self.seed:
            raise ValueError(f"data loader state was saved with seed {state.get('seed')}, this loader has seed "
                             f"{self.seed}: resuming would replay a different order")
        missing = sorted(set(self.names) - set(state["counts"]))
        if missing:
            raise ValueError(f"data loader state has no position for dataset(s) {missing}")
        self._halt()
        self._state = {**state, "counts": dict(state["counts"])}

    # --- batches ----------------------------------------------------------------------------------------------
    def _source(self, name: str, seq_len: int) -> SequenceSource:
        key = (name, seq_len)
        if key not in self._sources:
            dataset = self.datasets[name]
            self._sources[key] = SequenceSource(dataset.split(self.split), seq_len, name, dataset.vocab_size)
        return self._sources[key]

    def _permutation(self, stage: int, name: str, epoch: int, n: int) -> Permutation:
        key = (stage, name, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[key] = Permutation(n, _key(self.seed, *key))
        return self._perms[key]

    def _advance_stage(self, state: dict[str, Any]) -> Stage | None:
        while True:
            index = state["stage"]
            if index >= len(self.stages):
                return None
            stage = self.stages[index]
            if stage.tokens == 0 or state["stage_tokens"] < stage.tokens:
                return stage
            state.update(stage=index + 1, stage_tokens=0, slot=0, counts={n: 0 for n in self.names})

    def compute(self, state: Mapping[str, Any]) -> tuple[Batch, dict[str, Any]] | None:
        """The micro-batch at ``state`` and the state after it (a pure function); None when the schedule ends."""
        state = {**state, "counts": dict(state["counts"])}
        stage = self._advance_stage(state)
        if stage is None:
            return None
        b, L, W = stage.micro_batch_size, stage.seq_len, self.world_size
        slots = np.arange(state["slot"], state["slot"] + W * b, dtype=np.uint64)
        which = _assign(slots, stage.weights, self.names)
        # Sequence number within each dataset: its count so far plus its rank among this batch's slots.
        ordinal = np.zeros(len(slots), dtype=np.int64)
        for k, name in enumerate(self.names):
            hit = which == k
            ordinal[hit] = state["counts"][name] + np.arange(int(hit.sum()))
            state["counts"][name] += int(hit.sum())
        mine = slice(self.rank * b, (self.rank + 1) * b)
        # Every rank's sequence numbers when the targets of all of them are counted (masked data), else this rank's.
        counted = slice(0, W * b) if self.masked else mine
        indices = np.empty(W * b, dtype=np.int64)
        global_targets = 0
        for k in np.unique(which[counted]).tolist():
            name = self.names[k]
            sel = np.nonzero(which[counted] == k)[0] + counted.start
            n = self._source(name, L).num_sequences
            for epoch in np.unique(ordinal[sel] // n).tolist():
                e = sel[ordinal[sel] // n == epoch]
                indices[e] = self._permutation(state["stage"], name, epoch, n)(ordinal[e] % n)
            if self.masked:
                global_targets += int(self._source(name, L).targets(indices[sel]).sum())
        rows = np.empty((b, L + 1), dtype=np.int64)
        positions = np.empty((b, L), dtype=np.int64) if self.document_positions else None
        keep = np.empty((b, L + 1), dtype=np.uint8) if self.masked else None
        sources: dict[str, int] = {}
        for k in np.unique(which[mine]).tolist():
            name = self.names[k]
            sel = np.nonzero(which[mine] == k)[0]
            block = np.empty((len(sel), L + 1), dtype=np.int64)
            pos = np.empty((len(sel), L), dtype=np.int64) if positions is not None else None
            kept = np.empty((len(sel), L + 1), dtype=np.uint8) if keep is not None else None
            self._source(name, L).read(indices[mine][sel], block, pos, kept)
            rows[sel] = block
            if positions is not None:
                positions[sel] = pos
            if keep is not None:
                keep[sel] = kept
            sources[name] = len(sel)
        labels = rows[:, 1:] if keep is None else _ignore_masked(rows[:, 1:], keep[:, 1:])
        global_tokens = W * b * L
        state["slot"] += W * b
        state["tokens"] += global_tokens
        state["stage_tokens"] += global_tokens
        state["batches"] += 1
        batch = Batch(input_ids=self._tensor(rows[:, :-1]), labels=self._tensor(labels),
                      position_ids=self._tensor(positions) if positions is not None else None,
                      stage=stage.name, global_tokens=global_tokens, sources=sources,
                      num_targets=b * L if keep is None else int(keep[:, 1:].sum()),
                      global_targets=global_tokens if keep is None else global_targets)
        return batch, state

    def _tensor(self, array: np.ndarray):
        """A contiguous int64 tensor of ``array`` (pinned with ``pin_memory``), filled in this thread."""
        import torch

        out = torch.empty(array.shape, dtype=torch.int64, device="cpu", pin_memory=self.pin_memory)
        out.numpy()[...] = array
        return out

    # --- iteration with prefetch ------------------------------------------------------------------------------
    def _producer(self, state: dict[str, Any], out: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                item = self.compute(state)
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if item is None:
                    return
                state = item[1]
        except BaseException as exc:  # hand the error to the consumer instead of dying silently
            while not stop.is_set():  # a timed put: a full queue must not block _halt()'s join forever
                try:
                    out.put(exc, timeout=0.1)
                    return
                except queue.Full:
                    continue

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None
            self._stop = threading.Event()

    def close(self) -> None:
        self._halt()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.prefetch <= 0:
            item = self.compute(self._state)
        else:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self.prefetch)
                self._thread = threading.Thread(target=self._producer, args=(self._state, self._queue, self._stop),
                                                name="zaya-data-prefetch", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._halt()
                raise item
        if item is None:
            self._halt()  # the producer has exited; a later call must not wait on its queue forever
            raise StopIteration
        batch, self._state = item
        return batch

    def __del__(self):
        try:
            self._halt()
        except Exception:
            pass


def _ignore_masked(labels: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``labels`` with those whose token is not a target (``keep`` 0) set to the index the loss ignores."""
    from zaya.model.loss import IGNORE_INDEX

    return np.where(keep == 1, labels, IGNORE_INDEX)


def validation_batches(dataset: PreparedDataset | str | Path, seq_len: int, batch_size: int, rank: int = 0,
                       world_size: int = 1, max_batches: int | None = None, split: str = "val",
                       document_positions: bool = False):
    """The validation split in order (no shuffle), as (input ids, labels, position ids or None) tensors; rank ``r``
    takes every W-th batch. Labels of tokens a loss mask excludes are ignored (-100). Position ids restart at every
    document start when ``document_positions`` is set or the split has loss masks (whose packed examples must not
    see each other, as in training).

    Every rank yields the same number of batches (the last, partial round is dropped) so collective averages line up.
    """
    import torch

    dataset = dataset if isinstance(dataset, PreparedDataset) else PreparedDataset(dataset)
    source = SequenceSource(dataset.split(split), seq_len, f"{dataset.directory.name}/{split}", dataset.vocab_size)
    rounds = source.num_sequences // (batch_size * world_size)
    if rounds == 0:
        raise DatasetError(f"{dataset.directory}: the {split!r} split has {source.num_sequences} sequences of "
                           f"{seq_len} tokens, fewer than one batch of {batch_size} per rank x {world_size} ranks")
    if max_batches is not None:
        rounds = min(rounds, max_batches)
    with_positions = document_positions or source.masked
    for r in range(rounds):
        first = (r * world_size + rank) * batch_size
        rows = np.empty((batch_size, seq_len + 1), dtype=np.int64)
        keep = np.empty((batch_size, seq_len + 1), dtype=np.uint8) if source.masked else None
        positions = np.empty((batch_size, seq_len), dtype=np.int64) if with_positions else None
        source.read(np.arange(first, first + batch_size), rows, positions, keep)
        labels = rows[:, 1:] if keep is None else _ignore_masked(rows[:, 1:], keep[:, 1:])
        yield (torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(np.ascontiguousarray(labels)),
               None if positions is None else torch.from_numpy(positions))


def check_vocabulary(dataset: PreparedDataset, model_vocab_size: int, model_eos_id: int | None = None) -> None:
    """Refuse a model whose embedding cannot hold the dataset's ids, or is far larger than its tokenizer needs.

    The model may pad the vocabulary (ZAYA1: Gemma3's tokenizer in a 262,272-row embedding), but by no more than
    256 rows; a bigger difference means the model and the data were made for different tokenizers.
    """
    tok = dataset.manifest["tokenizer"]
    need = int(tok["vocab_size"])
    if model_vocab_size < need or model_vocab_size > need + 256:
        raise DatasetError(
            f"{dataset.directory}: its tokenizer has {need:,} ids ({tok['source']}) but model.vocab_size is "
            f"{model_vocab_size:,}; set model.vocab_size = {tok['padded_vocab_size']} or use data prepared with "
            "the model's tokenizer")
    if model_eos_id is not None and model_eos_id != dataset.eos_id:
        raise DatasetError(f"{dataset.directory}: documents end with eos id {dataset.eos_id} "
                           f"({tok.get('eos_token')!r}) but model.eos_token_id is {model_eos_id}; set "
                           f"model.eos_token_id = {dataset.eos_id}")
