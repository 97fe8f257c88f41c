"""SchedulerConfig: how much one step may hold."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # Plan step N+1 while step N runs (engine/core.py). None: wherever the executor
    # can (mp); True where it cannot is a ConfigError.
    async_scheduling: bool | None = None
    # Decode steps one scheduler output runs back to back (engine/scheduler.py).
    num_scheduler_steps: int = 1
