"""Pooling models end to end in the engine (LLM.embed, LLM.classify, LLM.score): embeddings equal
transformers' pooled hidden states (last token, mean, first token; normalised or not), a
sentence-transformers folder equals SentenceTransformer.encode, scores equal a classifier's logits,
and chunked prefill, batching and prefix-cache hits change no vector. A pooling request samples
nothing, frees its blocks when it ends, and never holds up another request's decode."""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_all_free, make_tiny_model, random_prompts
from twostep import LLM, SamplingParams
from twostep.config import EngineConfig
from twostep.engine.llm_engine import LLMEngine
from twostep.pooling_params import PoolingParams

TOL = 1e-4
LENGTHS = [1, 7, 16, 33, 64]      # with a 16-token budget: one step, and up to four chunks


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A Qwen3Model checkpoint (no lm_head, names without model.), as Qwen3-Embedding ships."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3-base"), "qwen3", auto_class="AutoModel")


@pytest.fixture(scope="module")
def hidden_states(base_dir):
    """transformers' final hidden states (after the final norm) of each prompt, run alone."""
    import transformers

    hf = transformers.AutoModel.from_pretrained(base_dir, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([prompt])).last_hidden_state[0]
    return run


def pooled(h: torch.Tensor, kind: str, normalize: bool = True) -> torch.Tensor:
    v = {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[kind]
    return F.normalize(v, dim=-1) if normalize else v


def pooling_llm(folder, **kw) -> LLM:
    return LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", **kw)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_pooled_hidden_states(base_dir, hidden_states, kind):
    """Prompts of 1 to 64 tokens batched together through 16-token steps (so in chunks), against
    each prompt alone in transformers; normalised by default, raw with normalize false."""
    llm = pooling_llm(base_dir, max_num_batched_tokens=16, pooler_config={"pooling_type": kind})
    assert llm.engine.pooling.task == "embed" and llm.engine.model.lm_head is None
    prompts = random_prompts(LENGTHS, seed=2)
    outs = llm.embed(prompts, use_tqdm=False)
    raw = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    for p, out, unnormalized in zip(prompts, outs, raw):
        h = hidden_states(p)
        assert len(out.outputs.embedding) == 64
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), pooled(h, kind), atol=TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(unnormalized.outputs.embedding), pooled(h, kind, False),
                                   atol=TOL, rtol=0)
    assert_all_free(llm.engine)
    assert llm.get_stats()["num_decode_tokens"] == 0


def test_chunks_and_prefix_cache_hits_give_the_same_vectors(base_dir):
    """LAST pooling takes prefix-cache hits (the last token always runs); MEAN computes every position
    itself. Either way the vector equals one computed in a single step without a cache."""
    prompt = random_prompts([50], seed=4)[0]
    for kind in ("LAST", "MEAN"):
        whole = pooling_llm(base_dir, enable_prefix_caching=False, pooler_config={"pooling_type": kind})
        expected = torch.tensor(whole.embed([prompt], use_tqdm=False)[0].outputs.embedding)
        llm = pooling_llm(base_dir, max_num_batched_tokens=16, pooler_config={"pooling_type": kind})
        engine = llm.engine
        first, again = [llm.encode([prompt], use_tqdm=False)[0] for _ in range(2)]
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == (48 if kind == "LAST" else 0)
        for out in (first, again):
            torch.testing.assert_close(out.outputs.data, expected, atol=TOL, rtol=0)
        assert_all_free(engine)


