"""The checkpoint store in one process: commit markers and checksums, verified load with fallback, retention,
async saves (staged copies, exit while writing), failed saves (a file-size limit stands in for a full disk), the
RAM tier, and the shape check. Multi-rank saving and resharding are in test_checkpoint_dist.py."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from zaya.checkpoint.commit import COMMIT, checksum_file, read_commit
from zaya.checkpoint.parts import ModelState, OptimizerState
from zaya.checkpoint.store import CheckpointError, CheckpointStore, latest_checkpoint, list_checkpoints
from zaya.config import CheckpointConfig
from zaya.distributed.runtime import Runtime


def make_model(seed: int = 0, width: int = 48) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, [opt]


def train_step(model: nn.Module, opts, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(32, 16, generator=g)).square().mean()
    loss.backward()
    for o in opts:
        o.step()
        o.zero_grad()


def parts(model: nn.Module, opts) -> dict:
    """The checkpoint parts the trainer saves for a model and its optimizers."""
    return {"model": ModelState(model), "optim": OptimizerState(model, opts)}


def full_state(model: nn.Module, opts) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, o in enumerate(opts):
        for pid, st in o.state_dict()["state"].items():
            for key, v in st.items():
                out[f"optim{i}.{pid}.{key}"] = torch.as_tensor(v).clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def store_for(tmp_path: Path, logs: list[str] | None = None, **kw) -> CheckpointStore:
    kw.setdefault("ram_dir", str(tmp_path / "shm"))
    cfg = CheckpointConfig(**kw)
    return CheckpointStore(tmp_path / "run" / "checkpoints", cfg, Runtime(), log=(logs.append if logs is not None else
                                                                       lambda s: None))


def trained(steps: int = 2, seed: int = 0):
    model, opts = make_model(seed)
    for s in range(steps):
        train_step(model, opts, s)
    return model, opts


# --- commit marker, verification -------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_commit_lists_every_file_with_size_and_checksum(tmp_path, algorithm, monkeypatch):
    import zaya.checkpoint.store as store_module

    reread = []
    real = store_module.checksum_file
    monkeypatch.setattr(store_module, "checksum_file", lambda p, a: reread.append(p.name) or real(p, a))
    store = store_for(tmp_path, ram_tier=False, checksum=algorithm)
    model, opts = trained()
    out = store.save(5, parts(model, opts), {"step": 5}, blocking=True)
    assert out.ok and out.path.name == "step-00000005"
    records = read_commit(out.path)
    on_disk = sorted(f.name for f in out.path.iterdir() if f.name != COMMIT)
    assert sorted(records) == on_disk and "meta.json" in records and ".metadata" in records
    for name, r in records.items():
        assert r.size == (out.path / name).stat().st_size and r.algorithm == algorithm
        assert r.checksum == checksum_file(out.path / name, algorithm)
    # Every file was checksummed as it was written: nothing is read back.
    assert reread == []
    assert not list(out.path.parent.glob(".*partial"))


def test_round_trip_restores_model_and_optimizer_exactly(tmp_path):
    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained()
    want = full_state(model, opts)
    store.save(2, parts(model, opts), {"step": 2}, blocking=True)
    fresh, fresh_opts = make_model(seed=99)
    path = store.select("auto")
    for group in fresh_opts[0].param_groups:
        group["lr"] = 5e-3  # hyperparameters come from the config (the live groups), never from the file
    meta = store.load(path, parts(fresh, fresh_opts))
    assert meta["step"] == 2 and meta["loaded_from"] == "disk"
    assert_same(full_state(fresh, fresh_opts), want)
    assert [g["lr"] for g in fresh_opts[0].param_groups] == [5e-3]
    # The DCP keys are the parameter names under the part's name (consolidate.py reads model.<fqn>).
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert {"model.0.weight", "optim.state.0.weight.exp_avg", "optim.state.0.weight.step"} <= keys
    assert not any("param_groups" in k for k in keys)


class Counter:
    """A part with no tensors: all of its state goes into meta.json."""

    def __init__(self, n: int = 0):
        self.n, self.history = n, (n,)

    def state_dict(self):
        return {"n": self.n, "history": self.history, "nested": {"none": None, "ok": True}}

    def load_state_dict(self, state):
        self.n, self.history, self.loaded = state["n"], state["history"], state


class Mixed:
    """A part with tensors and JSON values side by side, in dicts and in a list."""

    def __init__(self, fill: float):
        self.w = torch.full((3, 2), fill)
        self.buffers = [torch.full((4,), fill), torch.arange(3, device="cpu") * fill]
        self.loaded = None

    def state_dict(self):
        return {"a": {"w": self.w, "label": "mixed"}, "list": [self.buffers[0], "x", self.buffers[1]], "k": 3}

    def load_state_dict(self, state):
        self.loaded = state


def test_parts_layout_tensors_in_dcp_the_rest_in_meta_json(tmp_path):
    import torch.distributed.checkpoint as dcp

    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained(1)
    saved = {**parts(model, opts), "counter": Counter(7), "mixed": Mixed(2.0)}
    path = store.save(3, saved, {"tokens": 96}, blocking=True).path
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["tokens"] == 96 and meta["parts"] == ["model", "optim", "counter", "mixed"]
    assert meta["world_size"] == 1 and meta["parallel"] == "ddp" and len(meta["save_id"]) == 32
    assert meta["counter"] == {"n": 7, "history": [7], "nested": {"none": None, "ok": True}}  # a tuple: a list
    assert meta["mixed"] == {"a": {"label": "mixed"}, "list": [None, "x", None], "k": 3}
    assert "model" not in meta and "optim" not in meta  # tensors only: nothing for meta.json
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert {"mixed.a.w", "mixed.list.0", "mixed.list.2"} <= keys and not any(k.startswith("counter") for k in keys)

    fresh, fresh_opts = make_model(seed=5)
    counter, mixed = Counter(), Mixed(0.0)
    loaded = store.load(store.select("auto"), {**parts(fresh, fresh_opts), "counter": counter, "mixed": mixed})
    assert loaded["counter"]["n"] == 7 and counter.n == 7 and counter.history == [7]
    state = mixed.loaded
    assert state["a"]["label"] == "mixed" and state["k"] == 3 and state["list"][1] == "x"
    assert state["a"]["w"] is mixed.w and torch.equal(mixed.w, torch.full((3, 2), 2.0))  # in place, merged back
    assert torch.equal(state["list"][0], torch.full((4,), 2.0)) and torch.equal(state["list"][2],
                                                                               torch.arange(3) * 2.0)
    assert_same(full_state(fresh, fresh_opts), full_state(model, opts))


class CountingSGD(torch.optim.SGD):
    """Keeps a Python int in each parameter's state, as some optimizers keep ``step``."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1


