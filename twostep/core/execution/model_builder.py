"""One builder for a model and its cache, used by the engine (the target) and by the draft-model
proposer alike: load the checkpoint, build the decoder, bind it to the platform's kernels, plan
and allocate the paged KV cache with its block manager, and make the model runner."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from twostep.attention.linear_state import allocate_state_cache
from twostep.attention.selector import get_attention_backend
from twostep.config import PoolingModel, kv_format
from twostep.distributed.parallel import TensorParallel
from twostep.core.execution.model_runner import ModelRunner
from twostep.core.execution.pooler import Pooler
from twostep.kv.block_tables import BlockTables
from twostep.kv.cache_tensors import (KVCachePlan, KVGroupNeed, allocate_kv_cache, available_memory, parse_bytes,
                                      plan_kv_cache)
from twostep.kv.kv_cache_manager import KVCacheManager, KVGroupSpec
from twostep.layers.dispatch import apply_platform, weight_bytes
from twostep.models.config import ModelConfig
from twostep.models.causal_lm import CausalLM
from twostep.models.fused_decode import ANY_ROWS, fuse_decode
from twostep.models.loader import build_model, load_checkpoint, num_weights
from twostep.platforms import Platform
from twostep.sample.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CacheSpec:
    """How big the paged KV cache is and how it stores K/V."""

    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # exact count (tests, the draft's = the target's), or each KV-cache group's (a TP worker: rank 0's)
    num_blocks: int | tuple[int, ...] | None = None
    memory: str | int | None = None            # else a byte budget ("2GiB")
    memory_fraction: float = 0.25              # else this fraction of free memory,
    max_num_seqs: int = 64                     # capped at what this many full-length sequences use
    max_num_batched_tokens: int = 2048         # a prefill chunk's most tokens (a window's blocks hold one)
    # vLLM's gpu_memory_utilization: this fraction of the device's (CPU: the machine's) memory for
    # everything this process holds, weights included; the KV cache gets what the weights leave
    memory_utilization: float | None = None
    # a hybrid model's state slots (kv/state_slots.py): exact count, else a live one per sequence
    # and as many for saved prompt states, within half the cache's budget
    num_state_slots: int | None = None


@dataclass(slots=True)
class ModelSpec:
    path: str
    dtype: torch.dtype
    platform: Platform
    max_model_len: int | None = None           # None: what the model supports
    cap_max_model_len: bool = False            # True: cap at the model's limit instead of refusing
    attention_backend: str = "auto"
    vocab_size: int | None = None              # the vocabulary it must have (a draft: the target's)
    quantization: str | None = None            # EngineConfig.quantization
    tp: TensorParallel = TensorParallel()      # this process's rank and the tensor-parallel size
    pooling: PoolingModel | None = None        # a pooling engine's (models/pooling.py): the runner pools


@dataclass(slots=True)
class ModelInstance:
    """A loaded model with its cache, ready to run steps."""

    path: str
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    model: CausalLM
    kv_plan: KVCachePlan
    num_state_slots: int                       # a hybrid model's state slots (0: none)
    kv_manager: KVCacheManager
    runner: ModelRunner
    tokenizer_source: object                   # an HF folder, or the tokenizer a GGUF file carries
    generation_config: dict


def build_model_instance(spec: ModelSpec, cache: CacheSpec, sampler: Sampler) -> ModelInstance:
    device = spec.platform.device
    ckpt = load_checkpoint(spec.path, spec.dtype, spec.quantization)
    weights = num_weights(ckpt)
    config = ckpt.config
    if spec.vocab_size is not None and config.vocab_size != spec.vocab_size:
        raise ValueError(f"model {spec.path} has a vocabulary of {config.vocab_size} tokens where "
                         f"{spec.vocab_size} are needed: a draft must share the target's tokenizer")
    max_model_len = resolve_max_model_len(config, spec.max_model_len, spec.cap_max_model_len)
    model = build_model(ckpt, spec.dtype, device, max_model_len, spec.tp)
    ckpt.tensors = {}
    shard = model.config                       # this rank's heads (the whole model's at size 1)
    for line in apply_platform(model, spec.platform, spec.dtype):
        logger.info(line)
    spec.platform.release_memory()
    held = weight_bytes(model)
    logger.info("weights: %.1f MiB for %.1fM weights (%.2f bits per weight)", held / 2**20, weights / 1e6,
                8 * held / max(weights, 1))
    # Sized after the weights are in place: "a fraction of free memory" means what they left.
    num_slots, state_bytes = _plan_states(shard, spec.dtype, device, cache)
    if state_bytes and cache.memory is not None:
        cache = dataclasses.replace(cache, memory=max(parse_bytes(cache.memory) - state_bytes, 1))
    plan = _plan_kv(shard, spec.dtype, device, cache, max_model_len)
    max_model_len = _fit_to_cache(max_model_len, plan, cache, explicit=spec.max_model_len is not None)
    fmt = kv_format(cache.kv_cache_dtype)
    layer_caches = allocate_kv_cache(plan, shard.num_layers, shard.num_kv_heads, shard.head_dim,
                                     spec.dtype, device, fmt, [shard.kv_group(i) for i in range(shard.num_layers)])
    states = None
    if num_slots:
        state_caches, *states = allocate_state_cache(
            len(shard.linear_layers), num_slots, shard.linear_conv_kernel, shard.linear_conv_dim,
            shard.linear_num_value_heads, shard.linear_key_head_dim, shard.linear_value_head_dim, spec.dtype,
            device, group=len(plan.groups))
        for layer, c in zip(shard.linear_layers, state_caches):
            layer_caches[layer] = c
        logger.info("linear-attention states: %d slots of %.2f MiB (%d layers: a live one per running sequence, "
                    "the others saved prompt states for the prefix cache), %.1f MiB; K/V only for the %d attention "
                    "layers", num_slots, state_bytes / num_slots / 2**20, len(shard.linear_layers),
                    state_bytes / 2**20, len(shard.attention_layers))
    backend = get_attention_backend(spec.attention_backend, spec.platform, spec.dtype, fmt)
    # a model without an lm_head (a pooling checkpoint's) never decodes
    model.fused_decode = None if model.lm_head is None else fuse_decode(model, spec.platform, spec.dtype, backend)
    if model.fused_decode is not None:
        rows = model.fused_decode.max_rows
        logger.info("decode steps of %s: the %d layers in one C++ call",
                    "any batch" if rows >= ANY_ROWS else f"up to {rows} rows", shard.num_layers)
    runner = ModelRunner(model, layer_caches, cache.block_size, backend, device, sampler,
                         tuple(states) if states else None, _pooler(spec.pooling, model, spec.path))
    first, *more = plan.groups
    kv_manager = KVCacheManager(first.num_blocks, cache.block_size, cache.enable_prefix_caching, first.window,
                                [KVGroupSpec(g.num_blocks, g.window) for g in more], num_slots)
    return ModelInstance(spec.path, config, spec.dtype, device, max_model_len, model, plan, num_slots,
                         kv_manager, runner, ckpt.tokenizer_source, dict(ckpt.generation_config or {}))


def _pooler(pooling: PoolingModel | None, model: CausalLM, path: str) -> Pooler | None:
    """A pooling engine's pooler; a classifier's score head must have the labels its config names."""
    if pooling is None:
        return None
    if pooling.task == "classify" and (model.score is None or model.score.out_features != pooling.num_labels):
        found = "no score head" if model.score is None else f"a score head of {model.score.out_features} labels"
        raise ValueError(f"{path}: its config names {pooling.num_labels} labels, its weights have {found}")
    return Pooler(pooling, model.score)


def _plan_states(config: ModelConfig, dtype: torch.dtype, device: torch.device, cache: CacheSpec) -> tuple[int, int]:
    """A hybrid model's state slots and their bytes: a live one per sequence (max_num_seqs) and, with
    prefix caching, as many for saved prompt states; no more than half of the cache's budget (then
    fewer sequences run at once: admission waits for a free slot)."""
    if not config.linear_layers:
        return 0, 0
    per_slot = config.state_bytes(torch.empty((), dtype=dtype).element_size())
    if cache.num_state_slots is not None:
        return cache.num_state_slots, cache.num_state_slots * per_slot
    want = cache.max_num_seqs * (2 if cache.enable_prefix_caching else 1)
    if cache.num_blocks is None:
        budget = (parse_bytes(cache.memory) if cache.memory is not None
                  else int(available_memory(device) * cache.memory_fraction))
        want = max(2, min(want, budget // 2 // per_slot))
    return want, want * per_slot


def resolve_max_model_len(config: ModelConfig, requested: int | None, cap: bool = False) -> int:
    limit = config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        if cap:
            return limit
        raise ValueError(f"max_model_len {requested} exceeds what the model supports ({limit})")
    return requested


def _fit_to_cache(max_model_len: int, plan: KVCachePlan, cache: CacheSpec, explicit: bool) -> int:
    """A sequence of max_model_len tokens must fit the cache sized from memory: a default
    max_model_len is lowered to what fits, an explicit one that does not fit is refused. An exact
    block count (tests, a draft model's cache) is taken as it is."""
    if cache.num_blocks is not None or plan.num_tokens >= max_model_len:
        return max_model_len
    if explicit:
        raise ValueError(f"max_model_len {max_model_len} needs {max_model_len} tokens of KV cache, but the "
                         f"cache holds {plan.num_tokens} ({plan.total_bytes / 2**20:.1f} MiB): raise "
                         "--kv-cache-memory or lower --max-model-len")
    logger.info("max_model_len lowered from %d to %d: what the KV cache holds (raise --kv-cache-memory "
                "for longer sequences)", max_model_len, plan.num_tokens)
    return plan.num_tokens


def _window_group_blocks(tables: BlockTables, cache: CacheSpec, max_model_len: int) -> int:
    """The most blocks a sliding-window group's sequences hold at once: each keeps its window (and
    the block the window starts in), and a step adds the blocks of at most max_num_batched_tokens new
    tokens between them (and a part-filled block each); no sequence more than it could ever hold."""
    seqs, chunk = cache.max_num_seqs, cache.max_num_batched_tokens
    shared = seqs * (tables.blocks_needed(tables.window) + 2) + tables.blocks_needed(chunk)
    return min(shared, seqs * tables.sequence_blocks(max_model_len, chunk))


def _plan_kv(config: ModelConfig, dtype: torch.dtype, device: torch.device, cache: CacheSpec,
             max_model_len: int) -> KVCachePlan:
    """The pool sizes itself in bytes: an 8-bit format gets about twice bf16's blocks. A mixed
    model's sliding-window layers get blocks of their own, a window's worth per sequence."""
    fmt = kv_format(cache.kv_cache_dtype)
    needs = []
    for g, window in enumerate(config.kv_group_windows):
        layers = sum(config.kv_group(i) == g for i in range(config.num_layers))
        per_token = fmt.bytes_per_token(layers, config.num_kv_heads, config.head_dim, dtype)
        most = None
        if g > 0:     # a sliding-window group: the most its sequences hold at once
            most = _window_group_blocks(BlockTables(1, cache.block_size, window), cache, max_model_len)
        needs.append(KVGroupNeed(layers, per_token, window, most))
    plan = plan_kv_cache(needs, cache.block_size, device, cache.memory, cache.memory_fraction,
                         cache.max_num_seqs * max_model_len, cache.num_blocks, cache.memory_utilization)
    dtype_name = str(dtype).removeprefix("torch.")
    if fmt.quantized:
        plain = kv_format("auto").bytes_per_token(config.num_layers, config.num_kv_heads,
                                                  config.head_dim, dtype)
        logger.info("%s KV: %.2fx the tokens of %s KV in the same memory", fmt.name,
                    plain / plan.bytes_per_token, dtype_name)
    return dataclasses.replace(plan, kv_dtype=fmt.name if fmt.storage else dtype_name,
                               scaled=fmt.quantized)
