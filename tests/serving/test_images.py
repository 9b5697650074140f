"""Images a client gets wrong, against a live `python -m dlinfer serve` of a tiny Qwen2-VL
(patches/image_checks.py): each is a 400 naming the item and what is wrong, where LMDeploy said
"Request preprocessing failed." or an image processor's internals, or read a file of the
server's; the server then answers a good image as before. The last test ends the module's server
with SIGKILL, a fault case of tests/serving/test_faults.py run here to save a server start: its
engine process must exit by itself."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from support.api_server import STOP_TIMEOUT_S, Server
from support.tiny_vlms import tiny_vlm

pytestmark = pytest.mark.slow


def _data_url(width: int, height: int) -> str:
    pixels = np.random.default_rng(width * 1000 + height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tiny_vlm("qwen2_vl"), tmp_path_factory.mktemp("images") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _ask(server, url):
    """A chat with one media item: `url` is an image URL, or the whole item (a dict)."""
    item = url if isinstance(url, dict) else {"type": "image_url", "image_url": {"url": url}}
    body = {"model": server.model, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is in the picture"}, item]}]}
    return server.request("POST", "/v1/chat/completions", body)


@pytest.fixture(scope="module")
def good_answer(server):
    status, answer = _ask(server, _data_url(56, 84))
    assert status == 200, answer
    return answer["choices"][0]["output_ids"]


@pytest.mark.parametrize("url,message", [
    ("data:image/png;base64,AAAAAAAA", "messages[0].content[1]: the image data URL's 6 bytes are not an image"),
    ("data:image/png;base64,@@@@", "messages[0].content[1]: the image data URL's payload is not valid base64"),
    (_data_url(1, 1), "messages[0].content[1]: the image is 1x1 pixels"),
    ("file:///etc/passwd", "messages[0].content[1]: this server takes media as http(s) or data URLs"),
    ("/etc/hostname", "it reads no path on its own disk"),
    ("http://127.0.0.1:9/a.png", "URL is blocked for security reasons"),  # LMDeploy's own check, kept
    ({"type": "image_url", "image_url": {"url": 0, "data": "/dev/zero"}}, "it reads no path on its own disk"),
    ({"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}, "it reads no path on its own disk"),
    ({"type": "time_series_url", "time_series_url": "/etc/hostname"}, "it reads no path on its own disk"),
])
def test_a_bad_image_is_a_400_naming_it_and_the_server_serves_on(server, good_answer, url, message):
    status, answer = _ask(server, url)
    assert status == 400 and message in answer["message"], (status, answer)
    status, again = _ask(server, _data_url(56, 84))
    assert status == 200 and again["choices"][0]["output_ids"] == good_answer, again


def test_engine_process_exits_when_the_server_is_killed(server):
    """Runs last: ends the module's server. SIGKILL gives the server no shutdown: the engine process
    (weights + KV cache in RAM) notices its parent is gone and exits by itself (patches/mp_engine.py)."""
    assert server.engines(), server.descendants
    server.proc.kill()
    server.proc.wait(STOP_TIMEOUT_S)
    server.assert_nothing_left("orphaned")
