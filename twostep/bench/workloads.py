"""Seeded synthetic workloads: token-id prompts and output lengths, reproducible run to run.

Performance does not depend on token values, so prompts are random ids; every request runs
with ignore_eos so its output length is exactly the one drawn.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# nano-vllm's and mini-sglang's shared offline workload: 256 requests, input and output lengths
# uniform in 100..1024, seed 0 (scale it down with num_prompts on a small CPU).
NANO_VLLM = dict(num_prompts=256, input_range=(100, 1024), output_range=(100, 1024), seed=0)


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    after: int | None = None     # the request (an index) that must finish before this one is sent


def fixed(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
          seed: int = 0) -> list[BenchRequest]:
    return uniform(num_prompts, (input_len, input_len), (output_len, output_len), vocab_size, seed)


def uniform(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
            vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Lengths uniform in the inclusive ranges; the same seed gives the same requests."""
    for name, (lo, hi) in (("input", input_range), ("output", output_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {lo}..{hi}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_range)
        n_out = rng.randint(*output_range)
        out.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return out


def long_and_short(num_short: int, short_input: int, short_output: int, num_long: int, long_input: int,
                   long_output: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Short chats with long prompts spread evenly among them (the disaggregation workload: long
    prefills arriving while short requests decode). Order is arrival order."""
    short = fixed(num_short, short_input, short_output, vocab_size, seed)
    long = fixed(num_long, long_input, long_output, vocab_size, seed + 1)
    out: list[BenchRequest] = []
    every = max(num_short // max(num_long, 1), 1)
    for i, request in enumerate(short):
        out.append(request)
        if long and (i + 1) % every == 0:
            out.append(long.pop(0))
    return out + long


def shared_prefix(num_conversations: int, turns: int, system_len: int, turn_len: int, output_len: int,
                  vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Multi-turn chats under one shared system prompt (the prefix-caching workload): conversation c's
    turn k is the system prompt, its first k user turns and k - 1 answers (synthetic, output_len tokens
    each), sent when its turn k - 1 has finished. Conversations are interleaved turn by turn."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(system_len)]
    history = {c: list(system) for c in range(num_conversations)}
    last: dict[int, int] = {}
    out: list[BenchRequest] = []
    for _ in range(turns):
        for c in range(num_conversations):
            history[c] += [rng.randrange(vocab_size) for _ in range(turn_len)]
            out.append(BenchRequest(list(history[c]), output_len, last.get(c)))
            last[c] = len(out) - 1
            history[c] += [rng.randrange(vocab_size) for _ in range(output_len)]
    return out


def nano_vllm(vocab_size: int, num_prompts: int | None = None) -> list[BenchRequest]:
    """The shared workload; num_prompts keeps its first requests (the same ones at any scale)."""
    full = uniform(NANO_VLLM["num_prompts"], NANO_VLLM["input_range"], NANO_VLLM["output_range"],
                   vocab_size, NANO_VLLM["seed"])
    return full[:num_prompts] if num_prompts else full


def parse_range(text: str) -> tuple[int, int]:
    """'100:1024' -> (100, 1024)."""
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"{text!r} is not a range like 100:1024") from None
    return lo, hi
