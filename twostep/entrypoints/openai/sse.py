"""Server-sent events: a stream of chunks as `data: {...}` lines ending with `data: [DONE]`; an
error mid-stream becomes an error event.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from twostep.entrypoints.openai.errors import _ERROR_TYPES, APIError

logger = logging.getLogger(__name__)


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as e:        # after the stream started: an error event, then the end
            logger.warning("stream ended by an error: %s", e.message)
            error = {"message": e.message, "type": _ERROR_TYPES.get(e.status, "APIError"),
                     "param": e.param, "code": e.status}
            yield f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
