"""Which cores each CPU rank runs on: `cpu_threads_bind`, in vLLM's syntax.

    "auto"        split the cores this process may use into one contiguous, equal group
                  per rank of this host (no pinning when there are fewer cores than ranks)
    "none"        no pinning; each rank takes cores // ranks threads
    "0-3|4-7"     explicit: one cpu list per rank, separated by "|" (like
                  VLLM_CPU_OMP_THREADS_BIND); a cpu list is "0-3,8,10-11"

Validated by the resolution step (`engine/arg_utils.py`) in the engine process, applied by `CpuPlatform.set_device`
in each rank's process before any compute thread exists, so torch's OpenMP threads
inherit the rank's cores. Pinned ranks of one host never share a core, and two engines
given disjoint binds never share one either.
"""

from __future__ import annotations

import os


class CpuBindError(ValueError):
    """A `cpu_threads_bind` value that cannot be applied; the message names it."""


def allowed_cpus() -> list[int]:
    """The cores this process may run on, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _parse_cpu_list(text: str, spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(v) for v in part.split("-", 1))
                if first > last:
                    raise ValueError
                cpus.update(range(first, last + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise CpuBindError(f"cpu_threads_bind={spec!r}: {part!r} is not a cpu number or range like 0-3") from None
    return cpus


def cpu_binds(spec: str, world_size: int, allowed: list[int]) -> list[set[int]] | None:
    """The core set of each local rank, or None for no pinning. Raises CpuBindError for
    a malformed value, a rank count that does not match, a core this process may not
    use, or two ranks sharing a core."""
    if spec == "none":
        return None
    if spec == "auto":
        if len(allowed) < world_size:
            return None
        per_rank = len(allowed) // world_size
        return [set(allowed[r * per_rank : (r + 1) * per_rank]) for r in range(world_size)]
    groups = [_parse_cpu_list(text, spec) for text in spec.split("|")]
    if len(groups) != world_size:
        raise CpuBindError(f"cpu_threads_bind={spec!r} names {len(groups)} cpu set(s) for {world_size} rank(s); "
                           "give one per rank, separated by '|'")
    for rank, group in enumerate(groups):
        outside = sorted(group - set(allowed))
        if outside:
            raise CpuBindError(f"cpu_threads_bind={spec!r}: rank {rank}'s cpu(s) {outside} are not available to "
                               f"this process (allowed: {allowed})")
        for other in range(rank):
            shared = sorted(group & groups[other])
            if shared:
                raise CpuBindError(f"cpu_threads_bind={spec!r}: ranks {other} and {rank} share cpu(s) {shared}")
    return groups


def spare_cpus(spec: str, world_size: int, allowed: list[int]) -> set[int]:
    """The cores of `allowed` that no local rank runs on under `spec`: none when the ranks
    are not pinned ("none", or "auto" with fewer cores than ranks), since each rank's
    threads then use every core. The engine busy-waits for its ranks only where one is
    left (a spin on a rank's core takes time from that rank). Raises CpuBindError as
    `cpu_binds`."""
    binds = cpu_binds(spec, world_size, allowed)
    return set() if binds is None else set(allowed).difference(*binds)
