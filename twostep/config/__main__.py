"""`python -m twostep.config > docs/usage.md`: the option reference, made from the config dataclasses."""
from twostep.config.reference import usage_markdown

print(usage_markdown(), end="")
