"""Building the trainer's parts from a config and a runtime: the datasets and their loader, the model in its
parallel wrapper, the optimizers. Each builder is collective (every rank calls it) and fails on every rank alike,
naming what is wrong, instead of leaving some ranks waiting in a collective for one that gave up.
"""

from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch

from zaya.config import Config
from zaya.core.hardware import compute_dtype
from zaya.distributed.parallel import Parallel, wrap
from zaya.distributed.runtime import Runtime


def resolve_datasets(config: Config, rt: Runtime, log: Callable[[str], None]) -> dict:
    """data.datasets as opened ``PreparedDataset``s, the same on every rank.

    Shared (default): rank 0 resolves each entry (preparing a builtin corpus into the cache on first use) and every
    rank opens the directories it found. Node-local (``data.node_local``): the first rank of every node resolves
    them itself. Either way every rank's copy must have rank 0's content (``check_same_datasets``).
    """
    from zaya.data.bundle import PreparedDataset
    from zaya.data.cache import resolve_dataset
    from zaya.data.loader import check_vocabulary
    from zaya.distributed.shared_fs import check_same_datasets

    dc, mc = config.data, config.model
    first = rt.is_local_main if dc.node_local else rt.is_main

    def resolve() -> dict[str, str]:
        return {name: str(resolve_dataset(spec, dc.builtin_vocab_size, dc.cache_dir, log=log))
                for name, spec in dc.datasets.items()}

    specs, error = None, None
    if first:
        try:
            specs = resolve()
        except Exception as exc:  # noqa: BLE001 - reported on every rank by agree()
            error = exc
    rt.agree(error, "start-up (resolving data.datasets)")
    if dc.node_local:
        specs = specs if first else resolve()  # the node's first rank has prepared what needed preparing
    else:
        specs = rt.broadcast_object(specs)
    datasets, fingerprints, problem = {}, None, None
    try:
        datasets = {name: PreparedDataset(path) for name, path in specs.items()}
        fingerprints = {name: d.fingerprint() for name, d in datasets.items()}
    except (OSError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    check_same_datasets(rt, fingerprints, problem, dc.node_local)
    for dataset in datasets.values():  # the same data on every rank, so the same verdict
        check_vocabulary(dataset, mc.vocab_size, mc.eos_token_id)
    return datasets


def build_data(config: Config, rt: Runtime, log: Callable[[str], None]):
    """(datasets, the training data loader of this data-parallel rank)."""
    from zaya.data.loader import DataLoader
    from zaya.train.schedule import stages_of

    datasets = resolve_datasets(config, rt, log)
    dc = config.data
    loader = DataLoader(datasets, stages_of(config), rank=rt.dp_rank, world_size=rt.dp_size, seed=dc.seed,
                        document_positions=dc.document_positions, document_mask=dc.document_mask,
                        prefetch=dc.prefetch,
                        pin_memory=rt.device.type == "cuda")
    return datasets, loader


def build_model(config: Config, rt: Runtime, weights_later: bool = False) -> Parallel:
    """The model, built and initialised directly on the runtime's device, in its parallel wrapper.

    ``weights_later`` (the weights come from a checkpoint: ``train.init_from`` or a resume): built on the meta device
    and its tensors allocated without initialisation, after sharding under FSDP2, so that no rank ever holds more
    than its own copy (its shards) of the weights."""
    from zaya.model import ZayaForCausalLM

    tc = config.train
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed)
    dtype = compute_dtype(tc.dtype, rt.device)
    experts = None
    if tc.expert_parallel > 1:
        from zaya.distributed.expert_parallel import ExpertParallel

        experts = ExpertParallel(rt, tc.expert_parallel)
    with torch.device("meta" if weights_later else rt.device):
        model = ZayaForCausalLM(config.model)
    if experts is not None:  # every rank initialised every expert alike; each keeps its own
        experts.shard(model)
    model.activation_checkpointing = tc.activation_checkpointing
    if not weights_later:
        return wrap(model, tc.parallel, rt, dtype, experts)
    sharded = tc.parallel == "fsdp" and rt.distributed
    parallel = wrap(model, tc.parallel, rt, dtype, experts) if sharded else None
    model.to_empty(device=rt.device)
    model.rope.reset_parameters()  # derived from the config, never stored
    return parallel if parallel is not None else wrap(model, tc.parallel, rt, dtype, experts)


def install_sequence_seam(model, config: Config, rt: Runtime) -> None:
    """Under context parallelism (cp > 1), the seam through which the model's attention reaches the other cp
    ranks' tokens (``zaya.distributed.context_parallel``); nothing otherwise."""
    if rt.cp_size == 1:
        return
    from zaya.distributed.context_parallel import ContextParallelSequence, CPGroup

    cp = CPGroup(rt.cp_group, rt.cp_rank, rt.cp_size)
    model.set_sequence_seam(ContextParallelSequence(cp, config.train.context_parallel_method))


def build_optimizers_for(config: Config, parallel: Parallel) -> list[torch.optim.Optimizer]:
    """Muon + AdamW over the parameters this rank steps (its own subset under zero1)."""
    from zaya.optim.build import ParamSplit, build_optimizers, split_parameters

    split = split_parameters(parallel.model, config.optim.muon)
    owned = ParamSplit(parallel.owned(split.muon), parallel.owned(split.adamw_decay),
                       parallel.owned(split.adamw_no_decay))
    ep = parallel.experts
    if ep is not None:  # the expert shards' Muon: under ddp and fsdp its work split over their replicas only
        shards = {id(p) for p in ep.params}
        owned.muon_shards = [(n, p) for n, p in owned.muon if id(p) in shards]
        owned.muon = [(n, p) for n, p in owned.muon if id(p) not in shards]
    return build_optimizers(owned, config.optim, replica_group=parallel.replica_group,
                            shard_group=ep.replica_group if ep is not None and parallel.mode != "zero1" else None)
