"""What a real cluster run needs, on 2 gloo ranks: a clear failure when the ranks do not share the run directory or
the data, strict device placement and the host-read budget of a step under ZeRO-1 and FSDP2, the (dp, cp) mesh,
and a lost rank reported as a collective error (exit code 6) instead of a hang or a misleading message."""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest

from conftest import MICRO_CONFIG
from dist_helpers import run_ok, run_ranks, strict_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def micro(dataset: str | Path, run_dir: str | Path, **tables) -> "object":
    """The micro config (tests/conftest.py) as a Config, with ``tables`` merged in ({"train": {...}})."""
    from zaya.config import config_from_dict

    data = tomllib.loads(MICRO_CONFIG.format(dataset=dataset, run_dir=run_dir))
    for table, values in tables.items():
        data.setdefault(table, {}).update(values)
    return config_from_dict(data, "micro")


def _outcome(fn):
    from zaya.core.errors import ZayaError

    try:
        fn()
        return "ok"
    except ZayaError as exc:
        return (exc.exit_code, str(exc))


def _sharing(rank: int, world: int, root: str, dataset: str, other: str) -> dict:
    """Each rank works in a directory of its own, like nodes that share no filesystem; relative paths in the config
    then name different directories on the two ranks."""
    from zaya.distributed.runtime import start
    from zaya.train.build import resolve_datasets
    from zaya.train.trainer import _prepare_run_dir

    rt = start(timeout_s=60, startup_timeout_s=60)
    node = Path(root) / f"node{rank}"
    node.mkdir()
    os.chdir(node)
    quiet = lambda s: None  # noqa: E731
    out = {"run_dir": _outcome(lambda: _prepare_run_dir(micro(dataset, "run"), rt, Path("run"), "auto", quiet))}
    absolute = Path(root) / "shared-run"
    out["run_dir_shared"] = _outcome(lambda: _prepare_run_dir(micro(dataset, absolute), rt, absolute, "auto", quiet))
    if rank == 0:  # the dataset exists on "node 0" only
        os.symlink(dataset, node / "data")
    rt.barrier()
    out["data_missing"] = _outcome(lambda: resolve_datasets(micro("data", "run"), rt, quiet))
    if rank == 1:  # now node 1 has an identical copy
        os.symlink(dataset, node / "data")
    rt.barrier()
    local = micro("data", "run", data={"node_local": True})
    out["data_node_local"] = _outcome(lambda: resolve_datasets(local, rt, quiet))
    out["data_shared_path"] = _outcome(lambda: resolve_datasets(micro(dataset, "run"), rt, quiet))
    if rank == 1:  # and now another dataset at the same path
        os.unlink(node / "data")
        os.symlink(other, node / "data")
    rt.barrier()
    out["data_differs"] = _outcome(lambda: resolve_datasets(local, rt, quiet))
    return out


def test_ranks_that_do_not_share_the_run_dir_or_the_data_fail_at_start_up(tmp_path, shakespeare_dataset):
    other = tmp_path / "other"
    shutil.copytree(shakespeare_dataset, other)
    manifest = json.loads((other / "manifest.json").read_text())
    bundle = manifest["splits"]["train"]["bundles"][0]
    bundle["sha256"] = "0" + bundle["sha256"][1:]  # another bundle checksum: another dataset as far as ranks tell
    (other / "manifest.json").write_text(json.dumps(manifest))
    a, b = run_ok(_sharing, 2, str(tmp_path), str(shakespeare_dataset), str(other))
    for key in a:
        assert a[key] == b[key] or (a[key] != "ok" and b[key] != "ok" and a[key][0] == b[key][0]), \
            f"{key}: the ranks disagree: {a[key]} / {b[key]}"
    code, message = a["run_dir"]
    assert code == 2 and "train.run_dir" in message and "not shared" in message and "rank 1" in message
    assert a["run_dir_shared"] == "ok"
    code, message = a["data_missing"]
    assert code == 3 and "rank 1" in message and "data.node_local" in message
    assert a["data_node_local"] == "ok" and a["data_shared_path"] == "ok"
    code, message = a["data_differs"]
    assert code == 3 and "differ" in message and "rank 1" in message


def _strict_step(rank: int, world: int, dataset: str, root: str, mode: str) -> dict:
    from zaya.distributed.runtime import start
    from zaya.train.step import HOST_READS_PER_STEP

    parallel, _, cp = mode.partition("+cp")
    cp = int(cp or 1)
    rt = start(timeout_s=60, startup_timeout_s=60, cp_size=cp)
    assert rt.strict, "ZAYA_STRICT_DEVICES=1 was not picked up"
    # Under cp the two ranks share each sequence, so the same global batch takes twice the accumulation.
    config = micro(dataset, Path(root) / parallel, train={"parallel": parallel, "global_batch_tokens": 512 // cp,
                                                          "dtype": "float32", "context_parallel": cp,
                                                          "context_parallel_method": "ring"},
                   checkpoint={"ram_tier": False})
    record, reads = strict_step(config, rt)
    return {"reads": reads.total, "report": reads.report(), "budget": HOST_READS_PER_STEP,
            "accumulation": record["accumulation"], "loss": record["loss"],
            "mesh": (rt.mesh.mesh_dim_names, rt.dp_size, rt.cp_size, rt.dp_rank)}


@pytest.mark.parametrize("mode", ["zero1", "fsdp", "ddp+cp2"])
def test_a_step_keeps_to_its_host_read_budget_with_strict_devices(tmp_path, shakespeare_dataset, mode):
    results = run_ok(_strict_step, 2, str(shakespeare_dataset), str(tmp_path), mode, env={"ZAYA_STRICT_DEVICES": "1"})
    for rank, v in enumerate(results):
        assert v["accumulation"] == 2
        # The budget (two: the step's scalars, and Muon's drift checks when a matrix takes the Gram path; the micro
        # model has none) holds under ZeRO-1 and FSDP2 as in one process, however many micro-batches.
        assert v["reads"] <= 1 < v["budget"] == 2, v["report"]
        cp = 2 if "+cp2" in mode else 1
        assert v["mesh"] == (("dp", "cp"), 2 // cp, cp, rank // cp)
    assert results[0]["loss"] == results[1]["loss"]


def _lose_a_rank(rank: int, world: int, dataset: str, root: str) -> dict:
    from zaya.train.callbacks import Callback
    from zaya.train.trainer import train

    class DieAtStep2(Callback):
        def on_step_end(self, trainer, record):
            if rank == 1 and record["step"] == 2:
                os._exit(17)  # a rank that dies without a word (an OOM kill, a node gone)

    config = micro(dataset, Path(root) / "run", train={"timeout_s": 30.0, "max_steps": 50, "eval_every": 0},
                   checkpoint={"every": 0, "ram_tier": False})
    train(config, callbacks=[DieAtStep2()])
    return "finished"


def test_a_lost_rank_is_a_collective_error(tmp_path, shakespeare_dataset):
    survivor, lost = run_ranks(_lose_a_rank, 2, str(shakespeare_dataset), str(tmp_path), timeout_s=150)
    assert "exited with code 17" in (lost.error or ""), lost
    assert survivor.exit_code == 6, survivor.error
    assert "another rank died" in survivor.error