def test_optimizer_state_numbers_go_through_dcp_and_come_back_as_numbers(tmp_path):
    import torch.distributed.checkpoint as dcp

    store = store_for(tmp_path, ram_tier=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
    for seed in range(3):
        train_step_on(model, [opt], seed)
    path = store.save(3, parts(model, [opt]), {}, blocking=True).path
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert "optim.state.weight.count" in keys  # written by the rank that holds it, not via rank 0's meta.json
    fresh = nn.Linear(4, 2)
    fresh_opt = CountingSGD(fresh.parameters(), lr=0.1, momentum=0.9)
    store.load(path, parts(fresh, [fresh_opt]))
    counts = [fresh_opt.state[p]["count"] for p in fresh.parameters()]
    assert counts == [3, 3] and all(type(c) is int for c in counts)
    assert torch.equal(fresh_opt.state[fresh.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])


def train_step_on(model: nn.Module, opts, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 4, generator=g)).square().mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def test_part_names_and_missing_or_non_json_parts(tmp_path):
    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained(1)
    for bad in ("step", "save_id", "parts"):
        with pytest.raises(ValueError, match=f"part name '{bad}' is taken: meta.json"):
            store.save(1, {**parts(model, opts), bad: Counter()}, {}, blocking=True)
    with pytest.raises(ValueError, match="'tokens' is also a key of the meta"):
        store.save(1, {**parts(model, opts), "tokens": Counter()}, {"tokens": 5}, blocking=True)
    with pytest.raises(ValueError, match="without '.'"):
        store.save(1, {"a.b": Counter()}, {}, blocking=True)
    path = store.save(1, parts(model, opts), {}, blocking=True).path
    with pytest.raises(CheckpointError, match=f"{path}: has no state for the checkpoint part 'counter'"):
        store.load(path, {**parts(model, opts), "counter": Counter()})

    class NotJson(Counter):
        def state_dict(self):
            return {"when": object()}

    out = store.save(2, {**parts(model, opts), "odd": NotJson()}, {}, blocking=True)
    assert not out.ok and "TypeError" in out.error and "odd.when is a object" in out.error
    assert latest_checkpoint(store.directory) == path and not list(store.directory.glob(".*partial"))


