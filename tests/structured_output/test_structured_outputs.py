"""Structured outputs on the default real model (SmolLM2-135M-Instruct, the packaged GGUF): every
constrained output parses and validates, greedy and sampled, alone and batched with free requests,
with n > 1, through preemption and with n-gram speculation."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import smollm_path
from schemas import SCHEMAS
from twostep.entrypoints.llm import LLM
from twostep.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

EMAIL = r"[a-z]{2,8}@(example|mail)\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]


def _llm(**kw) -> LLM:
    return LLM(str(smollm_path()), dtype="float32", kv_cache_memory=kw.pop("kv_cache_memory", "256MiB"), **kw)


@pytest.fixture(scope="module")
def llm():
    return _llm()


def _chat(llm: LLM, question: str) -> dict:
    ids = llm.engine.input_processor.encode_chat([{"role": "user", "content": question}])
    return {"prompt_token_ids": ids}


def _schema_params(schema: dict, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    return SamplingParams(max_tokens=kw.pop("max_tokens", 160), structured_outputs=so, **kw)


def _check_json(text: str, schema: dict, finish_reason: str) -> None:
    assert finish_reason == "stop", f"did not finish ({finish_reason}): {text!r}"
    jsonschema.validate(json.loads(text), schema)


def _schema_requests(llm: LLM, **kw):
    names = sorted(SCHEMAS)
    prompts = [_chat(llm, f"Write a JSON value for '{n}' matching this schema: {json.dumps(SCHEMAS[n])}")
               for n in names]
    return names, prompts, [_schema_params(SCHEMAS[n], **kw) for n in names]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_p=0.95, seed=7)],
                         ids=["greedy", "sampled"])
def test_every_schema_validates(llm, sampling):
    names, prompts, params = _schema_requests(llm, **sampling)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, schema, out in zip(names, [SCHEMAS[n] for n in names], outs):
        c = out.outputs[0]
        _check_json(c.text, schema, c.finish_reason)


def test_regex_and_choice_hold_on_every_sample_with_n4(llm):
    prompts = [_chat(llm, "Give an email address."), _chat(llm, "Is 'I love it' positive or negative?")]
    params = [SamplingParams(n=4, temperature=1.2, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=EMAIL)),
              SamplingParams(n=4, temperature=1.2, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(choice=CHOICES))]
    email, choice = llm.generate(prompts, params, use_tqdm=False)
    assert len(email.outputs) == len(choice.outputs) == 4
    for c in email.outputs:
        assert re.fullmatch(EMAIL, c.text), c.text
        assert c.finish_reason == "stop"
    for c in choice.outputs:
        assert c.text in CHOICES
    assert len({c.text for c in email.outputs}) > 1, "four seeded samples should not all be equal"


def test_json_n4_every_child_validates(llm):
    schema = SCHEMAS["movie"]
    out = llm.generate([_chat(llm, "Describe a movie as JSON.")],
                       _schema_params(schema, n=4, temperature=1.0, seed=11), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        _check_json(c.text, schema, c.finish_reason)


def test_mixed_batch_of_16_leaves_free_requests_alone(llm):
    """Eight free greedy requests beside eight constrained ones write what they write beside the same
    eight prompts unconstrained: the masks of other rows never touch a free row. The same prompts,
    not the free request alone: a prompt's step takes its product by the step's rows (a few rows the
    int16 passes, many a float32 GEMM: the same sums rounded otherwise), and the int8 activations of
    the decode steps after it turn such last-bit differences into a code a step away here and there,
    which can flip a near tie (more so where VNNI rounds the Q8_0 head's activations to int8 too).
    A decode step gives a row the same bits whatever its batch.
    Each batch from an empty prefix cache, so that both compute the same prompt step."""
    free_prompt = "The capital of France is"
    free = SamplingParams(temperature=0, max_tokens=24)
    names = sorted(SCHEMAS)[:8]
    prompts = [free_prompt if i % 2 else _chat(llm, f"JSON for {names[i // 2]}") for i in range(16)]
    params = [free if i % 2 else _schema_params(SCHEMAS[names[i // 2]], temperature=0.8, seed=i) for i in range(16)]
    plain = [free if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=24) for i in range(16)]

    def run(sampling: list[SamplingParams]):
        llm.reset_prefix_cache()
        return llm.generate(prompts, sampling, use_tqdm=False)

    unconstrained = [out.outputs[0].text for out in run(plain)]
    outs = run(params)
    finished = 0
    for i, out in enumerate(outs):
        c = out.outputs[0]
        if i % 2:
            assert c.text == unconstrained[i]     # the masks of other rows never touch a free row
        elif c.finish_reason == "length":
            # a sampled row may spin a number's digits out to max_tokens (on a Zen 5 one of these
            # eight does): then every token it took is one its grammar accepts, in that order
            grammar = llm.engine.grammar_compiler.grammar(params[i].structured_outputs)
            assert len(c.token_ids) == params[i].max_tokens
            assert grammar.valid_prefix(c.token_ids) == len(c.token_ids), c.text
        else:
            _check_json(c.text, SCHEMAS[names[i // 2]], c.finish_reason)
            finished += 1
    assert finished >= 6, "most constrained rows should finish their JSON"


def test_preempted_and_chunked_requests_keep_their_grammar():
    # ~180 tokens of cache: a few requests, not 12; prompts of ~35 tokens prefill in chunks of 16
    llm = _llm(kv_cache_memory="8MiB", max_num_seqs=12, max_num_batched_tokens=16)
    names = sorted(SCHEMAS)[:12]
    prompts = [_chat(llm, f"JSON for {n}") for n in names]
    params = [_schema_params(SCHEMAS[n], temperature=0.7, seed=5) for n in names]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > 0, "the cache should be small enough to preempt"
    for name, out in zip(names, outs):
        c = out.outputs[0]
        _check_json(c.text, SCHEMAS[name], c.finish_reason)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=2)], ids=["greedy", "sampled"])
def test_ngram_speculation_keeps_constraints(llm, sampling):
    # int16 activations everywhere: by default decode rows round theirs to int8, and so do drafts
    # verified in steps of decodes alone, but twenty requests also verify beside prompt chunks
    # (int16 there), and their 100 logit rows pass the Q8_0 head's 32 rows of passes on AVX2
    exact = dict(cpu_int8_activations="off")
    spec = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 1}, **exact)
    names, prompts, params = _schema_requests(spec, **sampling)
    outs = spec.generate(prompts, params, use_tqdm=False)
    for name, out in zip(names, outs):
        c = out.outputs[0]
        _check_json(c.text, SCHEMAS[name], c.finish_reason)
    stats = spec.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if sampling["temperature"] == 0:   # greedy: speculation changes nothing
        plain = _llm(**exact).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in plain]
