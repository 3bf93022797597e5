"""Embedding throughput: twostep (LLM.embed) against sentence-transformers (encode) on the same model and
texts, in one process, side by side.

    .venv/bin/python benchmarks/embeddings.py [--layers 28] [--reps 5] [--batches 1 8 64] [--dtype float32]

The model is Qwen3-Embedding-0.6B's shape with random weights (benchmarks/make_shape.py's Qwen3-0.6B
config and synthetic tokenizer): a Qwen3Model (no lm_head), saved by sentence-transformers with its
Transformer, last-token Pooling and Normalize modules, as the real checkpoint is; --layers keeps the
first N of its 28 layers (the vocabulary and every layer's shape stay), for machines where the
whole stack takes too long. Both engines read the same folder in the same dtype (--dtype: float32,
sentence-transformers' own default on CPU, or bfloat16). The texts are synthetic sentences of 20 to
120 words, the same for both. At each batch size b a repetition embeds b texts in one call (twostep:
one LLM.embed of b prompts, batched by its scheduler without padding; sentence-transformers: one
encode with batch_size b, padded to the longest); the table gives medians over --reps after a
warm-up, texts/s and tokens/s (the texts' own tokens, without padding), and the ratio. twostep runs
without its prefix cache, which would otherwise serve the repeated texts from the last repetition.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches in "
         "distant northern valleys where rivers meet ancient forests and small villages keep their old "
         "stories alive through long winter nights").split()


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    return f"{names[0]}, {len(names)} logical CPUs" if names else "unknown CPU"


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) + "." for _ in range(n)]


def make_model(out: Path, layers: int, seed: int = 0) -> Path:
    """A Qwen3-Embedding-0.6B-shaped sentence-transformers folder (only what is not there yet)."""
    if (out / "modules.json").is_file():
        return out
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoModel, PreTrainedTokenizerFast

    from make_shape import qwen3_shape_config, synthetic_tokenizer

    config = qwen3_shape_config()
    config.num_hidden_layers = layers
    config.layer_types = config.layer_types[:layers] if getattr(config, "layer_types", None) else None
    base = out.with_name(out.name + "-base")
    torch.manual_seed(seed)
    AutoModel.from_config(config).to(torch.bfloat16).save_pretrained(base)
    PreTrainedTokenizerFast(tokenizer_object=synthetic_tokenizer(151643), eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(base)
    transformer = Transformer(str(base))
    SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "lasttoken"),
                                 Normalize()], device="cpu").save(str(out))
    return out


def timed(fn, reps: int) -> float:
    fn()                                        # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="the first N of the shape's 28 layers")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--out", default=None, help="the model folder (default /tmp/twostep-qwen3-embedding-<layers>l)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from twostep import LLM

    folder = make_model(Path(args.out or f"/tmp/twostep-qwen3-embedding-{args.layers}l"), args.layers)
    dtype = getattr(torch, args.dtype)
    pool = texts(max(args.batches))
    # each repetition embeds the same texts: without this, twostep's prefix cache would answer all but
    # each prompt's last block from the previous repetition
    llm = LLM(str(folder), dtype=args.dtype, kv_cache_memory="1GiB", enable_prefix_caching=False)
    st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})
    tokens = [len(llm.tokenizer.encode(t)) for t in pool]
    check = torch.tensor([o.outputs.embedding for o in llm.embed(pool[:4], use_tqdm=False)])
    expected = st.encode(pool[:4], convert_to_tensor=True).float()
    agreement = torch.nn.functional.cosine_similarity(check, expected, dim=-1).min().item()

    print(f"CPU: {cpu_model()}; torch {torch.__version__} with {torch.get_num_threads()} threads")
    print(f"model: {folder} (Qwen3-Embedding-0.6B shape, {args.layers} of 28 layers, random weights), {args.dtype}; "
          f"least cosine similarity of the two engines' embeddings: {agreement:.6f}")
    print(f"{'batch':>5} {'tokens':>7} | {'twostep texts/s':>15} {'tokens/s':>9} | {'ST texts/s':>10} {'tokens/s':>9} | "
          f"{'ratio':>5}")
    rows = []
    for b in args.batches:
        batch, n_tokens = pool[:b], sum(tokens[:b])
        ours = timed(lambda: llm.embed(batch, use_tqdm=False), args.reps)
        theirs = timed(lambda: st.encode(batch, batch_size=b), args.reps)
        rows.append({"batch": b, "tokens": n_tokens, "twostep_s": ours, "sentence_transformers_s": theirs})
        print(f"{b:>5} {n_tokens:>7} | {b / ours:>15.2f} {n_tokens / ours:>9.0f} | {b / theirs:>10.2f} "
              f"{n_tokens / theirs:>9.0f} | {theirs / ours:>5.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "layers": args.layers, "dtype": args.dtype,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
