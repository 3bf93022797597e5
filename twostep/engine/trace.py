"""A per-step trace of the engine in Chrome trace-event JSON (opens in Perfetto or
chrome://tracing): one row for the engine's steps, one row per request with its queue,
prefill and decode spans, and counters for KV blocks and batch composition.

The engine calls the tracer only when one is attached, so tracing off costs one
`is None` check per step.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from twostep.outputs import RequestMetrics

_PID = 1
_STEP_TID = 0


@dataclass
class StepTracer:
    origin: float = field(default_factory=time.monotonic)
    events: list[dict] = field(default_factory=list)
    _rows: dict[str, int] = field(default_factory=dict)
    _last_hits: int = 0
    _last_preemptions: int = 0

    def __post_init__(self) -> None:
        self._name_row(_STEP_TID, "engine steps")

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 1)

    def _name_row(self, tid: int, name: str) -> None:
        self.events.append({"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid,
                            "args": {"name": name}})
        self.events.append({"ph": "M", "name": "thread_sort_index", "pid": _PID, "tid": tid,
                            "args": {"sort_index": tid}})

    def _row(self, request_id: str) -> int:
        if request_id not in self._rows:
            self._rows[request_id] = len(self._rows) + 1
            self._name_row(self._rows[request_id], f"request {request_id}")
        return self._rows[request_id]

    def record_step(self, start: float, end: float, scheduled: list[tuple[str, int, int]],
                    blocks_in_use: int, prefix_cache_hits: int, preemptions: int) -> None:
        """scheduled: (request id, prefill tokens, decode tokens) for each request in the step."""
        prefill = sum(p for _, p, _ in scheduled)
        decode = sum(d for _, _, d in scheduled)
        kind = "prefill" if not decode else "decode" if not prefill else "mixed"
        self.events.append({
            "ph": "X", "name": f"step ({kind})", "cat": "step", "pid": _PID, "tid": _STEP_TID,
            "ts": self._us(start), "dur": round((end - start) * 1e6, 1),
            "args": {"prefill_tokens": prefill, "decode_tokens": decode,
                     "requests": [{"id": r, "prefill_tokens": p, "decode_tokens": d}
                                  for r, p, d in scheduled],
                     "kv_blocks_in_use": blocks_in_use,
                     "prefix_cache_hit_tokens": prefix_cache_hits - self._last_hits,
                     "preemptions": preemptions - self._last_preemptions},
        })
        self.events.append({"ph": "C", "name": "batch tokens", "pid": _PID, "ts": self._us(start),
                            "args": {"prefill": prefill, "decode": decode}})
        self.events.append({"ph": "C", "name": "KV blocks in use", "pid": _PID, "ts": self._us(end),
                            "args": {"blocks": blocks_in_use}})
        self._last_hits, self._last_preemptions = prefix_cache_hits, preemptions
        for rid, _, _ in scheduled:
            self._row(rid)

    def record_preemption(self, request_id: str, at: float) -> None:
        """An instant on the request's row: its blocks were freed; it recomputes when readmitted."""
        self.events.append({"ph": "i", "s": "t", "name": "preempted", "cat": "request", "pid": _PID,
                            "tid": self._row(request_id), "ts": self._us(at)})

    def record_request(self, request_id: str, m: RequestMetrics, finish_reason: str | None) -> None:
        """The request's life as spans: queue -> (kv transfer ->) prefill (to its first token) -> decode. A request
        aborted before it was scheduled still gets its queue span, up to its end."""
        tid = self._row(request_id)
        queued_until = m.first_scheduled_time if m.first_scheduled_time is not None else m.finished_time
        spans = [("queue", m.arrival_time, queued_until),
                 # a decode instance of a disaggregated pair: the prompt's KV loaded from the prefill one
                 ("kv transfer", m.kv_load_start_time, m.kv_load_end_time),
                 ("prefill", m.kv_load_end_time or m.first_scheduled_time, m.first_token_time),
                 ("decode", m.first_token_time, m.finished_time)]
        for name, a, b in spans:
            if a is not None and b is not None:
                self.events.append({"ph": "X", "name": name, "cat": "request", "pid": _PID, "tid": tid,
                                    "ts": self._us(a), "dur": round((b - a) * 1e6, 1),
                                    "args": {"prompt_tokens": m.num_prompt_tokens,
                                             "generated_tokens": m.num_generated_tokens,
                                             "cached_tokens": m.num_cached_tokens,
                                             "preemptions": m.num_preemptions,
                                             "finish_reason": finish_reason,
                                             **({"remote_tokens": m.num_remote_tokens,
                                                 "kv_transfer_bytes": m.kv_transfer_bytes}
                                                if name == "kv transfer" else {})}})

    def to_json(self) -> dict:
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))
