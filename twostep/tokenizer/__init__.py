"""Text <-> token ids: the fast tokenizer with chat templates (tokenizer.py) and the incremental,
UTF-8-safe detokenizer with stop strings (detokenizer.py)."""
