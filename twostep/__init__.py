"""twostep: an LLM inference engine that makes prefill and decode explicit."""
import gc as _gc

# Importing torch creates ~250,000 objects that live as long as the process. The cycle
# collector's passes over them cost ~0.2 s of a warm `twostep generate` (~10%): while they are
# imported it is paused, and then they are frozen (gc.freeze: out of its sight, as vLLM does with its
# engine's start-up heap), so neither the import nor the load and the steps after it walk them
# again. Its state is left as it was found; gc.unfreeze() undoes the freeze.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from twostep.config import EngineConfig
    from twostep.outputs import (CompletionOutput, EmbeddingRequestOutput, Logprob, PoolingRequestOutput, RequestMetrics,
                                 RequestOutput, ScoringRequestOutput)
    from twostep.pooling_params import PoolingParams
    from twostep.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
finally:
    _gc.freeze()
    if _collecting:
        _gc.enable()

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "Logprob", "PoolingParams", "PoolingRequestOutput",
           "EmbeddingRequestOutput", "ScoringRequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM and LLMEngine pull in torch models and tokenizers: import them on first use.
    if name == "LLM":
        from twostep.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from twostep.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
