"""Engine configuration: vLLM's names where the concept is the same."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from twostep.config.kv_cache_dtype import canonical_kv_dtype, kv_format
from twostep.config.kv_transfer import KVTransferConfig
from twostep.config.options import option
from twostep.config.pooling import CONVERTS, RUNNERS, TASKS, PoolerConfig, runner_and_convert
from twostep.config.speculative import SpeculativeConfig

# --quantization (vLLM's flag): kept here with the other choices the config checks
QUANTIZATION_METHODS = ("none", "int8", "int4")


def check_quantization(method: str | None) -> None:
    """None (the checkpoint's own format) or one of QUANTIZATION_METHODS."""
    if method not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {method!r}")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Other spellings of the dtypes (vLLM's and PyTorch's): every entry point accepts them.
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "half": "float16"}


SCHEDULING_POLICIES = ("fcfs", "priority")


def canonical_dtype(name: str) -> str:
    """A dtype name as twostep spells it (float32, bfloat16, float16, auto)."""
    return DTYPE_ALIASES.get(name, name)


# where quantized products on CPU round activations to int8 (platforms/cpu/quant_linear.py)
INT8_ACTIVATION_MODES = ("off", "decode", "all")


@dataclass(slots=True)
class EngineConfig:
    """The engine's options (vLLM's names where the concept is the same)."""

    model: str | None = option(None, "HF folder, .gguf file or hub id (default: the packaged "
                               "SmolLM2-135M-Instruct GGUF)")
    dtype: str = option("auto", "the weights' and activations' dtype; auto: bfloat16 where the CPU computes "
                        "it in hardware (avx512_bf16, amx_bf16) or the GPU supports it, else float32 (CPU) or "
                        "float16 (GPU); also fp32/float, bf16, fp16/half",
                        type=canonical_dtype, choices=("auto", *DTYPES))
    quantization: str | None = option(None, "weights: unset keeps the checkpoint's format (a GGUF file's "
                                      "quantized types stay packed); none: dequantize a GGUF at load; int8 "
                                      "(per output channel) / int4 (groups of 32): quantize a float checkpoint "
                                      "at load", short="-q", choices=QUANTIZATION_METHODS)
    device: str = option("auto", "auto, cpu or cuda[:N]")
    block_size: int = option(16, "tokens per KV block")
    max_num_seqs: int = option(64, "sequences a step runs at most")
    max_num_batched_tokens: int = option(2048, "tokens a step computes at most (longer prompts are "
                                         "prefilled in chunks)")
    max_model_len: int | None = option(None, "the longest context (default: the model's, or what the KV "
                                       "cache holds)")
    kv_cache_memory: str | int | None = option(None, 'KV cache size, e.g. "2GiB" (default: '
                                               "--kv-cache-memory-fraction of free memory, capped at what "
                                               "can be used)")
    kv_cache_memory_fraction: float = option(0.25, "the share of free memory the KV cache takes when "
                                             "--kv-cache-memory is unset")
    num_kv_blocks: int | None = option(None, "an exact number of KV blocks, overriding both (tests, "
                                       "experiments)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes")
    kv_cache_dtype: str = option("auto", "KV cache storage: auto = the model's dtype; 8-bit formats hold "
                                 "~2x the tokens (fp8 = fp8_e4m3, as in vLLM)", type=canonical_kv_dtype,
                                 choices=("auto", "bfloat16", "float16", "float32", "int8", "fp8_e4m3", "fp8_e5m2"))
    attention_backend: str = option("auto", "auto: the C++ paged decode kernel on CPU where it builds, "
                                    "else PyTorch (reference)", choices=("auto", "reference", "cpu_paged"))
    cpu_prepack_weights: bool = option(True, "bf16 on CPU: linears pre-packed for oneDNN (bit-identical)")
    cpu_gemv: bool = option(True, "CPU: batch-1 linears through the C++ matrix-vector kernel: in bf16 it "
                            "keeps a row-major copy of the layer weights beside oneDNN's packed one; in "
                            "float32 the weights that hold only bf16 values stay in bf16, half the bytes")
    # True / False from Python: all / off
    cpu_int8_activations: str | bool = option(
        "decode", "quantized weights on CPU: activations rounded to int8 per block of 32 as llama.cpp "
        "rounds them, for its speed at its precision. decode: in decode steps, one user's too, any dtype; "
        "all (the flag alone): prompts too; off: never, the 16-bit activations (the float product within "
        "2**-16)", choices=INT8_ACTIVATION_MODES, const="all", negative="off")
    cpu_huge_pages: bool = option(True, "weights a decode step streams copied at load into memory advised "
                                  "for transparent huge pages (2 MiB), where the OS gives them on request")
    seed: int = option(0, "the sampling seed of requests without their own")
    max_logprobs: int = option(20, "the most logprobs / prompt_logprobs one request may ask for")
    max_n: int = option(128, "the most completions (n) one request may ask for")
    num_threads: int | None = option(None, "torch's intra-op threads on CPU (default: all cores)")
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None, 'speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\', \'{"method": "draft_model", "model": "path", '
        '"num_speculative_tokens": 4}\' or \'{"method": "mtp", "num_speculative_tokens": 2}\' (a Qwen3.5 / '
        'Qwen3-Next checkpoint\'s own multi-token-prediction layer) (the --speculative-* flags override its keys)',
        metavar="JSON", group="speculative decoding")
    gpu_memory_utilization: float | None = option(
        None, "vLLM's: the fraction of the device's memory (CPU: the machine's) for the weights and the KV "
        "cache together; the cache gets what the loaded weights leave")
    tokenizer: str | None = option(None, "a tokenizer (HF folder or hub id) other than the model's")
    scheduling_policy: str = option("fcfs", "priority: requests with a lower priority value are admitted "
                                    "first and preempted last", choices=SCHEDULING_POLICIES)
    kv_transfer_config: KVTransferConfig | dict | str | None = option(
        None, 'prefill/decode disaggregation (vLLM\'s keys), e.g. \'{"kv_connector": "ZmqConnector", '
        '"kv_role": "kv_producer", "kv_port": 14579}\' on the prefill instance and \'{"kv_connector": '
        '"ZmqConnector", "kv_role": "kv_consumer"}\' on the decode one (see `twostep proxy`)', metavar="JSON")
    tensor_parallel_size: int = option(1, "split the model over this many processes (torch.distributed: "
                                       "gloo on CPU, NCCL on GPUs); this process is rank 0, the others are "
                                       "started here", short="-tp", group="tensor parallelism")
    distributed_init_method: str | None = option(
        None, "torch.distributed's rendezvous, e.g. tcp://127.0.0.1:29500 (default: $MASTER_ADDR:$MASTER_PORT "
        "when set, else a free local port)", metavar="URL", group="tensor parallelism")
    distributed_timeout_s: float = option(60.0, "a rank that does not answer within this many seconds ends "
                                          "the engine", flag="--distributed-timeout", metavar="S",
                                          group="tensor parallelism")
    runner: str = option("auto", "generate: completions and chat from a causal LM; pooling: embeddings, "
                         "classification and scores (vLLM's runner); auto: pooling for a checkpoint made for it "
                         "(a *Model base class such as Qwen3Model, a *ForSequenceClassification, a "
                         "sentence-transformers folder), else generate", choices=RUNNERS, group="pooling")
    convert: str = option("auto", "what the pooling runner makes of the checkpoint (vLLM's): embed (the pooled "
                          "final hidden state), classify (its score head on the last token); auto: classify where "
                          "the checkpoint has a score head, else embed", choices=CONVERTS, group="pooling")
    task: str | None = option(None, "vLLM's older spelling of --runner and --convert: generate, embed, classify, "
                              "score (a pooling runner; the checkpoint says embed or classify)",
                              choices=tuple(TASKS), group="pooling")
    pooler_config: PoolerConfig | dict | str | None = option(
        None, 'the pooler over what the checkpoint says, vLLM\'s JSON: e.g. \'{"pooling_type": "MEAN", '
        '"normalize": false}\' (the --pooling-type, --normalize, --activation flags override its keys)',
        metavar="JSON", group="pooling")

    def __post_init__(self) -> None:
        self.dtype = canonical_dtype(self.dtype)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        self.kv_cache_dtype = canonical_kv_dtype(self.kv_cache_dtype)
        if isinstance(self.cpu_int8_activations, bool):
            self.cpu_int8_activations = "all" if self.cpu_int8_activations else "off"
        if self.cpu_int8_activations not in INT8_ACTIVATION_MODES:
            raise ValueError(f"cpu_int8_activations must be off, decode or all; got {self.cpu_int8_activations!r}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        kv_format(self.kv_cache_dtype)   # raises ValueError naming the choices
        check_quantization(self.quantization)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.tensor_parallel_size > 1 and self.kv_transfer_config is not None:
            raise ValueError("tensor parallelism with a KV transfer config is not supported yet")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        self.runner, self.convert = runner_and_convert(self.runner, self.convert, self.task)
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.runner == "generate" and (self.pooler_config is not None or self.convert != "auto"):
            raise ValueError("pooler_config and convert apply to the pooling runner, not --runner generate")
