"""twostep: an LLM inference engine that makes prefill and decode explicit."""
from twostep.config import EngineConfig
from twostep.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from twostep.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "Logprob"]
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
