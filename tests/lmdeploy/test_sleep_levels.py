"""framework/lmdeploy_ext/sleep_levels.py on a stand-in ASGI app (the live server's answer is in
tests/lmdeploy/test_serve.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from dlinfer.framework.lmdeploy_ext.sleep_levels import RefuseLevel2Sleep


def _call(method, path, query):
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": query.encode()}
    asyncio.run(RefuseLevel2Sleep(app)(scope, receive, send))
    return bool(reached), sent[0]["status"], (json.loads(sent[1]["body"]) if sent[1]["body"] else None)


@pytest.mark.parametrize("query", ["level=2", "level=02", "level=1&level=2"])
def test_level_2_sleep_is_400_naming_why_and_never_reaches_the_engine(query):
    reached, status, body = _call("POST", "/sleep", query)
    assert (reached, status) == (False, 400)
    assert "level 1" in body["error"]["message"] and "cpu" in body["error"]["message"]


@pytest.mark.parametrize("method,path,query", [("POST", "/sleep", ""), ("POST", "/sleep", "level=1"),
                                               ("POST", "/sleep", "level=x"), ("GET", "/sleep", "level=2"),
                                               ("POST", "/wakeup", "level=2")])
def test_everything_else_passes_through(method, path, query):
    assert _call(method, path, query)[:2] == (True, 200)
