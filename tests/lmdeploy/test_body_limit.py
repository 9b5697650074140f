"""framework/lmdeploy_ext/body_limit.py on a stand-in ASGI app (the live server's 413 is in
tests/lmdeploy/test_serve.py)."""

from __future__ import annotations

import asyncio
import json

from dlinfer.framework.lmdeploy_ext.body_limit import BodyLimit


def _call(headers, chunks, limit=10):
    seen, sent = {}, []

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": headers}
    asyncio.run(BodyLimit(app, limit)(scope, receive, send))
    return seen.get("body"), sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_a_declared_length_over_the_limit_is_413_unread():
    body, status, answer = _call([(b"content-length", b"11")], [b"x" * 11])
    assert (body, status) == (None, 413)
    assert "request body of 11 bytes is over the limit of 10 bytes" in json.loads(answer)["error"]["message"]
    assert _call([(b"content-length", b"10")], [b"x" * 10])[:2] == (b"x" * 10, 200)
    assert _call([(b"content-length", b"ten")], [b"x"])[1] == 413


def test_a_chunked_body_is_counted_and_replayed():
    assert _call([], [b"abc", b"def", b"g"])[:2] == (b"abcdefg", 200)
    body, status, answer = _call([], [b"abcdef", b"ghijk"])
    assert (body, status) == (None, 413) and b"chunked" in answer


def test_other_traffic_passes_through():
    got = []

    async def app(scope, receive, send):
        got.append(scope["type"])

    asyncio.run(BodyLimit(app, 1)({"type": "lifespan"}, None, None))
    assert got == ["lifespan"]
