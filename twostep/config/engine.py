"""Engine configuration: vLLM's names where the concept is the same."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from twostep.config.kv_cache_dtype import canonical_kv_dtype, kv_format
from twostep.config.kv_transfer import KVTransferConfig
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


@dataclass(frozen=True, slots=True)
class CpuOptions:
    """How the CPU platform runs (EngineConfig's cpu_* fields, platforms/cpu)."""
    prepack_weights: bool = True       # bf16: oneDNN pre-packed linears (bit-identical)
    gemv: bool = True                  # C++ matrix-vector kernel: bf16 1-3 rows (keeps row-major weights too);
    #                                    float32: bf16-valued weights kept in bf16 (platforms/cpu/bf16_weights.py)
    int8_activations: str = "decode"   # quantized weights: where activations are rounded to int8 (off | decode | all)
    huge_pages: bool = True            # the weights a decode step streams in 2 MiB pages, where the OS gives them


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None               # folder, .gguf file or hub id; None -> packaged default
    dtype: str = "auto"                    # auto | float32 | bfloat16 | float16
    # Weights: None keeps the checkpoint's format (GGUF types stay packed); "none" dequantizes a
    # GGUF file at load; "int8" / "int4" quantize a float checkpoint's linears at load.
    quantization: str | None = None
    device: str = "auto"                   # auto | cpu | cuda[:N]
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None       # default: the model's max_position_embeddings
    kv_cache_memory: str | int | None = None   # e.g. "2GiB"; default: a fraction of free memory
    kv_cache_memory_fraction: float = 0.25     # of free memory, when kv_cache_memory is unset
    num_kv_blocks: int | None = None       # exact block count, overriding both (tests, experiments)
    enable_prefix_caching: bool = True     # reuse KV blocks of shared prompt prefixes
    kv_cache_dtype: str = "auto"           # auto (= model dtype) | bfloat16 | float16 | float32 | int8 | fp8_e4m3 | fp8_e5m2
    attention_backend: str = "auto"        # auto (C++ paged decode kernel on CPU) | reference | cpu_paged
    cpu_prepack_weights: bool = True       # bf16 on CPU: oneDNN pre-packed linears (bit-identical)
    cpu_gemv: bool = True                  # CpuOptions.gemv
    # quantized weights on CPU (from 1 row; a row-layout part from 8): int8 activations as llama.cpp rounds them
    # (faster, noisier): "decode" in decode batches, "all" also prompts, "off"; True / False: all / off
    cpu_int8_activations: str | bool = "decode"
    cpu_huge_pages: bool = True            # decode's weights in transparent huge pages (2 MiB), where the OS gives them
    seed: int = 0                          # for requests without their own seed
    max_logprobs: int = 20                 # the most logprobs / prompt_logprobs a request may ask
    max_n: int = 128                       # the most completions one request may ask for
    num_threads: int | None = None         # torch intra-op threads on CPU
    # Speculative decoding: a SpeculativeConfig, its dict or JSON text (--speculative-config).
    speculative_config: SpeculativeConfig | dict | str | None = None
    # vLLM's: the fraction of the device's (CPU: the machine's) memory for weights + KV cache
    gpu_memory_utilization: float | None = None
    tokenizer: str | None = None           # a tokenizer folder other than the model's own
    scheduling_policy: str = "fcfs"        # fcfs | priority (lower priority value first, vLLM's rule)
    # Prefill/decode disaggregation: a KVTransferConfig, its dict or JSON text (--kv-transfer-config).
    kv_transfer_config: KVTransferConfig | dict | str | None = None
    # Tensor parallelism: ranks (processes) one model is split over; rank 0 is this process.
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None   # e.g. tcp://10.0.0.1:29500; default $MASTER_ADDR:$MASTER_PORT or a free local port
    distributed_timeout_s: float = 60.0          # a rank that does not answer within it ends the engine

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

    @property
    def cpu(self) -> CpuOptions:
        return CpuOptions(self.cpu_prepack_weights, self.cpu_gemv, self.cpu_int8_activations, self.cpu_huge_pages)
