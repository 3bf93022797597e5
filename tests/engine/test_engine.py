"""The engine end to end: input validation, seeds, stops, streaming, logprobs, metrics."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_for, load_hf, random_prompts
from twostep import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen2")), dtype="float32", kv_cache_memory="8MiB",
               max_model_len=256)


def finish_all(engine, ids):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.mark.parametrize("bad,field", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-2), "logprobs"),
    (dict(logprobs=1.5), "logprobs"), (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=float("nan")), "top_p"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(seed=1.5), "seed"),
    (dict(seed="7"), "seed"), (dict(seed=-1), "seed"), (dict(n=2, temperature=1.0, seed=2**64 - 1), "seed"),
    (dict(max_tokens=2.0), "max_tokens"), (dict(top_k=True), "top_k"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(n=0), "n"),
])
def test_invalid_sampling_values_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_input_is_refused_and_others_finish(llm):
    engine = llm.engine
    good = random_prompts([5, 9], seed=3)
    ids = [engine.add_request(good[0], SamplingParams(temperature=0, max_tokens=8))]
    engine.step()  # the good request is already running when the bad ones arrive
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([5] * 300, SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([5, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="string or a list"):
        engine.add_request(3.5, SamplingParams())
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([5], SamplingParams(stop_token_ids=[10**6], min_tokens=2))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request([5], SamplingParams(logprobs=10**6))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request([5], SamplingParams(prompt_logprobs=21))
    with pytest.raises(ValueError, match="n must be"):
        engine.add_request([5], SamplingParams(n=10**6, temperature=1.0))
    ids.append(engine.add_request(good[1], SamplingParams(temperature=0, max_tokens=8)))
    outs = finish_all(engine, ids)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    engine.scheduler.kv.check_integrity()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_prompt_longer_than_the_whole_cache_is_refused(tiny_model_dir):
    engine = engine_for(tiny_model_dir("qwen2"), num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(list(range(3, 20)), SamplingParams())


def test_generate_rolls_back_when_one_prompt_is_bad(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompt = random_prompts([12], seed=4)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True) for _ in range(4)]
    batch = llm.generate(random_prompts([3, 30, 7, 19], seed=5) + [prompt], others + [params],
                         use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(tiny_model_dir):
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=7, ignore_eos=True)
    prompts = random_prompts([20, 25, 30, 35], seed=6)
    roomy = engine_for(tiny_model_dir("qwen2"))
    tight = engine_for(tiny_model_dir("qwen2"), num_kv_blocks=7, block_size=16)
    a = finish_all(roomy, [roomy.add_request(p, params) for p in prompts])
    b = finish_all(tight, [tight.add_request(p, params) for p in prompts])
    assert tight.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_eos_stops_unless_ignored(tmp_path):
    import json

    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "eos", "qwen2")
    prompt = random_prompts([6], seed=8)[0]
    greedy = engine_for(folder)
    first = finish_all(greedy, [greedy.add_request(prompt, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True))])[0].outputs[0].token_ids
    eos = first[2]   # declare greedy's third token the model's EOS
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (folder / "generation_config.json").write_text(json.dumps(gen))
    engine = engine_for(folder)
    assert eos in engine.eos_token_ids
    run = lambda **kw: finish_all(engine, [engine.add_request(prompt, SamplingParams(  # noqa: E731
        temperature=0, max_tokens=6, **kw))])[0].outputs[0]
    out = run()
    assert out.finish_reason == "stop" and out.token_ids == first[:3]
    assert out.text == engine.tokenizer.decode(first[:2])   # EOS itself is not in the text
    out = run(ignore_eos=True)
    assert out.finish_reason == "length" and out.token_ids == first
    out = run(min_tokens=4)
    assert eos not in out.token_ids[:4] and len(out.token_ids) >= 4


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts([6], seed=8)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    tok = first.outputs[0].token_ids[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.token_ids == [tok]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tok],
                                                min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3 and tok not in out.token_ids[:3]


def test_stop_string_is_cut_and_streamed_deltas_join(llm):
    prompt = random_prompts([10], seed=9)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]   # very likely spans a token boundary
    pieces = []
    final = None
    for out in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])):
        pieces.append(out.outputs[0].delta_text)
        final = out
    cut = text[:text.index(stop)]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == cut
    assert "".join(pieces) == cut


def test_streamed_deltas_join_to_final_text(llm):
    prompt = random_prompts([10], seed=10)[0]
    pieces, final = [], None
    for out in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)):
        pieces.append(out.outputs[0].delta_text)
        final = out
    assert "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].text == llm.tokenizer.decode(final.outputs[0].token_ids)


def test_logprobs_and_prompt_logprobs_match_transformers(tiny_model_dir):
    folder = tiny_model_dir("llama")
    hf = load_hf(folder)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=8)
    prompt = random_prompts([20], seed=11)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):     # chunked over 3 steps of 8 tokens
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        assert len(entry) <= 3
    for j, tok in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[j]
        row = ref[len(prompt) - 1 + j]
        assert entry[tok].rank == 1
        assert abs(entry[tok].logprob - row.max().item()) < 1e-4
        assert set(entry) == set(row.topk(3).indices.tolist())


def test_metrics_are_real(llm):
    out = llm.generate(random_prompts([8], seed=12), SamplingParams(temperature=0, max_tokens=6,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert m.num_prompt_tokens == 8 and m.num_generated_tokens == 6
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.ttft > 0 and m.tpot > 0 and len(m.inter_token_latencies) == 5
    assert abs(m.tpot - sum(m.inter_token_latencies) / 5) < 1e-12


def test_outputs_keep_input_order_and_text_prompts(llm):
    prompts = ["Once upon a time", "What is the capital of France?", "café 🙂"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in prompts]


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)


def test_n_completions_per_prompt(llm):
    prompt = random_prompts([7], seed=13)[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    out = llm.generate([prompt, prompt[:4]], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3]
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    texts = {tuple(c.token_ids) for c in out[0].outputs}
    assert len(texts) > 1, "three seeded samples should not all agree"
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out[0].outputs]
    # streaming: per-completion deltas join to each completion's final text
    joined = ["", "", ""]
    final = None
    for o in llm.stream(prompt, params):
        for c in o.outputs:
            joined[c.index] += c.delta_text
        final = o
    assert joined == [c.text for c in final.outputs]
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


def test_abort_of_a_parent_aborts_every_child(llm):
    engine = llm.engine
    rid = engine.add_request(random_prompts([5], seed=14)[0],
                             SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(rid)
    outs = [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and {c.finish_reason for c in outs[-1].outputs} == {"abort"}
    assert not engine.has_unfinished_requests()


def test_interleaved_streams_each_finish(llm):
    p1, p2 = random_prompts([6, 9], seed=15)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    s1, s2 = llm.stream(p1, params), llm.stream(p2, params)
    first = next(s2)
    rest1 = list(s1)            # runs s1 to its end while s2 is paused
    rest2 = list(s2)
    assert rest1[-1].finished and rest2[-1].finished
    assert "".join(o.outputs[0].delta_text for o in [first] + rest2) == rest2[-1].outputs[0].text
    assert len(rest2[-1].outputs[0].token_ids) == 8


def test_abort_output_is_delivered_by_the_next_step(llm):
    engine = llm.engine
    rid = engine.add_request(random_prompts([5], seed=16)[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request(rid)
    assert engine.has_unfinished_requests(), "the abort's output is still to be returned"
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == rid] == ["abort"]
    assert not engine.has_unfinished_requests()


def test_ids_of_n_children_cannot_collide(llm):
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), request_id="x#0")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6, 7], SamplingParams(n=2, temperature=1.0, max_tokens=3), request_id="x")
    assert "x" not in engine.output_processor.parents and "x#1" not in engine.scheduler.requests
    engine.add_request([5, 6], SamplingParams(max_tokens=3), request_id="req-99")
    finish_all(engine, ["x#0", "req-99"])


def test_a_default_max_model_len_is_lowered_to_what_the_cache_holds(tiny_model_dir):
    # the tiny llama: 512 positions, 2 layers x 2 KV heads x 16 dims x 4 bytes x (K, V) = 512 B/token
    engine = engine_for(tiny_model_dir("llama"), kv_cache_memory=200 * 512)
    assert engine.kv_plan.num_tokens == 192 and engine.max_model_len == 192
    with pytest.raises(ValueError, match="max_model_len is 192"):
        engine.add_request(list(range(3, 200)), SamplingParams())
    with pytest.raises(ValueError, match=r"max_model_len 300 needs 300 tokens of KV cache, but the cache "
                                         r"holds 192.*--kv-cache-memory.*--max-model-len"):
        engine_for(tiny_model_dir("llama"), kv_cache_memory=200 * 512, max_model_len=300)
    exact = engine_for(tiny_model_dir("llama"), num_kv_blocks=4)    # an exact count is taken as it is
    assert exact.max_model_len == 512
