"""How tensor parallelism splits a model's dimensions, and the block arithmetic: the one
place each rule is written.

Used by the parallel layers (which shapes their weights take), by the engine's resolution
step (engine/arg_utils.py: to refuse a TP size the model cannot be split by, before any
worker starts), by the KV block manager and the attention backends (`cdiv`: blocks per
sequence). Pure functions of their arguments, importing nothing of ours, so every layer
above may use them.
"""

from __future__ import annotations


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`; ValueError naming `what` unless it divides evenly."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds. When tp_size exceeds the KV heads, each KV head is
    replicated on tp_size // total_num_kv_heads consecutive ranks, one head a rank, so
    a rank always holds at least one. ValueError when neither divides the other."""
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size ({tp_size}) exceeds num_key_value_heads ({total_num_kv_heads}) "
                "but is not a multiple of it, so KV heads cannot be replicated evenly"
            )
        return 1
    return divide(total_num_kv_heads, tp_size, "num_key_value_heads")


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: how many blocks of `denominator` hold `numerator` items."""
    return -(-numerator // denominator)
