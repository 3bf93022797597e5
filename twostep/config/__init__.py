"""Configuration values, at the bottom of the layers: the engine's settings (vLLM's names), the
speculative-decoding config, the KV-cache formats and the pooler."""
from twostep.config.engine import DTYPES, QUANTIZATION_METHODS, EngineConfig, check_quantization
from twostep.config.kv_cache_dtype import KV_FORMATS, SCALE_DTYPE, KVFormat, kv_format
from twostep.config.kv_transfer import KVTransferConfig
from twostep.config.pooling import PoolerConfig, PoolingModel
from twostep.config.speculative import SpeculativeConfig

__all__ = ["DTYPES", "QUANTIZATION_METHODS", "EngineConfig", "check_quantization", "KV_FORMATS", "SCALE_DTYPE", "KVFormat", "kv_format",
           "SpeculativeConfig", "KVTransferConfig", "PoolerConfig", "PoolingModel"]
