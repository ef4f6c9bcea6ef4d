"""`zaya.core.balance`: the one greedy assignment gives each former copy's exact answer (Muon ownership, ZeRO-1
owners, a checkpoint's replicated-tensor owners and checksum shares must not change), ties included."""

import random

import pytest

from zaya.core.balance import assign, balance


# The copies as they were, reduced to their arithmetic: optim/muon_distributed.assign (distributed/parallel's
# assign_owners was the same, by parameter size with integer loads), checkpoint/staging.assign_owners and
# checkpoint/commit.share_of_files.
def old_muon(costs, world, load=None):
    load = list(load) if load is not None else [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def old_staging(replicated, load):
    """``replicated``: key -> (nbytes, holder ranks)."""
    owner = {}
    for key in sorted(replicated, key=lambda k: (-replicated[k][0], k)):
        chosen = min(replicated[key][1], key=lambda r: (load[r], r))
        owner[key] = chosen
        load[chosen] += replicated[key][0]
    return owner, load


def old_files(sizes, rank, world_size):
    loads = [0] * world_size
    mine = []
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += size
        if owner == rank:
            mine.append(name)
    return mine


def cases(seed, n=60):
    rng = random.Random(seed)
    for _ in range(n):
        world = rng.randint(1, 9)
        # few distinct values: many ties in cost and in load
        yield rng, world, [rng.choice([1, 2, 3, 4, 8, 16]) * rng.choice([1, 1, 1000])
                           for _ in range(rng.randint(0, 40))]


def test_the_examples_the_old_copies_were_tested_with():
    costs = [8.0, 5.0, 4.0, 3.0, 3.0, 1.0]
    owner = assign(costs, 2)
    assert sorted(sum(c for c, o in zip(costs, owner) if o == r) for r in range(2)) == [12.0, 12.0]
    assert assign([2.0, 2.0], 2, load=[10.0, 0.0]) == [1, 1]  # a fixed load (FSDP experts) is taken into account
    # staging's: rank 0 already writes 216 bytes; sizes 200, 160, 120, 80, 40 held by both ranks
    load = [216, 16]
    got = balance({f"model.w{i}": 4 * n for i, n in enumerate([50, 40, 30, 20, 10])}, load,
                  {f"model.w{i}": [0, 1] for i in range(5)})
    assert [got[f"model.w{i}"] for i in range(5)] == [1, 0, 1, 1, 0] and load == [416, 416]


@pytest.mark.parametrize("seed", range(4))
def test_muon_and_zero1_owners_are_the_old_ones(seed):
    for rng, world, costs in cases(seed):
        floats = [c / 7 for c in costs]
        assert assign(floats, world) == old_muon(floats, world)
        start = [rng.choice([0.0, 1.0, 5.0]) for _ in range(world)]
        assert assign(floats, world, load=start) == old_muon(floats, world, start)
        zero1 = balance(dict(enumerate(costs)), [0] * world)
        assert zero1 == dict(enumerate(old_muon(costs, world)))
        assert list(zero1) == sorted(zero1, key=lambda i: (-costs[i], i))  # given out largest first


@pytest.mark.parametrize("seed", range(4))
def test_checkpoint_owners_and_checksum_shares_are_the_old_ones(seed):
    for rng, world, costs in cases(100 + seed):
        keys = [f"model.layers.{rng.randint(0, 30)}.w{i}" for i in range(len(costs))]
        replicated = {k: (c, sorted(rng.sample(range(world), rng.randint(1, world)))) for k, c in zip(keys, costs)}
        start = [rng.choice([0, 16, 1000]) for _ in range(world)]
        load = list(start)
        got = balance({k: v[0] for k, v in replicated.items()}, load, {k: v[1] for k, v in replicated.items()})
        want, want_load = old_staging(replicated, list(start))
        assert got == want and list(got) == list(want) and load == want_load
        sizes = {f"__{i % 3}_{i}.distcp": c for i, c in enumerate(costs)}
        shares = balance(sizes, [0] * world)
        for rank in range(world):
            assert [name for name, r in shares.items() if r == rank] == old_files(sizes, rank, world)


def test_assign_leaves_the_given_load_alone_and_balance_updates_it():
    start = [3.0, 0.0]
    assert assign([1.0, 1.0, 1.0], 2, start) == [1, 1, 1] and start == [3.0, 0.0]
    load = [0, 0, 0]
    assert balance({"a": 5, "b": 5, "c": 1}, load) == {"a": 0, "b": 1, "c": 2} and load == [5, 5, 1]
