"""Quantized weights kept quantized: one packed layout (packed.py) that GGUF's block types
(gguf_blocks.py) and the formats quantized at load from a float checkpoint (quantize.py) map onto,
and that the platform's kernels read (platforms/cpu/quant_linear.py)."""