def test_staging_on_cpu_is_exactly_sized_reused_and_never_pinned(monkeypatch):
    import zaya.checkpoint.staging as staging

    def no_pinning(*a, **kw):
        raise AssertionError("the CUDA staging helper was used on CPU")

    monkeypatch.setattr(staging, "pinned_empty", no_pinning)
    big = torch.arange(100, dtype=torch.float32, device="cpu")
    flat = {"a.view": big[10:20], "a.t": big.view(10, 10).t(), "b.x": torch.ones(3, dtype=torch.bfloat16)}
    buffers = staging.HostBuffers()
    staged = staging.stage(flat, buffers)
    for key, t in staged.items():
        assert torch.equal(t, flat[key]) and t.is_contiguous() and not t.is_pinned()
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key  # DCP would clone a larger one
    assert buffers.nbytes == sum(t.numel() * t.element_size() for t in flat.values())
    again = staging.stage({**flat, "a.view": big[20:30]}, buffers)
    assert all(again[k].data_ptr() == staged[k].data_ptr() for k in flat)  # reused, not reallocated
    assert torch.equal(again["a.view"], big[20:30])
    staging.stage({"b.x": flat["b.x"]}, buffers)
    assert buffers.nbytes == 6  # the keys no longer staged are released
    buffers.release()
    assert buffers.nbytes == 0


def test_cuda_staging_memory_is_one_exactly_sized_registered_mapping(monkeypatch):
    """The CUDA path's helper, with cudart stood in for (no GPU here): one registration of the exact total, each
    tensor's storage exactly its size, unregistered while the mapping is still held."""
    import ctypes

    import zaya.checkpoint.staging as staging

    calls, arena = [], {}

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            assert arena["a"]._map is not None and ctypes.string_at(ptr, 1) is not None  # still mapped
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    layout = [("a", (3, 5), torch.float32), ("b", (7,), torch.bfloat16), ("c", (2,), torch.int64)]
    arena["a"] = pinned = staging.pinned_empty(layout)
    assert pinned.nbytes == 64 + 64 + 16  # 60 and 14 bytes, each start 64-byte aligned, then 16
    assert calls == [("register", pinned.ptr, pinned.nbytes, 0)]
    for key, shape, dtype in layout:
        t = pinned.tensors[key]
        assert t.shape == shape and t.dtype == dtype and t.data_ptr() % 64 == 0
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        t.fill_(1)
    pinned.release()
    pinned.release()  # idempotent
    assert calls[1:] == [("unregister", pinned.ptr)] and pinned.tensors == {}

    monkeypatch.setattr(FakeCudart, "cudaHostRegister", lambda self, ptr, n, flags: 2)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 60 bytes failed"):
        staging.pinned_empty(layout[:1])


def test_ownership_is_deterministic_size_balanced_and_keeps_unique_keys_and_shards():
    from zaya.checkpoint.staging import assign_owners

    def rows(extra):
        shared = [(f"model.w{i}", "tensor", "torch.float32", (n,), 4 * n) for i, n in enumerate([50, 40, 30, 20, 10])]
        return sorted(shared + extra)

    gathered = [rows([("optim.state.w0.m", "tensor", "torch.float32", (50,), 200),
                      ("model.s", "dtensor", "torch.float32", (8,), 16)]),
                rows([("model.s", "dtensor", "torch.float32", (8,), 16)])]
    plans = [assign_owners(gathered, r) for r in range(2)]
    assert plans[0].owner == plans[1].owner  # every rank computes the same assignment
    owner = plans[0].owner
    assert set(owner) == {f"model.w{i}" for i in range(5)}  # unique keys and DTensor shards: not assigned
    assert plans[0].owns("optim.state.w0.m") and plans[0].owns("model.s") and plans[1].owns("model.s")
    # Rank 0 already writes 216 bytes of its own: the largest replicated tensor goes to rank 1, then each to the
    # less loaded rank (the lower one on a tie).
    assert [owner[f"model.w{i}"] for i in range(5)] == [1, 0, 1, 1, 0]
    assert plans[0].rank_bytes == [216 + 160 + 40, 16 + 200 + 120 + 80] == [416, 416]
    assert plans[0].total_bytes == sum(plans[1].rank_bytes)
    assert [row[0] for row in plans[0].replicated] == sorted(owner)
    assert all(row[4] == [0, 1] for row in plans[0].replicated)


