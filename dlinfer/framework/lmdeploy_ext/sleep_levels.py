"""/sleep?level=2 refused on the CPU device type, as an ASGI middleware of `python -m dlinfer serve`.

Why: LMDeploy 0.18's level-2 sleep moves the weights to the meta device (discards them), and its
wakeup rebuilds the model uninitialised, expecting a trainer to send new weights through
/update_weights (CUDA IPC handles): there is no such path on the CPU, so a level-2 sleep followed
by /wakeup would serve a model of uninitialised weights. How: that request is answered 400,
naming why and what works (level 1, the default, which drops the KV cache and keeps the weights in
RAM); every other request passes through unchanged.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from dlinfer.framework.lmdeploy_ext.asgi_errors import send_error

MESSAGE = ("sleep level 2 discards the weights for new ones sent through /update_weights, which the cpu device "
           "type cannot receive; use level 1 (the default): it drops the KV cache and keeps the weights in RAM")


def _as_int(text: str):
    try:
        return int(text)
    except ValueError:
        return None  # LMDeploy answers that one 400 itself


class RefuseLevel2Sleep:
    """`app` with POST /sleep?level=2 answered 400 (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") == "/sleep":
            levels = parse_qs(scope.get("query_string", b"").decode(errors="replace")).get("level", [])
            if levels and _as_int(levels[-1]) == 2:  # as LMDeploy reads it: int() of the last value
                return await send_error(send, 400, MESSAGE)
        await self.app(scope, receive, send)
