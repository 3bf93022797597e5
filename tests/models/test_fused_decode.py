"""The one-call decode stack (models/fused_decode.py, twostep/kernels/csrc/decode_step.cpp) against the
same engine running every step through the Python layers: bit-identical tokens and logprobs, for
float32, bf16 and quantized weights, with q/k norms (qwen3) and biases (qwen2), beside prompt
chunks, speculative verification and prefix caching; proof that it really takes the decode steps,
and that where it cannot apply (8-bit KV, the reference attention backend) the layers run."""
from __future__ import annotations

import shutil

import pytest
import torch

from conftest import run_all, smollm_path
from twostep import EngineConfig, LLMEngine, SamplingParams
from twostep.layers.decoder_layer import PreNormLayer

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(60, 100)), [3]]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def make(model, **kw) -> LLMEngine:
    # 8 tokens a step: the long prompts are prefilled in chunks beside the others' decodes
    kw = {"dtype": "float32", "kv_cache_memory": "4MiB", "max_num_batched_tokens": 8, **kw}
    return LLMEngine(EngineConfig(model=str(model), **kw))


def stack_or_skip(engine: LLMEngine) -> LLMEngine:
    from twostep import kernels

    if kernels.decode_step() is None:
        pytest.skip("the decode-step kernel cannot be built here (no g++ or ninja)")
    linear = engine.model.model.layers[-1].self_attn.o_proj
    if linear.method.fused(linear, kernels.decode_step(), engine.dtype) is None:
        pytest.skip(f"{linear.method.name}: no matrix-vector kernel for these weights on this CPU")
    assert engine.model.fused_decode is not None, "the kernels build, so the decode stack must be bound"
    return engine


class CountedStack:
    """Wraps a model's fused_decode: how many steps it took."""

    def __init__(self, engine: LLMEngine) -> None:
        self.inner, self.taken = engine.model.fused_decode, 0
        engine.model.fused_decode = self

    def __call__(self, *args):
        out = self.inner(*args)
        self.taken += out is not None
        return out


def outputs(engine, prompts=PROMPTS, params=PARAMS):
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in run_all(engine, prompts, params)]


