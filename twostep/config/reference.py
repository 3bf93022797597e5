"""docs/usage.md, the option reference, made from the config dataclasses:

    python -m twostep.config > docs/usage.md
"""
from __future__ import annotations

from twostep.config.engine import EngineConfig
from twostep.config.options import option_reference
from twostep.config.speculative import SpeculativeConfig

USAGE_HEADER = """# Options

Generated from the config dataclasses (`python -m twostep.config > docs/usage.md`; a test checks it
is current). Every engine option is a field of EngineConfig: `twostep generate`, `twostep serve` and
`twostep bench` take it as the flag below, `LLM(...)` and `EngineConfig(...)` as a keyword argument
of the field's name (the flag without its dashes, `-` as `_`). SpeculativeConfig's fields are the
keys of `speculative_config`; their flags override the keys of `--speculative-config`.

"""


def usage_markdown() -> str:
    return USAGE_HEADER + option_reference(EngineConfig, SpeculativeConfig)
