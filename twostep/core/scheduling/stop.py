"""The stop rules that depend on tokens only (vLLM's check_stop): EOS, stop_token_ids and the
length limit, with min_tokens holding back the first two. Stop strings need text and stay with
detokenization (engine/output_processor.py)."""
from __future__ import annotations

from twostep.core.scheduling.request import Request


def check_stop(request: Request, token: int) -> tuple[str, int | None] | None:
    """After appending token: (finish_reason, stop_reason) if the request ends here, else None."""
    p = request.params
    if len(request.output_token_ids) >= p.min_tokens:
        if token in p.all_stop_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
    if request.num_tokens >= request.max_total_tokens:
        return "length", None
    return None