def layer_by_layer(engine: LLMEngine) -> LLMEngine:
    engine.model.fused_decode = None
    return engine


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_float32_models_decode_steps_take_the_stack_on_any_cpu(tiny_model_dir, quantization):
    """float32 is the default dtype wherever the CPU has no bf16 hardware (an AVX2-only EPYC, an Ice
    Lake Xeon): its steps must take the stack there, not only on the CPUs where bf16 is the default
    (float32 weights through at::linear, bf16-valued ones through the AVX2 or plain C++ product,
    quantized ones through the quantized kernel's build for this CPU)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the kernels")
    engine = make(tiny_model_dir("llama"), dtype="float32", quantization=quantization)
    assert engine.model.fused_decode is not None
    counted = CountedStack(engine)
    outputs(engine, PROMPTS[:2])
    assert counted.taken >= PARAMS.max_tokens - 1


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mistral-window", "gemma2", "gemma3", "phi3", "phi3-longrope",
            "smollm3", "olmo2", "granite", "glm4", "qwen3.5"]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_stack_is_bit_identical_to_the_layers(tiny_model_dir, arch, dtype):
    """Every family's blocks write the program (their emit() beside forward()): windows, soft-caps,
    NoPE layers, two RoPE bases, partial rotary, sandwich and post norms, the multipliers."""
    engine = stack_or_skip(make(tiny_model_dir(arch), dtype=dtype))
    counted = CountedStack(engine)
    fused = outputs(engine)
    assert counted.taken > 0
    assert fused == outputs(layer_by_layer(make(tiny_model_dir(arch), dtype=dtype)))


@pytest.mark.parametrize("kw", [dict(dtype="float32"), dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="int4")],
                         ids=["float32", "bf16", "int4"])
def test_a_decode_steps_logits_come_from_the_stack(tiny_model_dir, kw):
    """The stack runs the final norm and the lm_head too: where a decode step wants every row's
    logits (rows up to the lm_head's own limit), they come from its call and compute_logits does not
    run; prompt steps and larger batches compute them after. The same outputs as the layers'."""
    engine = stack_or_skip(make(tiny_model_dir("qwen2"), **kw))
    stack, model, events = engine.model.fused_decode, engine.model, []
    assert stack.head_rows >= 1

    def spied_stack(*args):
        out = stack(*args)
        events.append("none" if out is None else "logits" if out[1] is not None else "hidden")
        return out

    compute_logits = model.compute_logits
    model.fused_decode = spied_stack
    model.compute_logits = lambda hidden: events.append("compute_logits") or compute_logits(hidden)
    fused = outputs(engine, PROMPTS[:2])
    assert events.count("logits") >= PARAMS.max_tokens - 1     # every decode step at one and two rows
    assert not any(a == "logits" and b == "compute_logits" for a, b in zip(events, events[1:]))
    assert "compute_logits" in events                           # the prompts' steps
    assert fused == outputs(layer_by_layer(make(tiny_model_dir("qwen2"), **kw)), PROMPTS[:2])


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "olmo2"])
def test_the_decode_stack_runs_quantized_weights_as_the_layers_do(tiny_model_dir, arch, dtype, quantization):
    engine = stack_or_skip(make(tiny_model_dir(arch), dtype=dtype, quantization=quantization))
    method = engine.model.model.layers[0].mlp.down_proj.method
    int8 = method.int8_mode != "off"
    int8_takes_all = int8 and {"int8": 8, "int4": 4}[quantization] in method.int8_bits
    # the stack's rows: any where the int8 product takes every row; else the most that every layer
    # runs as one call of the matrix-vector passes, oneDNN on or off (one more, and some layer
    # would not: a second call, or a matrix-matrix product)
    limit = engine.model.fused_decode.max_rows
    if int8_takes_all:
        assert limit == 1 << 30
    else:
        parts = [p for layer in engine.model.model.layers
                 for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                layer.mlp.down_proj)
                 for p in linear.quantized.parts]
        assert limit >= 8
        assert all(one_call_of_passes(method, p, limit, engine.dtype) for p in parts)
        assert not all(one_call_of_passes(method, p, limit + 1, engine.dtype) for p in parts)
    counted = CountedStack(engine)
    fused = outputs(engine)
    assert counted.taken > 0
    assert fused == outputs(layer_by_layer(make(tiny_model_dir(arch), dtype=dtype, quantization=quantization)))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "gpt-oss", "olmoe", "qwen2-moe", "qwen3.5-moe", "qwen3-next"])
def test_the_decode_stack_runs_quantized_experts_as_the_layers_do(tiny_model_dir, arch, dtype, quantization):
    """The router and the experts kernel (int8 activations where they apply) as one instruction:
    the same tokens, bit for bit, as the layers' SparseMoE."""
    engine = stack_or_skip(make(tiny_model_dir(arch), dtype=dtype, quantization=quantization))
    moe = next(layer.mlp for layer in engine.model.model.layers if hasattr(layer.mlp, "experts"))
    assert "quantized experts" in moe.experts.method.name
    counted = CountedStack(engine)
    fused = outputs(engine)
    assert counted.taken > 0
    assert fused == outputs(layer_by_layer(make(tiny_model_dir(arch), dtype=dtype, quantization=quantization)))


def one_call_of_passes(method, part, rows: int, dtype: torch.dtype) -> bool:
    """Whether the layers run `rows` rows of one part (16-bit activations) as one call of the
    matrix-vector passes, both with oneDNN on and with it off (a user may turn it off)."""
    x, out = torch.randn(rows, part.k).to(dtype), torch.empty(rows, part.n, dtype=dtype)
    calls, before = [], torch.backends.mkldnn.enabled
    try:
        for onednn in (True, False):     # (not mkldnn.flags: it warns about TF32 on a CPU build)
            torch.backends.mkldnn.enabled = onednn
            with torch.profiler.profile() as prof:
                method._plain_part(part, x, out)
            calls.append([e.name for e in prof.events() if e.name.startswith("twostep::")])
    finally:
        torch.backends.mkldnn.enabled = before
    return calls == [["twostep::quant_gemv"]] * 2


