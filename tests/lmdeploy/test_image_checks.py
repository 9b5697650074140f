"""patches/image_checks.py: a request's images refused at the door with errors naming the item
(no engine here; the live server's answers are in tests/serving/test_images.py)."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from dlinfer.framework.lmdeploy_ext.patches import image_checks, request_checks


def _data_url(width: int, height: int, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _messages(*items) -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, *items]}]


@pytest.fixture
def refusing_local_files(monkeypatch):
    monkeypatch.setattr(image_checks, "_local_files_refused", True)


def test_good_images_pass(refusing_local_files):
    image_checks.check_images(_messages({"type": "image_url", "image_url": {"url": _data_url(56, 40)}},
                                        {"type": "image_url", "image_url": _data_url(4, 4, "JPEG")},
                                        {"type": "image", "image": Image.new("RGB", (8, 9))},
                                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}))
    image_checks.check_images("a plain prompt")  # not messages: nothing to check


@pytest.mark.parametrize("item,message", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}},
     "messages[1].content[1]: the image data URL's payload is not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAAAAAA"}},
     "messages[1].content[1]: the image data URL's 6 bytes are not an image PIL can read (UnidentifiedImageError)"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,abc"}},
     "messages[1].content[1]: an image data URL must be data:<type>;base64,<payload>"),
    ({"type": "image_url", "image_url": {"url": _data_url(1, 1)}},
     "messages[1].content[1]: the image is 1x1 pixels; images of fewer than 4 pixels a side are refused"),
    ({"type": "image", "image": Image.new("RGB", (3, 50))},
     "messages[1].content[1]: the image is 3x50 pixels"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
     "messages[1].content[1]: this server takes media as http(s) or data URLs; it reads no path on its own disk"),
    ({"type": "image_url", "image_url": "/etc/hostname"}, "it reads no path on its own disk ('/etc/hostname')"),
    ({"type": "image_url", "image_url": {"url": ""}}, "messages[1].content[1]: the image_url item names nothing"),
    ({"type": "image_url", "image_url": {"url": 0, "data": "/dev/zero"}}, "reads no path on its own disk ('/dev/"),
    ({"type": "image_url", "image_url": {"url": ["x"]}}, "the image_url item's URL must be a string, got list"),
    ({"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}, "takes media as http(s) or data URLs"),
    ({"type": "audio", "audio": "/tmp/a.wav"}, "reads no path on its own disk ('/tmp/a.wav')"),
    ({"type": "image_url", "image_url": {"url": "DATA:image/png;base64,@@@@"}}, "payload is not valid base64"),
])
def test_a_bad_image_is_a_value_error_naming_it(item, message, refusing_local_files):
    with pytest.raises(ValueError) as err:
        image_checks.check_images(_messages(item))
    assert message in str(err.value) and str(err.value).startswith("messages[1].content[1]: "), str(err.value)


def test_only_what_lmdeploy_loads_is_checked(refusing_local_files):
    """LMDeploy loads the list contents of user and tool messages only; base64 may be wrapped."""
    image_checks.check_images([{"role": "assistant", "content": [{"type": "image_url", "image_url": "/etc/x"}]},
                               {"role": "system", "content": [{"type": "image_url", "image_url": ""}]}])
    url = _data_url(8, 8).replace("base64,", "base64,\n")
    image_checks.check_images(_messages({"type": "image_url", "image_url": {"url": url[:60] + "\n" + url[60:]}}))
    with pytest.raises(ValueError, match="messages[0].content[0]: this server takes media".replace("[", r"\[")):
        image_checks.check_images([{"role": "tool", "content": [{"type": "image", "image": "file:///x"}]}])


def test_paths_stay_allowed_outside_the_server(monkeypatch):
    """A pipeline in the user's own process may name its own files (LMDeploy's behaviour)."""
    monkeypatch.setattr(image_checks, "_local_files_refused", False)
    image_checks.check_images(_messages({"type": "image_url", "image_url": {"url": "/tmp/picture.png"}}))


def test_the_wrapper_checks_only_dlinfer_engines_processors_and_names_other_failures(refusing_local_files):
    calls = []

    async def original(self, messages, *args, **kwargs):
        calls.append(messages)
        raise OSError("connection reset")

    wrapped = image_checks._patch_prompt_input(original)
    bad = _messages({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}})
    with pytest.raises(OSError):  # not a dlinfer engine's processor: LMDeploy's behaviour
        asyncio.run(wrapped(SimpleNamespace(), bad))
    marked = SimpleNamespace(**{request_checks.MARK: "cpu"})
    with pytest.raises(ValueError, match="reads no path"):
        asyncio.run(wrapped(marked, bad))
    assert len(calls) == 1
    good = _messages({"type": "image_url", "image_url": {"url": _data_url(8, 8)}})
    with pytest.raises(ValueError, match="the request's images could not be read: OSError: connection reset"):
        asyncio.run(wrapped(marked, good))
