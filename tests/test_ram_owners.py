"""The RAM tier's ownership: a private shared-memory directory (another user's, a link or one writable by others is
refused and the store keeps to disk), owner records, the sweep of copies whose runs ended, and a run that ends in
an error no supervisor restarts removing its own copy (a supervised one keeping it for the crash-restart)."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest
import torch

from proc_helpers import ended_process
from zaya.core import procs
from zaya.checkpoint import ram_owners
from zaya.checkpoint.store import CheckpointStore
from zaya.config import CheckpointConfig, load_config
from zaya.distributed.runtime import Runtime


def make_store(tmp_path, run: str = "run", logs: list[str] | None = None, **kw) -> CheckpointStore:
    cfg = CheckpointConfig(ram_dir=str(tmp_path / "shm"), **kw)
    return CheckpointStore(tmp_path / run / "checkpoints", cfg, Runtime(), log=(logs.append if logs is not None
                                                                               else lambda s: None))


class Part:
    def __init__(self):
        self.w = torch.arange(6, dtype=torch.float32)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, state):
        self.w.copy_(state["w"])


def test_the_shared_memory_directory_is_created_private_and_the_copy_names_its_owner(tmp_path):
    store = make_store(tmp_path)
    assert store.save(1, {"p": Part()}, {}, blocking=True).ok
    for path in (tmp_path / "shm", store.ram.directory):
        st = os.lstat(path)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700, (path, oct(st.st_mode))
    owner = json.loads((store.ram.directory / "rank-00000.owner.json").read_text())
    assert owner["process"]["pid"] == os.getpid() and procs.gone(owner["process"]) is False
    from zaya.checkpoint.ram_tier import DEFAULT_DIR

    assert DEFAULT_DIR == f"/dev/shm/zaya-{os.getuid()}"  # per user: no user can take another's name first


@pytest.mark.parametrize("how,why", [("writable by others", "is writable by others (mode 0777)"),
                                     ("another user's", "belongs to user id"),
                                     ("a symbolic link", "is a symbolic link")])
def test_a_shared_memory_directory_that_is_not_the_users_alone_is_refused_and_saves_go_to_disk(tmp_path,
                                                                                                monkeypatch, how, why):
    root = tmp_path / "shm"
    if how == "a symbolic link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    else:
        root.mkdir(mode=0o700)
        if how == "writable by others":
            root.chmod(0o777)
        else:  # this user seen as someone else: the directory's owner differs
            monkeypatch.setattr(ram_owners.os, "getuid", lambda: os.geteuid() + 1)
    before = sorted(p.name for p in root.iterdir())
    logs: list[str] = []
    store = make_store(tmp_path, logs=logs)
    assert store.ram is None
    warning = [s for s in logs if s.startswith("warning: RAM tier off")]
    assert warning and f"{root} {why}" in warning[0] and "checkpoint.ram_dir" in warning[0], logs
    assert store.save(1, {"p": Part()}, {}, blocking=True).ok  # on disk
    store.forget_ram_tier()
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written into it, nothing removed from it


def write_copy(root, name: str, owner: dict | None) -> object:
    directory = root / name
    directory.mkdir(parents=True, mode=0o700)
    (directory / "rank-00000.pt").write_bytes(b"x" * 100)
    if owner is not None:
        (directory / "rank-00000.owner.json").write_text(json.dumps(owner))
    return directory


def test_the_next_store_sweeps_copies_whose_runs_have_ended_and_keeps_the_others(tmp_path):
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    dead, me = ended_process(), procs.record()
    remote = {**dead, "host": socket.gethostname() + "-elsewhere"}
    dirs = {
        "ended": write_copy(root, "ended", {"process": dead, "launcher": None, "supervisor": None}),
        "ended-with-its-launcher": write_copy(root, "ended-l", {"process": dead, "launcher": dead,
                                                                "supervisor": None}),
        "running": write_copy(root, "running", {"process": me, "launcher": None, "supervisor": None}),
        "supervised": write_copy(root, "supervised", {"process": dead, "launcher": None, "supervisor": me}),
        "launcher alive": write_copy(root, "launched", {"process": dead, "launcher": me, "supervisor": None}),
        "another host": write_copy(root, "remote", {"process": remote, "launcher": None, "supervisor": None}),
        "no owner record": write_copy(root, "legacy", None),
    }
    logs: list[str] = []
    store = make_store(tmp_path, logs=logs)
    gone = {k for k, d in dirs.items() if not d.exists()}
    assert gone == {"ended", "ended-with-its-launcher"}, gone
    assert any("removed the RAM-tier copies of 2 ended run(s)" in s for s in logs), logs
    assert store.ram.directory.is_dir()  # its own directory, claimed


def test_remove_takes_a_given_up_runs_directory_only_when_it_is_the_users_alone(tmp_path):
    """What a supervisor that gave a run up calls (its ranks kept their copies for a restart that never comes)."""
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    run = write_copy(root, "given-up", {"process": procs.record(), "launcher": None, "supervisor": procs.record()})
    other = write_copy(root, "open", None)
    os.chmod(other, 0o777)
    assert ram_owners.remove(other) is False and other.is_dir()  # writable by others: never touched
    assert ram_owners.remove(run) is True and not run.exists() and other.is_dir()
    assert ram_owners.remove(run) is False  # gone already


def _fail_at_step(monkeypatch, step: int, exc: BaseException) -> None:
    import zaya.train.step as step_module

    calls, real = {"n": 0}, step_module.clip_gradients

    def clip(params, max_norm, experts=None):
        calls["n"] += 1
        if calls["n"] == step:
            raise exc
        return real(params, max_norm, experts)

    monkeypatch.setattr(step_module, "clip_gradients", clip)


@pytest.mark.parametrize("supervised,error,kept", [
    (False, RuntimeError("a bug"), False),
    (True, RuntimeError("a bug"), True),  # zaya run restarts it: the crash-restart reads the copy
])
def test_a_run_that_ends_in_an_error_no_supervisor_restarts_removes_its_ram_copy(tmp_path, micro_config,
                                                                                   monkeypatch, supervised, error,
                                                                                   kept):
    """(A config or data error ends a supervised run too: restart_expected, below.)"""
    from zaya.train.trainer import train

    for name in ram_owners.SUPERVISOR_ENV:
        monkeypatch.delenv(name, raising=False)
    if supervised:
        me = procs.record()
        monkeypatch.setenv(ram_owners.SUPERVISOR_ENV[0], str(me["pid"]))
        monkeypatch.setenv(ram_owners.SUPERVISOR_ENV[1], repr(me["started"]))
    _fail_at_step(monkeypatch, 3, error)
    run = tmp_path / "run"
    config = load_config(micro_config(run), ["train.max_steps=5", "checkpoint.every=2", "train.eval_every=0",
                                             "train.sample_tokens=0", "checkpoint.async_save=false"])
    with pytest.raises(RuntimeError, match="a bug"):
        train(config, resume="never")
    copies = list((tmp_path / "run.ram").glob("*/rank-00000.pt"))
    assert bool(copies) == kept, copies


def test_restart_expected_follows_the_supervisor_and_torchrun(monkeypatch):
    for name in (*ram_owners.SUPERVISOR_ENV, "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    assert not ram_owners.restart_expected(70)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert ram_owners.restart_expected(70) and not ram_owners.restart_expected(2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert not ram_owners.restart_expected(6)
    dead = ended_process()
    monkeypatch.setenv(ram_owners.SUPERVISOR_ENV[0], str(dead["pid"]))
    monkeypatch.setenv(ram_owners.SUPERVISOR_ENV[1], repr(dead["started"]))
    assert not ram_owners.restart_expected(70)  # its supervisor is gone: nothing will restart it


def test_the_supervisor_variables_are_the_ones_zaya_run_sets():
    from zaya.aegis import lineage

    assert ram_owners.SUPERVISOR_ENV == (lineage.SUPERVISOR_PID_ENV, lineage.SUPERVISOR_START_ENV)
