"""A request-body limit for the API server (`python -m dlinfer serve`), as an ASGI middleware.

Why: LMDeploy's FastAPI app reads any body it is sent into memory and parses it; nothing bounds
its size, so one client can make the server hold gigabytes. How: a request announcing a
Content-Length over the limit is answered 413 before its body is read; a chunked one is read up
to the limit (the app reads the whole body before it answers anyway), answered 413 past it, and
otherwise replayed to the app unchanged. Other ASGI traffic (lifespan, websockets) passes through.
"""

from __future__ import annotations

from dlinfer.framework.lmdeploy_ext.asgi_errors import send_error


class BodyLimit:
    """`app` with HTTP request bodies limited to `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send, got: str) -> None:
        await send_error(send, 413, f"request body {got} is over the limit of {self.max_bytes} bytes "
                                    "(DLINFER_SERVE_MAX_BODY)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await self._reject(send, f"of {length.decode(errors='replace')} bytes")
            return await self.app(scope, receive, send)
        chunks, total = [], 0
        while True:  # no Content-Length (chunked): read up to the limit, then replay
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                return await self._reject(send, f"of more than {self.max_bytes} bytes (chunked)")
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
