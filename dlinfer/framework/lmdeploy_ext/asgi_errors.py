"""The error answer dlinfer's ASGI middlewares in front of LMDeploy's app send (body_limit.py,
sleep_levels.py): JSON in the OpenAI error shape LMDeploy's own 4xx answers use."""

from __future__ import annotations

import json


async def send_error(send, status: int, message: str) -> None:
    """Answer the request with `status` and {"error": {"message", "type", "code"}}."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
