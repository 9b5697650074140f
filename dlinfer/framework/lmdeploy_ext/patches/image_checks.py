"""A request's images checked at the door, with errors that name them (written against LMDeploy 0.18.0).

Why: a vision-language model's prompt processor (`MultimodalProcessor._get_multimodal_prompt_input`,
serve/processors/multimodal.py) loads each image item (`load_from_url`, vl/media/connection.py)
and runs the model's image processor. What a client can get wrong there surfaced as:
- a data URL that is not base64, or bytes that are no image: PIL's `UnidentifiedImageError`, which
  `AsyncEngine.preprocess` turns into the API server's vague 400 "Request preprocessing failed.";
- an image of 1-3 pixels a side: the image processor's own error about a normalisation mean
  ("mean must have 1 elements ..."), as transformers takes a 1 x W x 3 array for channels-first;
- `file://` URLs and plain paths: read from the *server's* disk, whatever a remote client names.

How, for the prompt processors of dlinfer device types' VLM engines (`request_checks.MARK`, set
by `vl_preprocess`'s `VLAsyncEngine.__init__`): before LMDeploy's method runs, every image item of
every message is checked, and the first bad one is refused with a `ValueError` naming
`messages[i].content[j]` and what is wrong (the API server's 400 with that text, a pipeline's
exception):
- a data URL must be `data:<type>;base64,<payload>` with a valid base64 payload whose bytes PIL
  identifies as an image (its header only: the decode itself stays LMDeploy's);
- an image (decoded, or given as a PIL image) must be at least `MIN_SIDE` pixels a side;
- under `python -m dlinfer serve` (`refuse_local_files()`), a source of any media item (images,
  and the video, audio and time-series items LMDeploy loads the same way) that is neither an
  http(s) nor a data URL is refused: the server reads no file a client names. A pipeline in the
  user's own process keeps LMDeploy's paths and file URLs;
- a source that is empty, or not a string (LMDeploy takes the first truthy of "url" and "data"),
  is refused.
Only what LMDeploy loads is checked: the list contents of user and tool messages.
Anything else LMDeploy's loading or the image processor raises for the request's images that is
not already a `ValueError` / `TypeError` (an http fetch that fails, a decoder error) becomes a
`ValueError` naming its type and text, where it was "Request preprocessing failed.".
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
from urllib.parse import urlparse

from dlinfer.framework.lmdeploy_ext.patches.request_checks import MARK
from dlinfer.framework.lmdeploy_ext.patching import wrap

MIN_SIDE = 4  # pixels: below this transformers' image processors can mistake the channel layout
IMAGE_TYPES = ("image_url", "image")

_local_files_refused = False


def refuse_local_files() -> None:
    """From now on (this process), image sources must be http(s) or data URLs: what `serve` sets."""
    global _local_files_refused
    _local_files_refused = True


def _source(item: dict):
    """What LMDeploy loads for a media item: the "url" or else the "data" of a dict value, or the
    value itself (serve/processors/multimodal.py, `_parse_multimodal_item`)."""
    value = item.get(item.get("type"))
    if isinstance(value, dict):
        return value.get("url") or value.get("data")
    return value


def _is_local(source: str) -> bool:
    return urlparse(source).scheme.lower() not in ("http", "https", "data")


def _check_size(where: str, width: int, height: int) -> None:
    if min(width, height) < MIN_SIDE:
        raise ValueError(f"{where}: the image is {width}x{height} pixels; images of fewer than {MIN_SIDE} "
                         "pixels a side are refused")


def _check_data_url(where: str, url: str) -> None:
    from PIL import Image, UnidentifiedImageError

    head, sep, payload = url[len("data:"):].partition(",")
    head = head.lower()
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"{where}: an image data URL must be data:<type>;base64,<payload>, got {url[:40]!r}")
    try:  # whitespace (line breaks in long payloads) is allowed, as LMDeploy's decoder skips it
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: the image data URL's payload is not valid base64 ({exc})") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            size = image.size
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{where}: the image data URL's {len(data)} bytes are not an image PIL can read "
                         f"({type(exc).__name__})") from None
    _check_size(where, *size)


def check_images(messages) -> None:
    """Raise a ValueError naming the first media item of `messages` (OpenAI-style) that cannot be
    served (see the module docstring). Only the parts LMDeploy loads are looked at: list contents
    of user and tool messages, their items other than text."""
    from PIL import Image

    if isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "tool"):
            continue
        content = message.get("content")
        for j, item in enumerate(content if isinstance(content, list) else ()):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind in (None, "text"):
                continue
            where, source = f"messages[{i}].content[{j}]", _source(item)
            if isinstance(source, Image.Image):
                _check_size(where, *source.size)
            elif kind == "image_data":
                continue  # data, not a place: LMDeploy takes what it is given
            elif not source:
                raise ValueError(f"{where}: the {kind} item names nothing to load (an empty URL or no data)")
            elif not isinstance(source, str):
                raise ValueError(f"{where}: the {kind} item's URL must be a string, got {type(source).__name__}")
            elif _is_local(source):
                if _local_files_refused:
                    raise ValueError(f"{where}: this server takes media as http(s) or data URLs; it reads no path "
                                     f"on its own disk ({source[:60]!r})")
            elif kind in IMAGE_TYPES and urlparse(source).scheme.lower() == "data":
                _check_data_url(where, source)


def _patch_prompt_input(original):

    @functools.wraps(original)
    async def _get_multimodal_prompt_input(self, messages, *args, **kwargs):
        if getattr(self, MARK, None) is None:
            return await original(self, messages, *args, **kwargs)
        check_images(messages)
        try:
            return await original(self, messages, *args, **kwargs)
        except (ValueError, TypeError):
            raise
        except Exception as exc:  # noqa: BLE001  (the request's images: LMDeploy's generic 400 otherwise)
            raise ValueError(f"the request's images could not be read: {type(exc).__name__}: {exc}") from exc

    return _get_multimodal_prompt_input


def apply() -> None:
    from lmdeploy.serve.processors.multimodal import MultimodalProcessor

    wrap(MultimodalProcessor, "_get_multimodal_prompt_input", _patch_prompt_input)
