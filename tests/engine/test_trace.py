"""The per-step trace: valid Chrome trace-event JSON, consistent with RequestOutput metrics."""
from __future__ import annotations

import json

from conftest import engine_for, random_prompts
from twostep import SamplingParams


def test_trace_matches_the_run(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir("llama"), max_num_batched_tokens=16)
    tracer = engine.enable_tracing()
    prompts = random_prompts([5, 30, 12], seed=21)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
           for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    path = tmp_path / "trace.json"
    tracer.write(path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for e in events:
        assert e["ph"] in ("X", "M", "C", "i") and "pid" in e and "name" in e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], (int, float))
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == engine.scheduler.stats.num_steps
    per_request: dict[str, list[int]] = {}
    for step in steps:
        args = step["args"]
        assert args["prefill_tokens"] + args["decode_tokens"] <= 16
        for r in args["requests"]:
            tot = per_request.setdefault(r["id"], [0, 0])
            tot[0] += r["prefill_tokens"]
            tot[1] += r["decode_tokens"]
    origin = tracer.origin
    for rid, p in zip(ids, prompts):
        out = done[rid]
        assert per_request[rid] == [len(p), len(out.outputs[0].token_ids) - 1]
        spans = {e["name"]: e for e in events if e.get("cat") == "request"
                 and e["args"]["prompt_tokens"] == len(p)}
        assert set(spans) == {"queue", "prefill", "decode"}
        m = out.metrics
        prefill_end = (spans["prefill"]["ts"] + spans["prefill"]["dur"]) / 1e6 + origin
        assert abs(prefill_end - m.first_token_time) < 1e-3
        assert spans["decode"]["args"]["generated_tokens"] == 6
        assert spans["queue"]["ts"] <= spans["prefill"]["ts"] <= spans["decode"]["ts"]
    rows = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "engine steps" in rows and {f"request {i}" for i in ids} <= rows


def test_tracing_is_off_by_default(tiny_model_dir):
    engine = engine_for(tiny_model_dir("llama"))
    assert engine.tracer is None


def test_cli_writes_a_trace(tiny_model_dir, tmp_path, capsys):
    from twostep.cli import main

    path = tmp_path / "t.json"
    assert main(["generate", "--model", str(tiny_model_dir("llama")), "--max-tokens", "3",
                 "--kv-cache-memory", "2MiB", "--trace", str(path), "hello"]) == 0
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("cat") == "step" for e in events)


def test_trace_marks_preemptions_and_requests_aborted_while_waiting(tiny_model_dir):
    engine = engine_for(tiny_model_dir("llama"), num_kv_blocks=8, max_num_batched_tokens=48, max_num_seqs=4)
    tracer = engine.enable_tracing()
    prompts = random_prompts([30, 35, 40, 45, 50], seed=22)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
           for p in prompts]
    engine.abort_request(ids[-1])      # never scheduled
    while engine.has_unfinished_requests():
        engine.step()
    events = tracer.events
    preemptions = [e for e in events if e["name"] == "preempted"]
    assert len(preemptions) == engine.scheduler.num_preemptions > 0
    aborted_row = {e["tid"] for e in events if e["ph"] == "M" and e["args"].get("name") == f"request {ids[-1]}"}
    spans = [e for e in events if e.get("cat") == "request" and e["ph"] == "X" and e["tid"] in aborted_row]
    assert [e["name"] for e in spans] == ["queue"] and spans[0]["args"]["finish_reason"] == "abort"
