"""benchmarks/perplexity.py's twostep figure, computed llama-perplexity's way, against the same
chunks scored by HF transformers on the same GGUF file (stories260K, float32)."""
import importlib.util
import math
import sys
from pathlib import Path

import torch

from conftest import stories_path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "perplexity.py"
_spec = importlib.util.spec_from_file_location("benchmarks_perplexity", _PATH)
perplexity = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perplexity)

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
        "One day, she saw a big, red ball. She wanted to play with it, but it was too high. ") * 6


def test_perplexity_matches_transformers_on_the_same_chunks():
    from transformers import AutoModelForCausalLM

    path = stories_path()
    ctx, chunks = 64, 2
    ours, n, _ = perplexity.twostep_perplexity(str(path), TEXT, ctx, chunks, threads=1, decode_path=False)
    assert n == chunks

    from twostep import LLM
    tokens = LLM(str(path), dtype="float32", kv_cache_memory="8MiB").engine.tokenizer.encode(TEXT)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, pad_token_id=None,
                                              dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for i in range(chunks):
        chunk = list(tokens[i * ctx:(i + 1) * ctx])
        chunk[0] = 1                                   # BOS, as llama-perplexity does
        with torch.no_grad():
            logprobs = hf(torch.tensor([chunk])).logits[0].float().log_softmax(-1)
        for j in range(ctx // 2 + 1, ctx):
            nll -= logprobs[j - 1, chunk[j]].item()
            count += 1
    assert math.isclose(ours, math.exp(nll / count), rel_tol=1e-4)


def test_bos_over_each_chunk_only_where_the_vocabulary_adds_it():
    """llama-perplexity writes BOS over a chunk's first token only where the vocabulary adds BOS
    (a Llama file); a Qwen2 file names a BOS id (151643) but adds none, so its chunks keep their text."""
    from types import SimpleNamespace

    def engine(adds_bos: bool):
        tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [7, 64] if adds_bos else [64])
        return SimpleNamespace(model_config=SimpleNamespace(bos_token_id=7), generation_config={},
                               tokenizer=tokenizer)

    assert perplexity.chunk_start_token(engine(True)) == 7
    assert perplexity.chunk_start_token(engine(False)) is None
