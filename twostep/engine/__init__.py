"""The engine: LLMEngine's construction and step loop (llm_engine.py), with the input processor
(prompts -> requests) and the output processor (core outputs -> RequestOutputs) on either side."""