def flip_a_byte(path: Path) -> Path:
    victim = max((f for f in path.iterdir() if f.suffix == ".distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    return victim


def test_flipped_byte_is_detected_and_the_previous_checkpoint_used(tmp_path):
    logs: list[str] = []
    store = store_for(tmp_path, logs, ram_tier=False)
    model, opts = trained(1)
    store.save(1, parts(model, opts), {"step": 1}, blocking=True)
    want = full_state(model, opts)
    train_step(model, opts, 7)
    newest = store.save(2, parts(model, opts), {"step": 2}, blocking=True).path
    victim = flip_a_byte(newest)
    with pytest.raises(CheckpointError, match=f"{victim.name} fails its checksum"):
        store.select(str(newest))  # an explicit path is never replaced by another checkpoint
    chosen = store.select("auto")
    assert chosen.name == "step-00000001"
    assert any("failed verification" in s and victim.name in s for s in logs), logs
    assert (newest.parent / "corrupt-step-00000002").is_dir() and not newest.exists()
    fresh, fresh_opts = make_model(seed=5)
    store.load(chosen, parts(fresh, fresh_opts))
    assert_same(full_state(fresh, fresh_opts), want)


def test_size_only_verification_misses_a_flip_but_catches_truncation(tmp_path):
    store = store_for(tmp_path, ram_tier=False, verify="size")
    model, opts = trained(1)
    path = store.save(1, parts(model, opts), {"step": 1}, blocking=True).path
    flip_a_byte(path)
    assert store.select("auto") == path  # sizes unchanged: "size" trusts it (documented trade-off)
    victim = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 1)
    assert store.select("auto") is None and list_checkpoints(path.parent) == []


def test_no_commit_marker_is_never_loaded(tmp_path):
    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained(1)
    path = store.save(3, parts(model, opts), {"step": 3}, blocking=True).path
    (path / COMMIT).unlink()
    assert store.select("auto") is None
    with pytest.raises(CheckpointError, match="no COMMIT marker"):
        store.select(str(path))


def test_retention_keeps_the_newest_and_every_mth(tmp_path):
    store = store_for(tmp_path, ram_tier=False, keep=2, keep_every=3)
    model, opts = trained(1)
    for step in range(1, 9):
        store.save(step, parts(model, opts), {"step": step}, blocking=True)
    assert [p.name for p in list_checkpoints(store.directory)] == \
        ["step-00000003", "step-00000006", "step-00000007", "step-00000008"]


def test_shape_mismatch_names_the_tensor(tmp_path):
    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained(1)
    path = store.save(1, parts(model, opts), {"step": 1}, blocking=True).path
    other, other_opts = make_model(width=40)
    with pytest.raises(CheckpointError, match=r"model.0.weight has shape \[48, 16\] there, \[40, 16\]"):
        store.load(path, parts(other, other_opts))


# --- async -----------------------------------------------------------------------------------------------------------
def test_async_save_writes_the_state_as_it_was_when_called(tmp_path):
    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained()
    want = full_state(model, opts)
    assert store.save(2, parts(model, opts), {"step": 2}) is None  # async by default: returns once staged
    for _ in range(3):  # training goes on, changing every live tensor while the save may still be writing
        train_step(model, opts, 11)
    out = store.wait()
    assert out.ok and out.asynchronous and out.blocked_seconds <= out.seconds
    fresh, fresh_opts = make_model(seed=3)
    store.load(store.select("auto"), parts(fresh, fresh_opts))
    assert_same(full_state(fresh, fresh_opts), want)


def test_when_busy_skip_and_wait(tmp_path, monkeypatch):
    import threading

    logs: list[str] = []
    store = store_for(tmp_path, logs, ram_tier=False, when_busy="skip")
    model, opts = trained(1)
    gate = threading.Event()
    original = store._write

    def slow_write(*a, **kw):
        gate.wait(30)
        return original(*a, **kw)

    monkeypatch.setattr(store, "_write", slow_write)
    store.save(1, parts(model, opts), {"step": 1})
    assert store.save(2, parts(model, opts), {"step": 2}) is None and any("skipped" in s for s in logs)
    gate.set()
    assert store.wait().step == 1
    store.config.when_busy = "wait"
    gate.clear()
    store.save(3, parts(model, opts), {"step": 3})
    threading.Timer(0.3, gate.set).start()
    store.save(4, parts(model, opts), {"step": 4})  # waits for step 3, then starts step 4
    assert store.last_outcome.step == 3 and store.last_outcome.ok
    store.close()
    assert [p.name for p in list_checkpoints(store.directory)] == ["step-00000001", "step-00000003",
                                                                     "step-00000004"]


EXIT_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from zaya.checkpoint.parts import ModelState, OptimizerState
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import CheckpointConfig
    from zaya.distributed.runtime import Runtime
    root, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward(); opt.step()
    store = CheckpointStore(root + "/checkpoints", CheckpointConfig(ram_tier=False), Runtime(), log=print)
    parts = {"model": ModelState(model), "optim": OptimizerState(model, [opt])}
    store.save(1, parts, {"step": 1}, blocking=True)
    store.save(2, parts, {"step": 2})
    if how == "hard":
        os._exit(0)      # no clean-up at all: the background write dies with the process
    elif how == "close":
        store.close()    # what the trainer does on every exit path
    sys.exit(0)          # plain interpreter exit, no close(): the (non-daemon) save thread finishes first
""")


@pytest.mark.parametrize("how", ["hard", "close", "plain"])
def test_exit_right_after_an_async_save_leaves_a_complete_checkpoint_or_none(tmp_path, how):
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), how], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    ckpts = tmp_path / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-"))
    assert names in (["step-00000001"], ["step-00000001", "step-00000002"])
    if how != "hard":  # a normal exit, with or without close(), lets the save in flight finish
        assert names[-1] == "step-00000002"
    store = CheckpointStore(ckpts, CheckpointConfig(ram_tier=False), Runtime(), log=lambda s: None)
    assert store.select("auto").name == names[-1]  # whatever is there passes verification


# --- failed saves ----------------------------------------------------------------------------------------------------
@pytest.fixture
def file_size_limit():
    """Make writes past 64 KiB fail with EFBIG (SIGXFSZ ignored), as a full disk makes them fail with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(on: bool) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10 if on else soft, hard))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("blocking", [True, False])
