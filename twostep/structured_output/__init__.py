"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) compiled by
llguidance into a matcher that, step by step, gives the tokens allowed next as a packed bitmask."""
