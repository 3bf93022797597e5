"""docs/usage.md, the option reference, made from the config dataclasses:

    python -m twostep.config > docs/usage.md
"""
from __future__ import annotations

from twostep.config.engine import EngineConfig
from twostep.config.options import option_reference
from twostep.config.pooling import PoolerConfig
from twostep.config.replicas import ReplicaConfig
from twostep.config.speculative import SpeculativeConfig

USAGE_HEADER = """# Options

Generated from the config dataclasses (`python -m twostep.config > docs/usage.md`; a test checks it
is current). Every engine option is a field of EngineConfig: `twostep generate`, `twostep serve` and
`twostep bench` take it as the flag below, `LLM(...)` and `EngineConfig(...)` as a keyword argument
of the field's name (the flag without its dashes, `-` as `_`). SpeculativeConfig's fields are the
keys of `speculative_config`; their flags override the keys of `--speculative-config`, as
PoolerConfig's override the keys of `--pooler-config`.

"""

POOLING_SECTION = """
## Pooling: embeddings, rerank, score

A pooling model makes one vector per prompt instead of text: `--runner pooling` (vLLM's), which
`--runner auto` picks for a checkpoint made for it: a base model class without an lm_head (`Qwen3Model`,
as Qwen3-Embedding ships), a `*ForSequenceClassification` (a cross-encoder: its `score` head on the
last token) or a sentence-transformers folder (its `1_Pooling` mode, LAST, MEAN or CLS, and whether a
`Normalize` module follows; where its saved config lists the "message" modality, as
sentence-transformers 6 saves it around a tokenizer with a chat template, each text is read as one user
message through the template, as its `encode` does). Any causal LM embeds with `--runner pooling`
(last token, normalised).
`--task embed|classify|score` is vLLM's older spelling. Each prompt is prefill only: batched and
chunked with the others, freed when its prompt is done; MEAN and CLS skip prefix-cache hits (they read
every position). `dimensions` (Matryoshka) is accepted only where config.json has `is_matryoshka` or
`matryoshka_dimensions`.

    twostep serve Qwen/Qwen3-Embedding-0.6B                    # embeddings
    twostep serve ./reranker --runner pooling --convert classify  # a cross-encoder: score, rerank
    twostep serve ./causal-lm --runner pooling --pooling-type mean --no-normalize

| route | body | answer |
|---|---|---|
| `POST /v1/embeddings` | OpenAI's: `input` (text, texts, token ids or lists of them), `encoding_format` float or base64 (little-endian float32), `dimensions`; vLLM's `normalize`, `truncate_prompt_tokens` | `data[i].embedding`, `usage` |
| `POST /v1/score` | vLLM's: `text_1` (one, or as many as `text_2`), `text_2`; `activation` | `data[i].score` |
| `POST /v1/rerank` (`/rerank`, `/v2/rerank`) | Jina's and Cohere's: `query`, `documents`, `top_n`, `return_documents` | `results` best first: `index`, `relevance_score`, `document` |

A cross-encoder scores a pair as one prompt, the two texts joined as its tokenizer joins a pair, with
sigmoid on its one logit (`activation: false`: the logit); an embedding model scores the cosine
similarity of the two embeddings. A generating server answers these routes 400, a pooling server the
completions and chat routes. Offline: `LLM(model).embed(texts)` (`.outputs.embedding`),
`LLM.score(text_1, text_2)` (`.outputs.score`), `LLM.classify(texts)` (`.outputs.probs`), `LLM.encode`.
"""

REPLICAS_SECTION = """
`twostep serve` only: with any of these set the server runs its engines as replicas on Ray Serve
(`pip install 'twostep[ray]'`) behind its one endpoint; see "Scaling out" in docs/features.md.
"""


def usage_markdown() -> str:
    return (USAGE_HEADER + option_reference(EngineConfig, SpeculativeConfig, PoolerConfig) + POOLING_SECTION
            + "\n" + option_reference(ReplicaConfig) + REPLICAS_SECTION)
