"""Distributed runtime: process groups, data-parallel wrapping (DDP, ZeRO-1, FSDP2)."""