def int8_or_skip():
    from twostep import kernels

    if kernels.quant_linear() is None or not kernels.quant_linear().has_int8():
        pytest.skip("the int8 product needs the kernel built with AVX2")


@pytest.mark.parametrize("dtype,mode,int8", [("float32", "all", True), ("bfloat16", "all", True),
                                              ("bfloat16", "decode", True), ("float32", "decode", True)])
def test_eight_decodes_with_int8_activations_as_the_layers(tiny_model_dir, dtype, mode, int8):
    """--cpu-int8-activations all, and decode (the default) in any dtype: eight decode rows take the
    int8 product in the stack as in the layers (off: the 16-bit one, so other logprobs)."""
    int8_or_skip()
    kw = dict(dtype=dtype, quantization="int4", cpu_int8_activations=mode, max_num_batched_tokens=256)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]
    engine = stack_or_skip(make(tiny_model_dir("llama"), **kw))
    counted = CountedStack(engine)
    fused = outputs(engine, prompts)
    assert counted.taken > 0
    assert fused == outputs(layer_by_layer(make(tiny_model_dir("llama"), **kw)), prompts)
    plain = outputs(make(tiny_model_dir("llama"), **{**kw, "cpu_int8_activations": "off"}), prompts)
    assert (plain != fused) == int8            # the int8 product really ran, or really did not


def test_a_decode_batch_of_twelve_takes_the_stack_with_int8_activations(tiny_model_dir):
    """The default (decode): where every part takes the int8 product, the stack takes decode
    batches of any size (twelve here), as the layers compute them; the prompts (one step of 48 rows)
    keep the 16-bit activations: the first tokens are those of --cpu-int8-activations off."""
    int8_or_skip()
    kw = dict(dtype="bfloat16", quantization="int4", max_num_batched_tokens=256)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(12)]
    engine = stack_or_skip(make(tiny_model_dir("llama"), **kw))
    assert engine.model.fused_decode.max_rows > 12
    counted = CountedStack(engine)
    fused = outputs(engine, prompts)
    assert counted.taken == PARAMS.max_tokens - 1            # every decode step, twelve rows each
    assert fused == outputs(layer_by_layer(make(tiny_model_dir("llama"), **kw)), prompts)
    plain = outputs(make(tiny_model_dir("llama"), **{**kw, "cpu_int8_activations": "off"}), prompts)
    assert [p[1][0] for p in plain] == [f[1][0] for f in fused]     # prompt forward: same logprobs
    assert plain != fused                                         # decode batches: int8


def test_a_decode_batch_of_twelve_takes_the_stack_with_passes_of_twelve_rows(tiny_model_dir):
    """8-bit weights with 16-bit activations (no int8 product): a decode batch of twelve goes through
    the stack, each linear's passes one call of twelve rows in the panel layout (the weights read
    once), and computes what the layers compute."""
    kw = dict(dtype="bfloat16", quantization="int8", cpu_int8_activations="off", max_num_batched_tokens=256)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(12)]
    engine = stack_or_skip(make(tiny_model_dir("llama"), **kw))
    if not engine.model.model.layers[0].mlp.down_proj.quantized.parts[0].panels:
        pytest.skip("the row layout here (the portable build): passes of 8 rows a call")
    assert engine.model.fused_decode.max_rows >= 12
    counted = CountedStack(engine)
    with torch.profiler.profile(record_shapes=True) as prof:
        fused = outputs(engine, prompts)
    assert counted.taken == PARAMS.max_tokens - 1            # every decode step, twelve rows each
    calls = [e.input_shapes[0][0] for e in prof.events() if e.name == "twostep::quant_gemv" and e.input_shapes]
    assert calls and set(calls) == {12}                      # each linear's passes: one call of the twelve rows
    assert fused == outputs(layer_by_layer(make(tiny_model_dir("llama"), **kw)), prompts)


