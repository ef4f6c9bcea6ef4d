"""Distributed runtime: process groups and the dp x cp mesh (``runtime``), data-parallel wrapping (``parallel``:
DDP, ZeRO-1, FSDP2), context parallelism (``context_parallel``), and start-up checks (``checks``, ``shared_fs``)."""