def test_failed_save_keeps_the_previous_checkpoint_and_training_goes_on(tmp_path, file_size_limit, blocking):
    logs: list[str] = []
    store = store_for(tmp_path, logs, ram_tier=False)
    model, opts = make_model(width=512)  # about 200 KB of fp32 state per file: past the limit
    train_step(model, opts, 0)
    good = store.save(1, parts(model, opts), {"step": 1}, blocking=True).path
    file_size_limit(True)
    try:
        out = store.save(2, parts(model, opts), {"step": 2}, blocking=blocking)
        out = out if blocking else store.wait()
    finally:
        file_size_limit(False)
    # torch's writer reports the refused write as an opaque RuntimeError; the message adds the free space.
    assert not out.ok and out.error.startswith("rank 0: ") and "MiB free in" in out.error
    assert any("checkpoint of step 2 failed" in s and str(good) in s for s in logs), logs
    assert latest_checkpoint(store.directory) == good and store.select("auto") == good
    assert not list(store.directory.glob(".*partial"))
    assert store.save(3, parts(model, opts), {"step": 3}, blocking=True).ok  # the next save works again


def test_failed_save_stops_when_configured(tmp_path, file_size_limit):
    store = store_for(tmp_path, ram_tier=False, on_error="stop")
    model, opts = make_model(width=512)
    train_step(model, opts, 0)
    file_size_limit(True)
    try:
        with pytest.raises(CheckpointError, match='checkpoint of step 1 failed.*on_error = "stop"'):
            store.save(1, parts(model, opts), {"step": 1}, blocking=True)
    finally:
        file_size_limit(False)