def test_a_prompts_last_token_beside_decodes_is_not_a_decode_batch(tiny_model_dir):
    """A one-token prompt scheduled beside eight decodes makes nine one-token rows, but not a
    decode batch: the stack leaves the step to the layers, and its first token's logprobs are
    those of --cpu-int8-activations off (16-bit), while the decodes of the steps after round."""
    int8_or_skip()

    def first_logprobs(mode: str):
        engine = stack_or_skip(make(tiny_model_dir("llama"), dtype="bfloat16", quantization="int4",
                                    max_num_batched_tokens=256, cpu_int8_activations=mode))
        counted = CountedStack(engine)
        for i in range(8):
            engine.add_request([5 + i, 6, 7, 8 + i], PARAMS)
        engine.step()                                     # the eight prompts
        engine.step()                                     # eight decodes: a decode batch
        assert counted.taken == 1
        late = engine.add_request([3], SamplingParams(temperature=0, max_tokens=2, logprobs=2))
        outputs = {out.request_id: out for out in engine.step()}    # its prompt beside eight decodes
        assert counted.taken == 1
        return [{t: lp.logprob for t, lp in d.items()} for d in outputs[late].outputs[0].logprobs]

    assert first_logprobs("decode") == first_logprobs("off")


def test_a_decode_row_does_not_depend_on_its_batch(tiny_model_dir):
    """The default (decode) where the int8 product has its small-row kernel: each sequence
    decodes the same tokens and logprobs alone as among twelve (one-token prompts, so every step
    after the first is a decode batch: 1 row alone, 12 together), in the stack and in the layers;
    with --cpu-int8-activations off alone it decodes other ones (int8 really ran at 1 row)."""
    int8_or_skip()
    from twostep import kernels

    if kernels.quant_linear().int8_min_rows() != 1:
        pytest.skip("the int8 product's small-row kernel needs the panel layout (a SIMD build)")
    kw = dict(dtype="bfloat16", quantization="int4", max_num_batched_tokens=256)
    prompts = [[5 + i] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for engine in (stack_or_skip(make(tiny_model_dir("llama"), **kw)), layer_by_layer(make(tiny_model_dir("llama"), **kw))):
        assert engine.model.model.layers[0].mlp.down_proj.quantized.parts[0].panels
        alone = [outputs(engine, [p], params)[0] for p in prompts]
        assert outputs(engine, prompts, params) == alone
    plain = make(tiny_model_dir("llama"), **{**kw, "cpu_int8_activations": "off"})
    assert [outputs(plain, [p], params)[0] for p in prompts[:3]] != alone[:3]


def test_one_quantized_decode_more_than_the_passes_take_runs_the_layers(tiny_model_dir):
    """Without int8 activations the stack takes the rows the matrix-vector kernel's passes take (for
    these 8-bit codes in float32: 16 on AVX2 builds with gemm_f32, 32 on others), its max_rows;
    one decode more runs the layers."""
    engine = stack_or_skip(make(tiny_model_dir("llama"), quantization="int8", max_num_batched_tokens=256,
                                cpu_int8_activations="off"))
    limit = engine.model.fused_decode.max_rows
    down = engine.model.model.layers[0].mlp.down_proj
    assert limit == down.method.call_rows(down.quantized.parts[0], torch.float32)
    counted = CountedStack(engine)
    for i in range(limit + 1):
        engine.add_request([5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()                                    # the prompts in one step
    assert len(engine.scheduler.running) == limit + 1
    engine.step()                                    # one decode more than the passes take
    assert counted.taken == 0
    engine.abort_request([r.request_id for r in list(engine.scheduler.running)][:1])
    engine.step()                                    # as many as they take
    assert counted.taken == 1


def test_a_float32_cache_under_a_bf16_model_decodes(tiny_model_dir):
    """The cache's dtype differs from the model's: the K/V write converts (no one-call writer), so
    the stack, which stores K/V as they are, stays off."""
    engine = make(tiny_model_dir("llama"), dtype="bfloat16", kv_cache_dtype="float32")
    assert engine.model.fused_decode is None and engine.runner.backend.write_values is None
    (tokens, logprobs), = outputs(engine, PROMPTS[:1])
    assert len(tokens) == PARAMS.max_tokens and all(abs(v) < 1e3 for d in logprobs for v in d.values())


@pytest.mark.parametrize("extra", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1}},
    {"enable_prefix_caching": True},
])
def test_the_decode_stack_beside_speculative_verification_and_prefix_caching(tiny_model_dir, extra):
    prompts = PROMPTS + PROMPTS[:2]                  # repeats: prefix hits, and n-grams to draft from
    engine = stack_or_skip(make(tiny_model_dir("llama"), **extra))
    counted = CountedStack(engine)
    fused = outputs(engine, prompts)
    assert counted.taken > 0
    assert fused == outputs(layer_by_layer(make(tiny_model_dir("llama"), **extra)), prompts)


