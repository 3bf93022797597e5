"""Speculative decoding: lossless under greedy (token-identical) and sampling (the target's
distribution), inside continuous batching, with rollback and exact accounting."""
from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest
import torch

from conftest import (GREEDY, engine_for, load_hf, make_tiny_model, nan_filled_kv_cache, random_prompts,
                      run_all)
from twostep import SamplingParams
from twostep.sample.sampler import Sampler, SamplingRow
from twostep.config import SpeculativeConfig
from twostep.spec_decode.ngram import NgramProposer
from twostep.sample.rejection_sampler import DraftRow, RejectionSampler

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def noisy_copy(folder: Path, dest: Path, noise: float, seed: int = 0) -> Path:
    """The model in folder with Gaussian noise (noise x each tensor's std) on every weight: a
    draft that agrees with it often but not always."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(dest / "model.safetensors")
    for name, t in tensors.items():
        if t.dim() > 1:
            t += torch.randn(t.shape, generator=g) * t.std() * noise
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def shallow_draft(tiny_model_dir, tmp_path_factory):
    """The tiny llama with noisy weights: same vocabulary, agrees with the target often."""
    return noisy_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("draft") / "m", 0.03)


def draft_config(path, k=4):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def spec_counts(engine) -> dict:
    stats = engine.get_stats()
    return {k: stats[f"spec_decode_{k}"] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


# ---- configuration ----------------------------------------------------------------------------

def test_config_parses_vllm_json_and_rejects_bad_input():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 5, 3, 2)
    assert SpeculativeConfig.parse({"model": "m"}).method == "draft_model"   # vLLM: a model alone
    assert SpeculativeConfig.parse(None) is None
    for bad, words in [('{"method": "eagle"}', "method"), ("{not json", "JSON"),
                       ('{"method": "ngram", "k": 2}', "unknown"), ('{"method": "draft_model"}', "model"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
                       ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup"),
                       ("[1]", "object")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


def test_cli_short_flags_lay_over_the_json():
    import argparse

    from twostep.cli import add_engine_args, engine_config_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    c = engine_config_from(p.parse_args(["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 5}',
                                         "--num-speculative-tokens", "7"])).speculative_config
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max) == ("ngram", 7, 5)
    c = engine_config_from(p.parse_args(["--speculative-model", "/m"])).speculative_config
    assert (c.method, c.model) == ("draft_model", "/m")
    assert engine_config_from(p.parse_args([])).speculative_config is None


# ---- proposers and the rejection rule ---------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(SpeculativeConfig("ngram", prompt_lookup_max=3, prompt_lookup_min=2))
    assert p.lookup([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 4) == [4, 5, 9, 9]        # longest n first
    assert p.lookup([7, 8, 1, 7, 8, 2, 5, 7, 8], 2) == [2, 5]                # the latest match
    assert p.lookup([9, 9, 1, 2, 3, 4, 9, 9, 9], 3) == [1, 2, 3]             # one with k followers
    assert p.lookup([5, 1, 2, 3, 9, 9, 9], 3) == [9]                         # else the latest
    assert p.lookup([1, 2, 3, 4], 3) == []                                   # nothing recurs
    assert p.lookup([5, 5], 3) == []                                         # shorter than n + 1
    assert p.lookup([1, 2, 1, 2], 0) == []


def test_greedy_verification_accepts_the_agreeing_prefix_then_the_targets_token():
    vocab = 10
    logits = torch.full((4, vocab), -5.0)
    for pos, best in enumerate([3, 4, 7, 1]):       # the target's argmax at each position
        logits[pos, best] = 5.0
    greedy = SamplingRow(SamplingParams(temperature=0), [0], [])
    rs = RejectionSampler(Sampler(torch.Generator().manual_seed(0)))
    out = rs(torch.cat([logits, logits, logits[:2]]),
             [DraftRow(greedy, [3, 4, 7]), DraftRow(greedy, [3, 9, 7]), DraftRow(greedy, [8])])
    assert [(v.token_ids, v.num_accepted) for v in out] == [([3, 4, 7, 1], 3), ([3, 4], 1), ([3], 0)]


def _tv(counts: collections.Counter, p: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(i, 0) / n - float(p[i])) for i in range(len(p)))


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_emits_the_targets_distribution(with_draft_probs):
    """Whatever the draft proposes, the first emitted token follows p_1, and a bonus token after
    all-accepted drafts follows p_{k+1}."""
    torch.manual_seed(0)
    vocab, trials = 6, 4000
    target_logits = torch.randn(3, vocab) * 1.5       # positions 1, 2 and the bonus
    p = target_logits.softmax(-1)
    q = (torch.randn(2, vocab) * 1.5).softmax(-1)     # a draft that disagrees with the target
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(trials):
        if with_draft_probs:
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            rows.append(DraftRow(SamplingRow(SamplingParams(temperature=1.0), [0], []), drafts, q))
        else:   # n-gram: a fixed guess (a point mass), here the target's likeliest tokens
            guess = target_logits[:2].argmax(-1).tolist()
            rows.append(DraftRow(SamplingRow(SamplingParams(temperature=1.0), [0], []), guess))
    out = RejectionSampler(Sampler(torch.Generator().manual_seed(2)))(target_logits.repeat(trials, 1), rows)
    first = collections.Counter(v.token_ids[0] for v in out)
    assert _tv(first, p[0]) < 0.03, (first, p[0])
    bonus = collections.Counter(v.token_ids[2] for v in out if v.num_accepted == 2)
    assert sum(bonus.values()) > 100
    assert _tv(bonus, p[2]) < 0.1
    rate = sum(v.num_accepted for v in out) / (2 * trials)
    assert 0.05 < rate < 0.9, rate                    # both branches were exercised


# ---- greedy: token-identical to decoding without speculation ---------------------------------

@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_greedy_is_token_identical_across_batch_mixes_and_budgets(reference, shallow_draft, method):
    folder, prompts, expected = reference
    spec = {"ngram": NGRAM, "draft": draft_config(shallow_draft), "self": draft_config(folder, 3)}[method]
    for budget in (7, 2048):          # 7: drafts are cut to fit beside prefill chunks
        engine = engine_for(folder, speculative_config=spec, max_num_batched_tokens=budget)
        outs = run_all(engine, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected
        counts = spec_counts(engine)
        assert counts["num_drafts"] > 0 and counts["num_accepted_tokens"] > 0
        if method == "self":           # the target is its own draft: every draft is accepted
            assert counts["num_accepted_tokens"] == counts["num_draft_tokens"]
        else:                          # both outcomes happened
            assert counts["num_accepted_tokens"] < counts["num_draft_tokens"]
        per_request = [o.metrics.spec_decode for o in outs]
        assert sum(s.num_accepted_tokens for s in per_request) == counts["num_accepted_tokens"]
        assert sum(s.num_drafts for s in per_request) == counts["num_drafts"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_is_token_identical_under_preemption(reference, shallow_draft, method):
    folder, prompts, expected = reference
    spec = NGRAM if method == "ngram" else draft_config(shallow_draft)
    engine = engine_for(folder, speculative_config=spec, block_size=16, num_kv_blocks=10,
                        max_num_batched_tokens=48)
    outs = run_all(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_greedy_is_token_identical_with_prefix_cache_hits_and_8bit_kv(tiny_model_dir, shallow_draft,
                                                                      kv_cache_dtype):
    """Shared prefixes hit cached blocks; with speculation only verified tokens are ever cached,
    so a later request reusing them generates what it would have without speculation."""
    folder = tiny_model_dir("llama")
    shared = random_prompts([40], seed=5)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 17, 5], seed=6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = engine_for(folder, kv_cache_dtype=kv_cache_dtype, block_size=4)
    expected = [o.outputs[0].token_ids for o in run_all(plain, prompts, params)]
    for spec in (NGRAM, draft_config(shallow_draft)):
        engine = engine_for(folder, kv_cache_dtype=kv_cache_dtype, block_size=4, speculative_config=spec)
        first = run_all(engine, prompts[:1], params)      # fills the cache, generated tokens too
        rest = run_all(engine, prompts[1:] + [prompts[0]], params)
        assert [o.outputs[0].token_ids for o in first + rest] == expected + expected[:1]
        assert all(o.num_cached_tokens >= 40 for o in rest)
        assert rest[-1].num_cached_tokens > len(prompts[0]) - 4   # its own prompt, cached
        assert spec_counts(engine)["num_accepted_tokens"] > 0


def test_rejected_slots_are_released_and_never_cached(reference):
    folder, prompts, _ = reference
    engine = engine_for(folder, speculative_config={**NGRAM, "num_speculative_tokens": 8}, block_size=2)
    for p in prompts:
        engine.add_request(p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.kv.check_integrity()
        for request in engine.scheduler.running:
            # After a step a request holds blocks for its computed tokens (plus at most the
            # block its next token goes to), never for rejected drafts.
            held = engine.scheduler.kv.num_blocks_of(request.request_id)
            assert held <= engine.scheduler.kv.blocks_needed(request.num_computed_tokens + 1)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


# ---- stops and limits apply to accepted tokens in order -----------------------------------------

def test_no_token_after_a_stop_or_past_max_tokens_leaks(tiny_model_dir, shallow_draft):
    folder = tiny_model_dir("llama")
    prompts = random_prompts([12, 30], seed=9)
    plain = engine_for(folder)
    free_run = [o.outputs[0] for o in run_all(plain, prompts, SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True))]
    for spec in (NGRAM, draft_config(folder, 4)):
        engine = engine_for(folder, speculative_config=spec)
        for ref, prompt in zip(free_run, prompts):
            stop_token = ref.token_ids[9]
            cut = ref.token_ids.index(stop_token) + 1
            out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                           stop_token_ids=[stop_token]))[0].outputs[0]
            assert (out.token_ids, out.finish_reason, out.stop_reason) == (ref.token_ids[:cut], "stop",
                                                                           stop_token)
            for n in (1, 2, 5, 13):
                out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=n,
                                                               ignore_eos=True))[0].outputs[0]
                assert out.token_ids == ref.token_ids[:n] and out.finish_reason == "length"
            stop_text = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
            if stop_text.strip():
                out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                               stop=[stop_text]))[0].outputs[0]
                assert out.text == ref.text[:ref.text.index(stop_text)] and out.finish_reason == "stop"


def test_logprobs_are_reported_for_every_emitted_token(reference):
    folder, prompts, expected = reference
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    plain = run_all(engine_for(folder), prompts[:3], params)
    spec = run_all(engine_for(folder, speculative_config=NGRAM), prompts[:3], params)
    for a, b in zip(plain, spec):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(lb) == len(b.outputs[0].token_ids) == 32
        for pa, pb in zip(la, lb):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 and pa[t].rank == pb[t].rank for t in pa)


# ---- sampling: the output distribution is exactly the target's -----------------------------------

def test_sampled_tokens_follow_the_targets_distribution(tmp_path):
    """On an 8-token vocabulary, the second generated token (the first one that verification
    decides) is distributed as the target's marginal sum_t1 p(t1) p(t2 | t1), though the draft
    (a noisy copy of the target) proposes from a clearly different distribution."""
    vocab, n = 8, 3000
    target = make_tiny_model(tmp_path / "target", "llama", vocab_size=vocab, initializer_range=0.5)
    draft = noisy_copy(target, tmp_path / "draft", 0.05)
    prompt = [3, 7, 6, 5]

    def marginal(folder):
        hf = load_hf(folder)
        with torch.no_grad():
            p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
            p2_given = hf(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].softmax(-1)
        return p1 @ p2_given

    target_marginal = marginal(target)
    assert 0.5 * (marginal(draft) - target_marginal).abs().sum() > 0.1, "the draft should disagree"
    engine = engine_for(target, speculative_config=draft_config(draft, 2), max_num_seqs=256)
    outs = run_all(engine, [prompt] * n, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
                   check_every_step=False)
    second = collections.Counter(o.outputs[0].token_ids[1] for o in outs)
    counts = spec_counts(engine)
    assert _tv(second, target_marginal) < 0.04, (_tv(second, target_marginal), sorted(second.items()))
    assert 0.2 < counts["num_accepted_tokens"] / counts["num_draft_tokens"] < 0.9, counts


def test_seeded_sampling_with_speculation_is_reproducible(reference, shallow_draft):
    folder, prompts, _ = reference
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3)
    runs = [[o.outputs[0].token_ids for o in run_all(
        engine_for(folder, speculative_config=draft_config(shallow_draft)), prompts[:2], params)]
        for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=200)
    with pytest.raises(ValueError, match="vocabulary"):
        engine_for(tiny_model_dir("llama"), speculative_config=draft_config(other))


# ---- real models ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_as_its_own_draft_has_every_draft_accepted(dtype):
    from conftest import stories_path
    from twostep import LLM

    path = str(stories_path())
    prompts = ["Once upon a time", "Lily and Ben went to the park", "The little dog"]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(path, dtype=dtype).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, dtype=dtype, speculative_config=draft_config(path, 4))
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 100
    assert stats["spec_decode_acceptance_rate"] == 1.0
    if dtype == "float32":   # bf16 is exact per path, not across batch shapes (README: dtype auto)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_ngram_pays_on_an_input_grounded_prompt_with_the_default_model():
    from conftest import smollm_path
    from twostep import LLM

    text = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night "
            "its lamp turned slowly, sending a beam across the dark water so that ships could find their way home.")
    chat = [{"role": "user", "content": "Repeat the following text exactly:\n\n" + text}]
    params = SamplingParams(temperature=0, max_tokens=64)
    path = str(smollm_path())
    # the default int8 activations in decode rows, verified drafts' rows included: the same tokens
    exact = dict(dtype="float32")
    plain = LLM(path, **exact).chat(chat, params, use_tqdm=False)[0]
    llm = LLM(path, **exact, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = llm.chat(chat, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert text[:60] in out.outputs[0].text
    spec = out.metrics.spec_decode
    assert spec.acceptance_rate > 0.5 and spec.mean_acceptance_length > 2.5, spec


# ---- entry points -------------------------------------------------------------------------------

def test_cli_summary_reports_acceptance(tiny_model_dir, capsys):
    from twostep.cli import main

    rc = main(["generate", "--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--kv-cache-memory",
               "4MiB", "--max-tokens", "24", "--ignore-eos", "--speculative-method", "ngram",
               "--num-speculative-tokens", "3", "--prompt-lookup-min", "1", "Once upon a time"])
    assert rc == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "generated 24 tok" in summary and "spec: " in summary and "drafts accepted" in summary
    assert main(["generate", "--model", str(tiny_model_dir("llama")), "--speculative-config", "{bad",
                 "hi"]) == 2


def test_server_streams_speculative_output_and_exports_vllm_counters(tiny_model_dir, tmp_path):
    import httpx

    from conftest import MODEL, Server, metric, scrape, stream_post, stream_text, tokenize

    folder = tiny_model_dir("qwen2")
    server = Server(folder, tmp_path, "--speculative-config", '{"method": "draft_model", "model": "%s", '
                    '"num_speculative_tokens": 3}' % folder)
    try:
        fams = scrape(server)
        assert metric(fams, "twostep:spec_decode_num_drafts") == 0
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "temperature": 0,
                "ignore_eos": True}
        plain = run_all(engine_for(folder), [tokenize(server, body["prompt"])["tokens"]],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
        chunks = stream_post(server.url("/v1/completions"), {**body, "stream": True})
        assert stream_text(chunks, chat=False) == {0: plain}
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=60).json()
        assert r["choices"][0]["text"] == plain and r["usage"]["completion_tokens"] == 30
        fams = scrape(server)
        drafts, drafted, accepted = (metric(fams, "twostep:spec_decode_" + n)
                                     for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        assert drafts > 0 and accepted == drafted       # the target is its own draft
        assert sum(metric(fams, "twostep:spec_decode_num_accepted_tokens_per_pos", position=str(i))
                   for i in range(3)) == accepted
    finally:
        assert server.terminate() == 0



def test_bench_reports_speculation_counters_of_the_run(tiny_model_dir):
    from twostep import LLM
    from twostep.bench.cli import _report
    from twostep.bench.offline import run_throughput
    from twostep.bench.workloads import fixed

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", speculative_config=NGRAM)
    result = run_throughput(llm, fixed(4, 16, 24, 384, 0), use_tqdm=False).as_dict()
    again = run_throughput(llm, fixed(4, 16, 24, 384, 0), use_tqdm=False).as_dict()
    spec, stats = again["spec_decode"], llm.get_stats()
    assert spec["num_drafts"] > 0 and spec == result["spec_decode"]   # per run, not since start
    assert 2 * spec["num_accepted_tokens"] == stats["spec_decode_num_accepted_tokens"]
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert "speculative decoding:" in _report("throughput", again)


def test_garbage_in_the_drafts_unwritten_blocks_never_leaks(reference, monkeypatch):
    """The draft reserves blocks for drafts 2..k before writing them, and batched steps read them
    (masked) for shorter sequences: NaN there must not reach the drafts."""
    import twostep.core.execution.model_builder as draft_module   # builds the draft's cache too

    monkeypatch.setattr(draft_module, "allocate_kv_cache", nan_filled_kv_cache)
    folder, prompts, expected = reference
    engine = engine_for(folder, speculative_config=draft_config(folder, 4), block_size=2)
    outs = run_all(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.get_stats()["spec_decode_acceptance_rate"] == 1.0   # the target is its own draft


def test_drafts_never_crowd_out_other_decodes(reference):
    """With a budget below max_num_seqs * (k + 1), every running decode still gets its token each
    step; drafts only take what is left."""
    folder, prompts, expected = reference
    engine = engine_for(folder, speculative_config={**NGRAM, "num_speculative_tokens": 8},
                        max_num_batched_tokens=10)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        decoding = [r for r in engine.scheduler.running if not r.is_prefilling]
        before = {r.request_id: len(r.output_token_ids) for r in decoding}
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if len(decoding) <= 10:
            for r in decoding:
                if not r.is_finished:
                    assert len(r.output_token_ids) > before[r.request_id], "a decode was skipped"
    assert [done[i].outputs[0].token_ids for i in ids] == expected


def test_the_draft_catches_up_on_long_prompts_within_the_token_budget(reference):
    folder, prompts, expected = reference
    engine = engine_for(folder, speculative_config=draft_config(folder, 3), max_num_batched_tokens=8)
    runner = engine.proposer.runner
    sizes = []
    original = runner.last_logits

    def spy(plan):
        sizes.append(plan.num_tokens)
        return original(plan)

    runner.last_logits = spy
    outs = run_all(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(sizes) <= 8 + len(prompts), sizes            # chunks plus one fed-back draft each
    assert engine.get_stats()["spec_decode_acceptance_rate"] == 1.0
    assert engine.proposer.kv.num_free_blocks == engine.proposer.kv.num_blocks   # all freed


def test_a_draft_with_a_shorter_context_stops_proposing_past_it(reference, tmp_path):
    folder, prompts, expected = reference
    short = make_tiny_model(tmp_path / "short", "llama", max_position_embeddings=48)   # same weights
    engine = engine_for(folder, speculative_config=draft_config(short, 4))
    assert engine.proposer.max_model_len == 48
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        for r in engine.scheduler.running:
            if r.num_tokens > 48:    # nothing of it is kept in the draft's cache any more
                assert engine.proposer.kv.num_blocks_of(r.request_id) == 0
    assert [done[i].outputs[0].token_ids for i in ids] == expected
    assert engine.get_stats()["spec_decode_acceptance_rate"] == 1.0
    assert engine.proposer.kv.num_free_blocks == engine.proposer.kv.num_blocks