# --- RAM tier --------------------------------------------------------------------------------------------------------
def test_ram_tier_restores_the_same_state_and_only_when_it_matches_the_disk(tmp_path):
    store = store_for(tmp_path)
    model, opts = trained()
    want = full_state(model, opts)
    store.save(2, parts(model, opts), {"step": 2})
    store.wait()
    info = json.loads(store.ram.info_path.read_text())
    assert info["step"] == 2 and store.ram.data_path.is_file()

    fresh, fresh_opts = make_model(seed=42)
    restarted = store_for(tmp_path)  # a new process after a crash
    meta = restarted.load(restarted.select("auto"), parts(fresh, fresh_opts))
    assert meta["loaded_from"] == "ram"
    assert_same(full_state(fresh, fresh_opts), want)
    # The restored tensors are copies, not copy-on-write mappings of the tier's file (which would fault on the
    # first step and pin the file's memory for the whole run).
    import gc

    gc.collect()
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(restarted.ram.data_path) not in maps.read_text()

    # A newer disk checkpoint that the RAM tier does not hold (the tier is never ahead, but can be behind).
    train_step(model, opts, 9)
    no_ram = store_for(tmp_path, ram_tier=False)
    no_ram.save(3, parts(model, opts), {"step": 3}, blocking=True)
    again, again_opts = make_model(seed=1)
    meta = restarted.load(restarted.select("auto"), parts(again, again_opts))
    assert meta["loaded_from"] == "disk" and meta["step"] == 3
    assert_same(full_state(again, again_opts), full_state(model, opts))

    # Saved at another world size: not this rank's shards any more, so disk.
    store.save(4, parts(model, opts), {"step": 4}, blocking=True)
    other = CheckpointStore(store.directory, CheckpointConfig(ram_dir=str(tmp_path / "shm")), Runtime(),
                            parallel="fsdp", log=lambda s: None)
    assert other.load(other.select("auto"), parts(*make_model(seed=2)))["loaded_from"] == "disk"

    store.forget_ram_tier()
    assert not store.ram.directory.exists()


def test_ram_tier_without_room_falls_back_to_disk_with_a_warning(tmp_path, monkeypatch):
    from zaya.checkpoint.ram_tier import RamTier

    monkeypatch.setattr(RamTier, "room_for", lambda self, n: False)
    logs: list[str] = []
    store = store_for(tmp_path, logs)
    model, opts = trained(1)
    assert store.save(1, parts(model, opts), {"step": 1}, blocking=True).ok
    assert any("no room" in s for s in logs) and not store.ram.info_path.exists()
    assert store.load(store.select("auto"), parts(*make_model(seed=3)))["loaded_from"] == "disk"


def test_moved_config_keys_name_their_new_place(tmp_path):
    from zaya.config import ConfigError, load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\ncheckpoint_every = 5\n")
    with pytest.raises(ConfigError, match="'checkpoint_every' has moved: write it as checkpoint.every"):
        load_config(cfg)
    with pytest.raises(ConfigError, match='checkpoint.when_busy = .later.: must be "wait" or "skip"'):
        CheckpointConfig(when_busy="later")


@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_trainer_survives_failing_saves_unless_told_to_stop(tmp_path, micro_config, file_size_limit, on_error):
    """A failed periodic save lets training go on (on_error = "continue") or stops it; the failed final save
    always stops the run (exit 5): a run that saved nothing never ends as finished."""
    from zaya.config import load_config
    from zaya.train.trainer import train

    run = tmp_path / "run"
    config = load_config(micro_config(run), ["train.max_steps=4", "checkpoint.every=2", "train.eval_every=0",
                                             "train.sample_tokens=0", f'checkpoint.on_error="{on_error}"'])
    file_size_limit(True)
    try:
        if on_error == "continue":
            with pytest.raises(CheckpointError, match=r"checkpoint of step 4 failed.*last checkpoint \(final\)"
                                                      r".*no checkpoint at all"):
                train(config, resume="never")
            assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4  # it trained on
        else:
            with pytest.raises(CheckpointError, match='checkpoint of step 2 failed.*on_error = "stop"'):
                train(config, resume="never")
    finally:
        file_size_limit(False)
    assert list_checkpoints(run / "checkpoints") == [] and not list((run / "checkpoints").glob(".*partial"))


