"""``python scripts/bench_rpc.py --step-messages [--calls 2000] [--blocks 10] [--warmup 200]``:
what one step's messages cost to cross, new against old, in this process (no engine).

New: ``executor.serial_utils``, the typed MessagePack messages, encoded once (by the
writer) and decoded once (by each reader). Old: the pickling before msgspec, which
``Legacy`` reproduces (each message its class by name and its fields' tuple, rebuilt by
a Python ``__init__``). The cases: a decode step's execute_model request (32 running
requests, one token and 40 blocks each), its reply with and without top-5 logprobs, and
an admission step's request (32 new 128-token prompts, each with its own
SamplingParams). Target: new <= old for a decode step. A hot loop: in a real step the
model code has evicted the caches first, so both take longer there.
"""

from __future__ import annotations

import pickle
import statistics

from bench_common import latencies, load_average, us


class Legacy:
    """The baseline: pickled as the step messages were before msgspec (``__reduce__``: the
    class by name and the fields' tuple), and rebuilt by a Python ``__init__`` as they were."""

    def __init__(self, *fields) -> None:
        self.fields = fields

    def __reduce__(self) -> tuple[type, tuple]:
        return Legacy, self.fields


def step_messages(calls: int, warmup: int, blocks: int) -> None:
    """Time every case, ``calls`` calls each in ``blocks`` blocks alternating new and old
    (after ``warmup`` untimed calls), and print one row per case."""
    from config import SamplingParams
    from executor.rpc import RPCReply, RPCRequest
    from executor.serial_utils import decode_message, encode_message
    from worker.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

    def legacy(obj):  # every Struct in `obj` as a Legacy of its fields
        if hasattr(type(obj), "__struct_fields__"):
            return Legacy(*(legacy(getattr(obj, name)) for name in obj.__struct_fields__))
        return type(obj)(legacy(v) for v in obj) if type(obj) in (list, tuple) else obj

    ids, tokens, blocks = [f"cmpl-{i:032x}-0" for i in range(32)], [1000 + i for i in range(32)], max(1, blocks)
    decode = SchedulerOutput([ScheduledRequest(r, [tokens[i]], 630 + i, list(range(40 * i, 40 * i + 40)), True, None,
                                               100 + i) for i, r in enumerate(ids)], [], 32)
    admit = SchedulerOutput([ScheduledRequest(r, list(range(i, i + 128)), 0, list(range(8 * i, 8 * i + 8)), True,
                                              SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=256), 0)
                             for i, r in enumerate(ids)], [ids[0]], 32 * 128)
    top5 = [{t + k: -0.1 * k - 0.01 for k in range(6)} for t in tokens]
    cases = {"decode step: execute_model request": RPCRequest(7, "execute_model", (decode,), {}, 0, 6),
             "decode step: reply, no logprobs": RPCReply(7, 0, True, ModelRunnerOutput(ids, tokens, [None] * 32)),
             "decode step: reply, 5 logprobs": RPCReply(7, 0, True, ModelRunnerOutput(ids, tokens, top5)),
             "admission step: execute_model request": RPCRequest(8, "execute_model", (admit,), {}, 0, 7)}
    per_block = max(1, calls // blocks)
    print(f"Step messages, microseconds: median of {blocks} blocks of {per_block}, new and old alternating (load "
          f"{load_average()})\n{'message':<40}{'bytes':>7}{'encode':>9}{'decode':>9}{'total':>9}{'old B':>7}"
          f"{'old enc':>9}{'old dec':>9}{'total':>9}{'new/old':>9}")
    for name, new in cases.items():
        new_bytes, old_bytes = encode_message(new), pickle.dumps(old := legacy(new), protocol=5)
        assert decode_message(new_bytes) == new, name
        timed = [lambda m=new: encode_message(m), lambda b=new_bytes: decode_message(b),
                 lambda m=old: pickle.dumps(m, protocol=5), lambda b=old_bytes: pickle.loads(b)]
        samples: list[list[float]] = [[] for _ in timed]
        for _ in range(blocks):
            for fn, out in zip(timed, samples):
                out += latencies(fn, per_block, warmup // blocks)
        enc, dec, old_enc, old_dec = (statistics.median(out) for out in samples)
        print(f"{name:<40}{len(new_bytes):>7}{us(enc)}{us(dec)}{us(enc + dec)}{len(old_bytes):>7}{us(old_enc)}"
              f"{us(old_dec)}{us(old_enc + old_dec)}{(enc + dec) / (old_enc + old_dec):>8.2f}x")


if __name__ == "__main__":
    raise SystemExit(__doc__)  # run through bench_rpc.py, which owns the flags
