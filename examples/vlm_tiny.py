"""Ask a vision-language model one question about an image, on the CPU, through `lmdeploy.pipeline`.

    python examples/vlm_tiny.py                      # a tiny random InternVL, built offline
    python examples/vlm_tiny.py --arch qwen2_vl      # ... or Qwen2-VL / qwen2_5_vl
    python examples/vlm_tiny.py --model /path/to/Qwen2-VL-2B-Instruct --image photo.jpg

Without --model the checkpoint is one of the test suite's tiny random-weight VLMs
(tests/support/tiny_vlms.py, cached in .cache/tests): it runs in seconds and answers with
random tokens. With --model, any checkpoint of an architecture docs/lmdeploy.md lists as
supported (InternVL "-hf", Qwen2-VL, Qwen2.5-VL). No torchvision is needed: dlinfer builds the
model's transformers processor without its video processor (docs/lmdeploy.md, "Vision-language
models").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiny_checkpoint(arch: str) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from support.tiny_vlms import tiny_vlm

    return tiny_vlm(arch)


def demo_image():
    """A 112x56 picture: a blue sky over a green field, a red sun."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (112, 56), (90, 150, 230))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 36, 111, 55), fill=(60, 160, 70))
    draw.ellipse((78, 6, 98, 26), fill=(230, 50, 40))
    return image


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a HF checkpoint folder (default: a tiny random VLM)")
    parser.add_argument("--arch", default="internvl", choices=("internvl", "qwen2_vl", "qwen2_5_vl"),
                        help="which tiny VLM to build when --model is not given")
    parser.add_argument("--image", help="an image file (default: a drawn 112x56 picture)")
    parser.add_argument("--question", default="Describe the image.")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--graph", action="store_true", help="compile decode steps (eager_mode=False)")
    args = parser.parse_args(argv)

    import dlinfer.framework.lmdeploy_ext  # noqa: F401  -- patches LMDeploy 0.18.x, once
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from PIL import Image

    model = args.model or str(tiny_checkpoint(args.arch))
    image = Image.open(args.image).convert("RGB") if args.image else demo_image()
    config = PytorchEngineConfig(device_type="cpu", eager_mode=not args.graph)
    start = time.perf_counter()
    with pipeline(model, backend_config=config, log_level="ERROR") as pipe:
        print(f"model {model} ready in {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        out = pipe((args.question, image), gen_config=GenerationConfig(max_new_tokens=args.max_new_tokens))
    print(f"Q: {args.question}\nA: {out.text!r}")
    print(f"({out.input_token_len} prompt tokens with the image, {out.generate_token_len} generated, "
          f"{time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
