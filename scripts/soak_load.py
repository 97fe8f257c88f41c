"""The load of scripts/soak.py: the planned requests and the HTTP client that sends them,
cuts some of them off, and records what each one saw.

Imported by bare name from soak.py (scripts/ is not a package); not a script of its own:
`python scripts/soak.py --help` says how to run the soak and what the load is.

`make_plans` draws every request up front from one seeded `random.Random`, so a seed
gives the same load. `drive` runs them on one asyncio event loop (soak.py's main
thread, under `asyncio.run`); each `Plan.outcome` is written by that loop only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from soak_server import rss_by_process, tree_rss

WORDS = ("the quick brown fox jumps over lazy dog once upon a time there was little model that "
         "learned to count numbers stars moon sea people stories morning school children").split()
# Conservative tokens per word for the tiny byte-level tokenizer (and any real one), so that
# prompt + max_tokens stays under max_model_len without tokenizing here.
TOKENS_PER_WORD = 8


@dataclass
class Outcome:
    kind: str  # "complete" | "cancel" | "disconnect"
    stream: bool
    chat: bool
    max_tokens: int
    status: str = "pending"  # completed | cut_off | failed
    saw_output: bool = False  # the server surely accepted it (a stream event or a response)
    error: str = ""


@dataclass
class Plan:
    at: float
    body: dict[str, Any]
    outcome: Outcome
    cut_after: float = 0.0  # cancel: seconds after sending; disconnect: events to read
    events: int = 0


def make_plans(args: argparse.Namespace, max_model_len: int, chat: bool, rng: random.Random) -> list[Plan]:
    """`args.requests` plans arriving over `args.duration` s (Poisson, re-scaled to end on
    time), each fitted under `max_model_len`; chat completions only if `chat`."""
    gaps = [rng.expovariate(1.0) for _ in range(args.requests)]
    scale = args.duration / sum(gaps) if sum(gaps) else 0.0
    plans, t = [], 0.0
    for gap in gaps:
        words = rng.randint(1, args.max_prompt_words)
        budget = max_model_len - words * TOKENS_PER_WORD - 8
        if budget < 1:
            words = max(1, (max_model_len - 16) // TOKENS_PER_WORD)
            budget = max(1, max_model_len - words * TOKENS_PER_WORD - 8)
        max_tokens = rng.randint(1, max(1, min(args.max_tokens, budget)))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        roll = rng.random()
        kind = ("cancel" if roll < args.cancel_fraction
                else "disconnect" if roll < args.cancel_fraction + args.disconnect_fraction else "complete")
        if kind == "cancel":
            # As long as the prompt allows, so that the cut (within 0.1 s) falls while it still
            # runs however fast the engine is: a short one cut after a random half second
            # mostly finished first once steps took ~1 ms.
            max_tokens = budget
        stream = True if kind == "disconnect" else rng.random() < args.stream_fraction
        use_chat = chat and rng.random() < 0.2
        body: dict[str, Any] = {"model": "soak", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                                "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1 << 30)}
        if use_chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
            if stream and kind == "disconnect":
                body["logprobs"] = 0  # every token makes an event, so "after N events" is mid-stream
        t += gap * scale
        plan = Plan(t, body, Outcome(kind, stream, use_chat, max_tokens))
        if kind == "cancel":
            plan.cut_after = rng.uniform(0.01, 0.1)
        elif kind == "disconnect":
            plan.events = rng.randint(1, max(1, max_tokens // 2))
        plans.append(plan)
    return plans


async def run_one(http: httpx.AsyncClient, url: str, plan: Plan) -> None:
    """Send `plan`, cutting it off as planned; never raises: a transport error or any
    surprise marks the outcome failed."""
    out = plan.outcome
    path = "/v1/chat/completions" if out.chat else "/v1/completions"
    try:
        if out.kind == "cancel":
            task = asyncio.ensure_future(_request(http, url + path, plan))
            done, _ = await asyncio.wait({task}, timeout=plan.cut_after)
            if not done:
                task.cancel()  # closes the connection: the server must abort the request
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                out.status = "cut_off" if out.status == "pending" else out.status
                return
            task.result()
            return
        await _request(http, url + path, plan)
    except Exception as e:  # noqa: BLE001 - any transport error or surprise is a lost request
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"


async def _request(http: httpx.AsyncClient, url: str, plan: Plan) -> None:
    out = plan.outcome
    if not out.stream:
        response = await http.post(url, json=plan.body)
        out.saw_output = True
        if response.status_code != 200:
            out.status, out.error = "failed", f"HTTP {response.status_code}: {response.text[:200]}"
            return
        choice = response.json()["choices"][0]
        ok = choice.get("finish_reason") in ("length", "stop")
        out.status, out.error = ("completed", "") if ok else ("failed", f"finish_reason {choice.get('finish_reason')}")
        return
    async with http.stream("POST", url, json=plan.body) as response:
        if response.status_code != 200:
            out.status, out.error = "failed", f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        events, finish, done = 0, None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                out.status, out.error = "failed", f"stream error: {payload['error']}"
                return
            out.saw_output = True
            events += 1
            for choice in payload.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            if out.kind == "disconnect" and events >= plan.events and finish is None:
                out.status = "cut_off"  # leaving the block closes the connection mid-stream
                return
        if done and finish in ("length", "stop"):
            out.status = "completed"
        else:
            out.status, out.error = "failed", f"stream ended without [DONE] or finish_reason ({finish}, {done})"


async def drive(args: argparse.Namespace, url: str, plans: list[Plan], pid: int | None,
                warmup_done: asyncio.Event, rss: dict[str, Any]) -> None:
    """Run every plan at its time, at most `args.concurrency` at once. With a server
    `pid`: its tree's RSS into `rss` after the warm-up share of the requests ("warm",
    "warm_by_process", "warm_at_request") and every 5 s ("samples")."""
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    gate = asyncio.Semaphore(args.concurrency)
    finished = 0
    warmup_n = max(1, int(len(plans) * args.warmup_fraction))
    start = time.monotonic()

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as http:
        async def one(plan: Plan) -> None:
            nonlocal finished
            delay = start + plan.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                await run_one(http, url, plan)
            finished += 1
            if finished == warmup_n and pid is not None:
                rss["warm"] = tree_rss(pid)
                rss["warm_by_process"] = rss_by_process(pid)
                rss["warm_at_request"] = finished
                warmup_done.set()

        async def sample() -> None:
            while True:
                await asyncio.sleep(5)
                if pid is not None:
                    rss["samples"].append(tree_rss(pid))

        sampler = asyncio.ensure_future(sample())
        try:
            await asyncio.gather(*(one(p) for p in plans))
        finally:
            sampler.cancel()


if __name__ == "__main__":
    print(__doc__)
