"""What kind of step a forward belongs to, for the platform kernels that choose by it.

The model runner sets it around a step's forward and its logits, as torch.autocast sets a dtype
for the ops inside it (and vLLM a forward context); a linear method reads it. A layer sees only
its input rows: eight rows may be eight sequences' next tokens or one prompt's first eight, and
only the step knows which.

One fact so far: a decode batch, a step in which every row is a generated position, one sequence's
next token or a draft token it verifies (no prompt rows, not even a prompt's last token alone).
With --cpu-int8-activations decode (the default), the quantized products of such steps (the lm_head's
included) round their activations to int8 (platforms/cpu/quant_linear.py): a verified draft's row
is the row plain decoding would have computed for that token (where a product does not depend on
the rows beside it), so greedy speculation in steps of decodes alone keeps plain decoding's tokens
(a draft verified beside a prompt chunk is not in a decode batch). The decode stack (models/fused_decode.py) takes such steps with one row per
sequence (no drafts).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_decode_batch: contextvars.ContextVar[bool] = contextvars.ContextVar("twostep_decode_batch", default=False)


@contextlib.contextmanager
def decode_batch(active: bool) -> Iterator[None]:
    """Within it, in_decode_batch() is `active` (this thread and context only)."""
    token = _decode_batch.set(active)
    try:
        yield
    finally:
        _decode_batch.reset(token)


def in_decode_batch() -> bool:
    return _decode_batch.get()
