"""A script written as a vLLM user writes it runs with only the import changed; vLLM's arguments,
SamplingParams fields and dtype spellings are taken (tiny model)."""
from __future__ import annotations

import pytest

from twostep import LLM, SamplingParams   # vLLM: from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(model=folder, tokenizer=folder, dtype="fp32", seed=0, max_model_len=128, trust_remote_code=True,
               enforce_eager=True, tensor_parallel_size=1, gpu_memory_utilization=0.5, max_num_seqs=8)


def test_a_vllm_users_script(llm):
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=1, logprobs=-1)
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt == prompt
        completion = output.outputs[0]
        assert len(completion.token_ids) == len(completion.logprobs) >= 1
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and len(entry) >= 20          # -1: the engine's max_logprobs (20)
            assert all(lp.decoded_token == llm.get_tokenizer().decode([t]) for t, lp in entry.items())
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=5),
                    chat_template_kwargs={"unused": True})
    assert chat[0].outputs[0].token_ids
    assert llm.llm_engine is llm.engine


def test_vllm_prompt_types(llm):
    from twostep.inputs import TextPrompt, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text, tokens = llm.generate([TextPrompt(prompt="Once upon a time"),
                                 TokensPrompt(prompt_token_ids=llm.tokenizer.encode("Once upon a time"))], params)
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids


def test_get_tokenizer_is_hugging_faces(llm):
    import transformers

    tok = llm.get_tokenizer()
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert tok.encode("Lily loved to play", add_special_tokens=False) == llm.tokenizer.encode(
        "Lily loved to play", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        llm.tokenizer.apply_chat_template(messages)
    assert tok.eos_token == "</s>"


def test_sampling_params_of_vllm(llm):
    same = llm.generate("Once upon a time", SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(same.outputs) == 3 and len({tuple(c.token_ids) for c in same.outputs}) == 1
    prompt = list(range(5, 40))
    cut = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                    truncate_prompt_tokens=10))[0]
    last = llm.generate({"prompt_token_ids": prompt[-10:]},
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert cut.prompt_token_ids == prompt[-10:] and cut.outputs[0].token_ids == last.outputs[0].token_ids
    raw = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                         detokenize=False))[0].outputs[0]
    assert raw.text == "" and len(raw.token_ids) == 5
    p = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, extra_args={"tag": 1},
                       spaces_between_special_tokens=False)
    q = p.clone()
    assert q == p and q.stop is not p.stop and q.logit_bias is not p.logit_bias
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_output_kinds_and_metric_names(llm):
    from twostep import RequestOutputKind

    base = dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    whole = llm.generate("Once upon a time", SamplingParams(**base))[0].outputs[0]
    deltas = list(llm.stream("Once upon a time", SamplingParams(**base, output_kind=RequestOutputKind.DELTA)))
    assert len(deltas) > 1
    assert "".join(o.outputs[0].text for o in deltas) == whole.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == whole.token_ids
    assert sum(len(o.outputs[0].logprobs) for o in deltas) == len(whole.token_ids)
    generated = llm.generate("Once upon a time", SamplingParams(**base, output_kind=RequestOutputKind.DELTA))[0]
    assert generated.outputs[0].text == whole.text      # generate returns whole outputs whatever the kind
    final = list(llm.stream("Once upon a time", SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == whole.text
    m = final[0].metrics
    assert m.first_token_ts == m.first_token_time and m.first_token_latency == m.ttft
    assert m.num_generation_tokens == 8 and m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts


def test_final_only_outputs_are_the_last_cumulative_ones(llm):
    """FINAL_ONLY (what generate asks for) builds no output until a request ends; then its text,
    tokens, logprobs and finish reason are those of the cumulative stream's last output, with stop
    strings (the held-back tail) and parallel samples too."""
    for extra in (dict(stop=["play"], temperature=0), dict(n=2, seed=3, temperature=0.9)):
        params = dict(max_tokens=24, ignore_eos=True, logprobs=1, **extra)
        last = list(llm.stream("Once upon a time", SamplingParams(**params)))[-1]
        final = llm.generate("Once upon a time", SamplingParams(**params))[0]
        assert last.finished and final.finished
        seen = lambda out: [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, len(c.logprobs))
                            for c in sorted(out.outputs, key=lambda c: c.index)]
        assert seen(final) == seen(last) and len(final.outputs) == extra.get("n", 1)
        assert all(c.text for c in final.outputs)
        assert (final.outputs[0].finish_reason == "stop") == ("stop" in extra)    # the stop string is met


def test_trust_remote_code_does_not_make_an_architecture(folder, tmp_path):
    import json
    import shutil

    other = tmp_path / "remote-code-model"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"], config["auto_map"] = ["MyFancyForCausalLM"], {"AutoModel": "modeling.MyFancy"}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture .*MyFancyForCausalLM"):
        LLM(str(other), trust_remote_code=True)


def test_arguments_that_cannot_apply_say_so(folder):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(folder, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(folder, gpu_memory_utilization=1e-6)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(folder, gpu_memory_utilization=1.5)


@pytest.mark.parametrize("spelling,canonical", [("fp32", "float32"), ("float", "float32"), ("bf16", "bfloat16"),
                                                ("fp16", "float16"), ("half", "float16")])
def test_dtype_spellings(spelling, canonical):
    import argparse

    from twostep.cli import add_engine_args
    from twostep.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--dtype", spelling]).dtype == canonical
    assert EngineConfig(dtype=spelling).dtype == canonical
    assert p.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"


def test_every_subcommand_takes_both_dtype_spellings():
    import argparse

    from twostep.analysis.cli import add_analyze_args
    from twostep.bench.cli import add_bench_args
    from twostep.cli import add_engine_args

    analyze = argparse.ArgumentParser()
    add_analyze_args(analyze)
    for spelling, name in (("float32", "fp32"), ("bfloat16", "bf16"), ("fp8_e4m3", "fp8"), ("fp16", "fp16")):
        assert analyze.parse_args(["m", "--dtype", spelling]).dtype == name
    assert analyze.parse_args(["m", "--kv-dtype", "bfloat16"]).kv_dtype == "bf16"
    bench = argparse.ArgumentParser()
    add_bench_args(bench, add_engine_args)
    assert bench.parse_args(["ceilings", "--dtype", "bf16"]).dtype == "bfloat16"
    assert bench.parse_args(["latency", "--dtype", "fp32"]).dtype == "float32"