# --- review findings: timelines, stale or damaged RAM copies, interrupted swaps, odd failures ------------------------
def test_resuming_from_an_older_checkpoint_abandons_the_newer_ones(tmp_path):
    logs: list[str] = []
    store = store_for(tmp_path, logs, ram_tier=False, keep=2)
    model, opts = trained(1)
    for step in (100, 200, 300):
        store.save(step, parts(model, opts), {}, blocking=True)
    old = store.directory / "step-00000200"
    assert store.select(str(old)) == old
    assert (store.directory / "abandoned-step-00000300").is_dir() and any("abandoned" in s for s in logs)
    for step in (250, 260, 270):  # the new timeline
        store.save(step, parts(model, opts), {}, blocking=True)
    assert [p.name for p in list_checkpoints(store.directory)] == ["step-00000260", "step-00000270"]
    assert store.select("auto").name == "step-00000270"


def test_a_ram_copy_from_another_run_in_the_same_directory_is_never_loaded(tmp_path):
    import shutil

    a, a_opts = trained(2, seed=0)
    store_for(tmp_path).save(2, parts(a, a_opts), {}, blocking=True)  # run A leaves a RAM copy of step 2
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # the run directory is wiped; /dev/shm is not
    b, b_opts = trained(2, seed=1)
    store_for(tmp_path).save(2, parts(b, b_opts), {}, blocking=True, ram_copy=False)  # run B: same step, no RAM copy
    fresh, fresh_opts = make_model(seed=9)
    restarted = store_for(tmp_path)
    assert restarted.load(restarted.select("auto"), parts(fresh, fresh_opts))["loaded_from"] == "disk"
    assert_same(full_state(fresh, fresh_opts), full_state(b, b_opts))


def test_resume_never_clears_the_ram_tier_even_when_it_is_off(tmp_path):
    model, opts = trained(1)
    on = store_for(tmp_path)
    on.save(1, parts(model, opts), {}, blocking=True)
    assert on.ram.info_path.is_file()
    off = store_for(tmp_path, ram_tier=False)
    assert off.select("never") is None
    assert not on.ram.info_path.exists() and not on.ram.data_path.exists()