def test_drafts_are_verified_in_a_decode_batch_by_the_layers(tiny_model_dir, monkeypatch):
    """A step of decodes verifying drafts is a decode batch (every row a generated position), so
    its quantized rows round to int8 as the decode rows of those tokens would, and greedy
    speculation repeats plain decoding's tokens and logprobs; it has more rows than sequences, so
    the layers run it, not the stack (which takes one row per sequence)."""
    int8_or_skip()
    from twostep.core.execution.model_runner import ModelRunner

    steps = []
    run_local = ModelRunner.run_local
    monkeypatch.setattr(ModelRunner, "run_local", lambda self, inputs, rows: steps.append(
        (inputs.decode_batch, len(inputs.input_ids), len(inputs.meta.query_lens))) or run_local(self, inputs, rows))
    kw = dict(quantization="int4", max_num_batched_tokens=64)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    engine = stack_or_skip(make(tiny_model_dir("llama"), speculative_config=spec, **kw))
    counted = CountedStack(engine)
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], [5, 6, 5, 6, 5, 6, 5]]
    drafted = outputs(engine, prompts)
    verifying = [s for s in steps if s[0] and s[1] > s[2]]
    assert verifying, steps                  # drafts were verified, in decode batches
    assert counted.taken < sum(s[0] for s in steps)      # the verifying steps ran the layers
    steps.clear()
    assert drafted == outputs(make(tiny_model_dir("llama"), **kw), prompts)


def test_a_pure_decode_step_runs_no_python_layer(tiny_model_dir, monkeypatch):
    engine = stack_or_skip(make(tiny_model_dir("llama")))
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()                                # the prefills, their last tokens too
    calls = []
    original = PreNormLayer.forward
    monkeypatch.setattr(PreNormLayer, "forward", lambda *a: calls.append(1) or original(*a))
    assert len(scheduler.running) == 3
    engine.step()                                    # three rows, each decoding one token
    assert calls == []


def test_a_batch_wider_than_the_kernels_takes_the_layers(tiny_model_dir, monkeypatch):
    """bf16 weights' matrix-vector path takes at most 3 rows: 5 decoding sequences run the layers."""
    engine = stack_or_skip(make(tiny_model_dir("llama"), dtype="bfloat16", max_num_batched_tokens=64))
    if engine.model.fused_decode.max_rows != 3:
        pytest.skip("bf16 weights run through F.linear here (no oneDNN bf16): any number of rows")
    counted = CountedStack(engine)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()                                    # all five prompts in one step
    engine.step()                                    # five decodes
    assert counted.taken == 0


@pytest.mark.parametrize("config", [{"kv_cache_dtype": "int8"}, {"attention_backend": "reference"}])
def test_no_decode_stack_where_its_kernels_do_not_apply(tiny_model_dir, config):
    assert make(tiny_model_dir("llama"), **config).model.fused_decode is None


@pytest.mark.slow
def test_the_default_model_decodes_the_same_through_the_stack():
    path = smollm_path()
    prompts = [list(range(100, 130)), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    engine = stack_or_skip(make(path, dtype="bfloat16", kv_cache_memory="64MiB", max_num_batched_tokens=512))
    counted = CountedStack(engine)
    fused = outputs(engine, prompts, params)
    assert counted.taken >= 23
    plain = layer_by_layer(make(path, dtype="bfloat16", kv_cache_memory="64MiB", max_num_batched_tokens=512))
    assert fused == outputs(plain, prompts, params)
