"""One file per model family, each built from the shared blocks (layers/): its config reader,
its layer kind and its checkpoint's tensor names. models/registry.py looks them up."""
from twostep.models.families import (gemma, glm4, gpt_oss, granite, llama, mixtral, olmo2, olmoe, phi3, qwen,
                                     qwen2_moe, qwen3_5, qwen3_moe, qwen3_next, smollm3)

FAMILIES = [llama.LLAMA, llama.MISTRAL, qwen.QWEN2, qwen.QWEN3, gemma.GEMMA2, gemma.GEMMA3,
            phi3.PHI3, smollm3.SMOLLM3, olmo2.OLMO2, granite.GRANITE, glm4.GLM4,
            qwen3_moe.QWEN3_MOE, mixtral.MIXTRAL, gpt_oss.GPT_OSS, olmoe.OLMOE,
            qwen2_moe.QWEN2_MOE, qwen3_5.QWEN3_5, qwen3_next.QWEN3_NEXT]