def test_a_preempted_pooling_request_starts_over(tiny_model_dir):
    """A generation grows in a cache of 8 blocks while MEAN-pooling prompts come in chunks: they are
    preempted mid-prompt (the newest request goes) and recomputed, and each position is summed once."""
    import transformers

    folder = tiny_model_dir("llama")
    llm = pooling_llm(folder, runner="pooling", pooler_config={"pooling_type": "MEAN"}, num_kv_blocks=8,
                      max_num_batched_tokens=24, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(random_prompts([80], seed=1)[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(5):              # its prompt in 4 chunks, then its first token
        engine.step()
    prompts = random_prompts([40, 40, 40], seed=5)
    ids = [engine.add_request(p, PoolingParams()) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done[ids[0]].metrics.num_preemptions > 0
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    for p, rid in zip(prompts, ids):
        with torch.no_grad():
            h = hf(torch.tensor([p])).last_hidden_state[0]
        torch.testing.assert_close(done[rid].outputs.data, pooled(h, "MEAN"), atol=TOL, rtol=0)
    assert_all_free(engine)


@pytest.mark.parametrize("chat_template", [False, True], ids=["text", "chat-template"])
@pytest.mark.parametrize("mode,kind", [("mean", "MEAN"), ("lasttoken", "LAST"), ("cls", "CLS")])
def test_a_sentence_transformers_folder_equals_its_encode(tmp_path, base_dir, mode, kind, chat_template):
    """SentenceTransformer(modules=[Transformer, Pooling, Normalize]) around the tiny Qwen3, saved and
    loaded back: its encode() and LLM.embed agree. Where the tokenizer has a chat template,
    sentence-transformers (>= 6) reads each text as a user message through it, and so does twostep."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    source = tmp_path / "source"
    source.mkdir()
    for f in base_dir.iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    if not chat_template:
        config = json.loads((source / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (source / "tokenizer_config.json").write_text(json.dumps(config))
    folder = tmp_path / "st"
    transformer = Transformer(str(source))
    st = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), mode),
                                      Normalize()], device="cpu")
    st.save(str(folder))
    texts = ["Once upon a time there was a little girl named Lily.", "The quick brown fox.",
             "What is the capital of France? The capital of France is Paris."]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    llm = pooling_llm(folder, max_num_batched_tokens=16)
    p = llm.engine.pooling
    assert (p.pooling_type, p.normalize, p.texts_as_messages) == (kind, True, chat_template)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(got, expected.float(), atol=TOL, rtol=0)


def test_a_sentence_transformers_module_twostep_does_not_run_is_refused(tmp_path, base_dir):
    folder = tmp_path / "dense"
    folder.mkdir()
    for f in base_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="'Dense' is not supported"):
        pooling_llm(folder)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3-cls"), "qwen3",
                           auto_class="AutoModelForSequenceClassification", num_labels=1)


def test_scores_equal_the_classifiers_logits(cross_encoder_dir):
    """A Qwen3ForSequenceClassification of one label: each pair joined as its tokenizer joins a pair,
    the score head on the last token, sigmoid (vLLM's default activation) or the raw logit."""
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(cross_encoder_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(cross_encoder_dir)
    llm = pooling_llm(cross_encoder_dir, max_num_batched_tokens=16)
    assert llm.engine.pooling.task == "classify"
    query = "What is the capital of France?"
    documents = ["The capital of France is Paris.", "The quick brown fox jumps over the lazy dog.", "Lily"]
    scores = llm.score(query, documents, use_tqdm=False)
    logits = llm.score([query] * 3, documents, use_tqdm=False, pooling_params=PoolingParams(activation=False))
    for doc, s, raw in zip(documents, scores, logits):
        ids = tok(query, doc)["input_ids"]
        assert s.prompt_token_ids == ids
        with torch.no_grad():
            logit = hf(torch.tensor([ids])).logits[0, 0]
        assert s.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=TOL)
        assert raw.outputs.score == pytest.approx(logit.item(), abs=TOL)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score([query, query], documents)


def test_classification_is_a_softmax_over_the_labels(tmp_path):
    import transformers

    folder = make_tiny_model(tmp_path / "llama-cls", "llama", auto_class="AutoModelForSequenceClassification",
                             num_labels=3)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    llm = pooling_llm(folder, max_num_batched_tokens=16)
    prompts = random_prompts([3, 40], seed=6)
    for p, out in zip(prompts, llm.classify(prompts, use_tqdm=False)):
        with torch.no_grad():
            expected = torch.softmax(hf(torch.tensor([p])).logits[0], dim=-1)
        assert out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="classifies"):
        llm.embed(["a"])


def test_an_embedding_model_scores_the_cosine_similarity(base_dir):
    llm = pooling_llm(base_dir)
    texts = ["The capital of France is Paris.", "Lily loved to play outside.", "The quick brown fox."]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
    scores = llm.score(texts[0], texts, use_tqdm=False)
    for v, s in zip(vectors, scores):
        assert s.outputs.score == pytest.approx(F.cosine_similarity(vectors[0], v, dim=0).item(), abs=1e-6)
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-6)


def test_matryoshka_dimensions_only_where_the_config_allows_them(tmp_path, base_dir, hidden_states):
    prompt = random_prompts([9], seed=7)[0]
    with pytest.raises(ValueError, match="matryoshka"):
        pooling_llm(base_dir).embed([prompt], PoolingParams(dimensions=16))
    any_size = make_tiny_model(tmp_path / "m1", "qwen3", auto_class="AutoModel", is_matryoshka=True)
    out = pooling_llm(any_size).embed([prompt], PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = F.normalize(pooled(hidden_states(prompt), "LAST", False)[:16], dim=-1)   # cut, then normalised
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=TOL, rtol=0)
    listed = pooling_llm(make_tiny_model(tmp_path / "m2", "qwen3", auto_class="AutoModel",
                                         matryoshka_dimensions=[16, 32]))
    assert len(listed.embed([prompt], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.embedding) == 32
    for bad, message in ((24, "not one this model supports"), (65, "more than")):
        with pytest.raises(ValueError, match=message):
            listed.embed([prompt], PoolingParams(dimensions=bad))


def test_each_runner_refuses_the_other_kind_of_request(tiny_model_dir, base_dir):
    generator = pooling_llm(tiny_model_dir("llama"))
    assert generator.engine.pooling is None
    with pytest.raises(ValueError, match="--runner pooling"):
        generator.engine.add_request([5, 6], PoolingParams())
    with pytest.raises(ValueError, match="runner='pooling'"):
        generator.embed(["a"])
    embedder = pooling_llm(base_dir, max_model_len=32)
    with pytest.raises(ValueError, match="no lm_head"):
        embedder.generate(["a"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len is 32"):
        embedder.embed([[5] * 33])
    assert len(embedder.embed([[5] * 32], use_tqdm=False)[0].outputs.embedding) == 64   # no room kept for a token
    with pytest.raises(ValueError, match="empty"):
        embedder.embed([""])
    with pytest.raises(ValueError, match="--runner pooling"):
        pooling_llm(base_dir, runner="generate")
    with pytest.raises(ValueError, match="no classification head"):
        pooling_llm(base_dir, convert="classify")
    with pytest.raises(ValueError, match="task 'generate' means runner 'generate'"):
        EngineConfig(task="generate", runner="pooling")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        EngineConfig(runner="pooling", pooler_config={"pooling_type": "MAX"})


def test_a_causal_lm_as_an_embedding_model(tiny_model_dir):
    """--task embed on a *ForCausalLM (vLLM's convert): the last token's final hidden state, and the
    model keeps its lm_head."""
    import transformers

    folder = tiny_model_dir("llama")
    llm = pooling_llm(folder, task="embed")
    assert llm.engine.pooling.pooling_type == "LAST" and llm.engine.can_generate
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = random_prompts([12], seed=8)[0]
    with torch.no_grad():
        h = hf(torch.tensor([prompt])).last_hidden_state[0]
    torch.testing.assert_close(torch.tensor(llm.embed([prompt], use_tqdm=False)[0].outputs.embedding),
                               pooled(h, "LAST"), atol=TOL, rtol=0)


def _decode_gaps(engine: LLMEngine, load: list[list[int]]) -> tuple[list[float], int, int]:
    """A generation of 48 tokens, with `load` added as pooling requests after its fourth token: its
    inter-token gaps, how many steps passed without it getting a token while pooling requests ran,
    and in how many it got one beside them."""
    gen = engine.add_request(random_prompts([8], seed=9)[0], SamplingParams(temperature=0, max_tokens=48,
                                                                            ignore_eos=True))
    pending = list(load)
    skipped = shared = 0
    done = None
    while done is None:
        outputs = engine.step()
        got = next((o for o in outputs if o.request_id == gen), None)
        if got is not None and got.finished:
            done = got
        busy = engine.num_running > 1 or engine.num_waiting > 0
        skipped += got is None and busy
        shared += got is not None and busy
        if pending and got is not None and len(got.outputs[0].token_ids) == 4:
            for prompt in pending:
                engine.add_request(prompt, PoolingParams())
            pending = []
    while engine.has_unfinished_requests():
        engine.step()
    return done.metrics.inter_token_latencies, skipped, shared


def test_pooling_requests_do_not_stall_a_generation(tiny_model_dir):
    """A causal LM as a pooling engine (it keeps its lm_head, so it also generates): 32 prompts of 400
    tokens to embed arrive while a greedy generation streams. The generation gets a token in every
    step (a decode goes first; the prompts fill what is left of the 64-token budget), so its
    largest gap is about one full step, far from the time all the prompts take together (what a
    stall would cost). Without the load its gaps are a decode's."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB",
                                    runner="pooling", max_num_batched_tokens=64, enable_prefix_caching=False))
    load = random_prompts([400] * 32, seed=10)
    quiet, _, _ = _decode_gaps(engine, [])
    busy, skipped, shared = _decode_gaps(engine, load)
    assert skipped == 0, f"the generation waited {skipped} steps for pooling prompts"
    assert shared >= 40, f"the load ran beside only {shared} of the generation's steps"
    start = time.monotonic()
    for prompt in load:
        engine.add_request(prompt, PoolingParams())
    while engine.has_unfinished_requests():
        engine.step()
    load_alone = time.monotonic() - start
    assert max(busy) < load_alone / 4, (f"largest gap {max(busy) * 1e3:.1f} ms with the load (quiet: "
                                        f"{max(quiet) * 1e3:.1f} ms); the load alone takes {load_alone * 1e3:.0f} ms")
    assert_all_free(engine)