def test_a_damaged_ram_copy_falls_back_to_disk(tmp_path):
    model, opts = trained(2)
    want = full_state(model, opts)
    store = store_for(tmp_path)
    store.save(2, parts(model, opts), {}, blocking=True)
    # A flipped byte, same size: found by the crc32 recheck (ram_verify), not by the default size check.
    data = bytearray(store.ram.data_path.read_bytes())
    data[len(data) // 2] ^= 0x04
    store.ram.data_path.write_bytes(bytes(data))
    fresh, fresh_opts = make_model(seed=9)
    restarted = store_for(tmp_path, ram_verify=True)
    assert restarted.load(restarted.select("auto"), parts(fresh, fresh_opts))["loaded_from"] == "disk"
    assert_same(full_state(fresh, fresh_opts), want)
    # A copy that cannot even be read (same size, garbage): every rank goes to disk, with a warning.
    store.save(2, parts(model, opts), {}, blocking=True)
    store.ram.data_path.write_bytes(b"\0" * store.ram.data_path.stat().st_size)
    logs: list[str] = []
    again, again_opts = make_model(seed=8)
    restarted = store_for(tmp_path, logs)
    assert restarted.load(restarted.select("auto"), parts(again, again_opts))["loaded_from"] == "disk"
    assert_same(full_state(again, again_opts), want)
    assert any("cannot be read" in s for s in logs) and not store.ram.info_path.exists()
    # A readable copy that does not cover the live state (a tensor missing): disk too, never a partial restore.
    store.save(2, parts(model, opts), {}, blocking=True)
    saved = torch.load(store.ram.data_path, weights_only=True)
    del saved["tensors"]["optim.state.2.weight.exp_avg"]
    torch.save(saved, store.ram.data_path)
    info = json.loads(store.ram.info_path.read_text())
    store.ram.info_path.write_text(json.dumps({**info, "size": store.ram.data_path.stat().st_size}))
    logs.clear()
    third, third_opts = make_model(seed=7)
    restarted = store_for(tmp_path, logs)
    assert restarted.load(restarted.select("auto"), parts(third, third_opts))["loaded_from"] == "disk"
    assert_same(full_state(third, third_opts), want)
    assert any("does not match this run's state (no copy of optim.state.2.weight.exp_avg)" in s for s in logs), logs


def test_a_resave_whose_swap_fails_or_is_cut_short_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    import zaya.core.fsutil as fsutil

    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained(1)
    first = store.save(2, parts(model, opts), {"marker": "first"}, blocking=True).path
    real, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the new directory into place
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", failing_replace)
    out = store.save(2, parts(model, opts), {"marker": "second"}, blocking=True)
    monkeypatch.undo()
    assert not out.ok and json.loads((first / "meta.json").read_text())["marker"] == "first"
    assert store.select("auto") == first
    # A crash between the two renames: only the aside copy is left; the next select puts it back.
    os.replace(first, first.with_name(".step-00000002.old"))
    assert store.select("auto") == first and json.loads((first / "meta.json").read_text())["marker"] == "first"


def test_any_failure_while_committing_is_an_outcome_not_a_crash(tmp_path):
    store = store_for(tmp_path, ram_tier=False)
    model, opts = trained(1)
    out = store.save(1, parts(model, opts), {"not json": {1, 2}}, blocking=True)
    assert not out.ok and "TypeError" in out.error and list_checkpoints(store.directory) == []
    assert not list(store.directory.glob(".*partial"))


def test_a_checkpoint_with_a_malformed_commit_marker_is_damaged_named_and_moved_aside(tmp_path):
    """A COMMIT marker is written last and atomically: one that does not parse, or lists a name outside the
    checkpoint, never comes from a save in progress. Only a directory without a marker is skipped without a word."""
    logs: list[str] = []
    store = store_for(tmp_path, logs, ram_tier=False, keep=10)
    model, opts = trained(1)
    good = store.save(1, parts(model, opts), {}, blocking=True).path
    bodies = {'{"files": ["a", "b"]}': "no 'files' table", '{"files": {"meta.json": true}}': "no valid size",
              '[]': "no 'files' table", "[" * 100_000: "not valid JSON",
              json.dumps({"files": {"/etc/passwd": 10, "meta.json": 1}}): "'/etc/passwd', which is not the name",
              json.dumps({"files": {"../x": 10}}): "'../x', which is not the name"}
    for step, (body, needle) in enumerate(bodies.items(), 2):
        path = store.save(step, parts(model, opts), {}, blocking=True).path
        (path / COMMIT).write_text(body)
        logs.clear()
        assert store.select("auto") == good
        assert any(f"{path} failed verification" in line and needle in line for line in logs), (needle, logs)
        assert (path.parent / f"corrupt-{path.name}").is_dir()


def test_ranks_clearing_their_ram_copies_at_once_do_not_trip_over_the_shared_directory(tmp_path, monkeypatch):
    """At the end of a run every rank of a node clears its copy at the same moment, and the last to find the tier's
    directory empty removes it: possibly while another rank is still listing it for stale pending files."""
    from zaya.checkpoint.ram_tier import RamTier

    directory = tmp_path / "tier"
    first, second = (RamTier(directory, tmp_path / "run", rank, 2, "ddp") for rank in range(2))
    directory.mkdir()
    second.data_path.write_bytes(b"copy")
    second.info_path.write_text("{}")
    listing, removed = os.scandir, []

    def scandir_after_the_other_rank_finished(path="."):
        if Path(path) == directory and not removed:  # the first rank clears (and removes the emptied directory)
            removed.append(True)
            first.clear()
        return listing(path)

    monkeypatch.setattr(os, "scandir", scandir_after_the_other_rank_finished)
    second.clear()
    assert removed and not directory.exists()
