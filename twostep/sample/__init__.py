"""Turning logits into tokens: the sampler (penalties, temperature, top-k/top-p/min-p, seeded
generators, logprobs) and, beside it, the rejection sampler that verifies speculative drafts."""
