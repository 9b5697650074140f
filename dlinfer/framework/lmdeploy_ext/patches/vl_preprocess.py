"""Image preprocessing of vision-language models without torchvision (written against LMDeploy 0.18.0).

Why: LMDeploy's preprocessors of InternVL (HF-native, `InternVL3VisionModel.build_preprocessor` in
vl/model/internvl3_hf.py) and Qwen2-VL / Qwen2.5-VL (`Qwen2VLModel.build_preprocessor` in
vl/model/qwen2.py) load `transformers.AutoProcessor` for the model.
transformers 4.57's processors of these models hold an image processor, a tokenizer and a video
processor, and every video processor class requires torchvision (`AutoVideoProcessor` raises
ImportError without it), though LMDeploy's preprocessing of these models calls only the image
processor and the tokenizer. torchvision has no CPU build that imports next to the CPU torch
dlinfer runs on, so these VLMs could not start there. Two more things stand in the way on a CPU:
- a VLM dlinfer does not run fails in its preprocessor (torchvision, remote code) before the
  model check (`backend/model_support.py`, at engine build) could refuse it by name;
- `vl/engine.py:_resolve_mm_feature_dtype` maps dtype="float16"/"bfloat16" only, so
  `dtype="float32"` is a KeyError, and dtype="auto" casts pixel values to the checkpoint's dtype
  even where dlinfer runs the model in another (a float16 checkpoint runs in float32 on a CPU).

How: for the pytorch engine of a dlinfer device type only (the device type of `backend_config`):
- `VLAsyncEngine.__init__` (serve/core/vl_async_engine.py, which builds the vision model through
  `ImageEncoder` before the engine) first runs `model_support.check_architecture` on the
  checkpoint's config, so an unsupported VLM is refused by name, then runs LMDeploy's `__init__`
  with the flag below set;
- with the flag set, `build_preprocessor` of the remote-code InternVL (`InternVLVisionModel` in
  vl/model/internvl.py: InternVL 1.5 / 2, dynamic tiles) builds its per-tile transform without
  torchvision (`TileTransform`: RGB, bicubic resize with PIL, as torchvision's `Resize` does on a
  PIL image, scale to [0, 1], normalise by ImageNet's mean and std), then sets what LMDeploy's
  method sets;
- with the flag set, `build_preprocessor` of `InternVL3VisionModel` and `Qwen2VLModel` loads the
  model's own transformers processor class restricted to its image processor and tokenizer
  (`image_only_processor`: the class with `attributes` minus "video_processor"; same
  `from_pretrained`, same processor_config.json), then sets what LMDeploy's method sets (its
  lines, mirrored below). The image processor is transformers' choice for the checkpoint: the
  slow (PIL + numpy) class where torchvision is missing, also for checkpoints saved with a fast one;
- `vl/engine.py:_resolve_mm_feature_dtype` returns the dtype the engine runs the model in
  (`model_dtype.py`), so pixel values reach the vision tower in that dtype (float32 for a float32
  checkpoint, as HF transformers' processor makes them).
The last three are wrapped when the first VLM engine of a dlinfer device type starts, not at
import: importing `lmdeploy.vl.engine` imports every LMDeploy VL model module (~0.8 s), which
every import of the adaptor would pay. Other device types, the TurboMind backend, and LMDeploy's
other VL models keep LMDeploy's code.
"""

from __future__ import annotations

import contextvars
import functools
import os

import torch

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend.model_support import check_architecture
from dlinfer.framework.lmdeploy_ext.patches import request_checks
from dlinfer.framework.lmdeploy_ext.patches.model_dtype import checkpoint_dtype, choose_dtype
from dlinfer.framework.lmdeploy_ext.patching import wrap

# The transformers processor of each VLM whose preprocessor is built here.
PROCESSOR_CLASSES: dict[str, str] = {
    "InternVLForConditionalGeneration": "InternVLProcessor",
    "Qwen2VLForConditionalGeneration": "Qwen2VLProcessor",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLProcessor",
}

# Set while `VLAsyncEngine.__init__` of a dlinfer device type's engine builds its vision model.
_IMAGE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("dlinfer_vl_image_only", default=False)

_image_only_classes: dict[type, type] = {}


def image_only_class(processor_class: type) -> type:
    """`processor_class` without its video processor (one subclass per class)."""
    if processor_class not in _image_only_classes:
        attributes = [name for name in processor_class.attributes if name != "video_processor"]
        _image_only_classes[processor_class] = type(
            f"{processor_class.__name__}ImageOnly", (processor_class,),
            {"attributes": attributes, "__module__": __name__,
             "__doc__": f"transformers' {processor_class.__name__} without its video processor (dlinfer)."})
    return _image_only_classes[processor_class]


def image_only_processor(arch: str, model_path: str, trust_remote_code: bool = False):
    """The transformers processor of a `PROCESSOR_CLASSES` architecture, loaded from `model_path`
    with its image processor and tokenizer only (no torchvision needed)."""
    import transformers

    processor_class = getattr(transformers, PROCESSOR_CLASSES[arch])
    return image_only_class(processor_class).from_pretrained(model_path, trust_remote_code=trust_remote_code)


def _patch_vl_engine_init(original):

    @functools.wraps(original)
    def __init__(self, model_path, backend="turbomind", backend_config=None, *args, **kwargs):
        spec = devices.spec_for(getattr(backend_config, "device_type", None)) if backend == "pytorch" else None
        if spec is None:
            return original(self, model_path, backend, backend_config, *args, **kwargs)
        if os.path.exists(model_path):  # a hub id: checked at engine build, after LMDeploy downloads it
            from lmdeploy.archs import get_model_arch

            arch, _ = get_model_arch(model_path, trust_remote_code=kwargs.get("trust_remote_code", False))
            check_architecture(arch, spec)
        _apply_vl_model_patches()
        token = _IMAGE_ONLY.set(True)
        try:
            original(self, model_path, backend, backend_config, *args, **kwargs)
        finally:
            _IMAGE_ONLY.reset(token)
        # its requests' messages and images are checked at the door (request_checks.py, image_checks.py)
        setattr(self.prompt_processor, request_checks.MARK, spec.device_type)

    return __init__


def _patch_resolve_dtype(original):

    @functools.wraps(original)
    def _resolve_mm_feature_dtype(hf_config, backend_config):
        spec = devices.spec_for(getattr(backend_config, "device_type", None))
        if spec is None:
            return original(hf_config, backend_config)
        chosen = choose_dtype(spec, getattr(backend_config, "dtype", "auto"), checkpoint_dtype(hf_config))
        return getattr(torch, chosen)

    return _resolve_mm_feature_dtype


def _patch_internvl_preprocessor(original):

    @functools.wraps(original)
    def build_preprocessor(self, trust_remote_code: bool = False):
        if not _IMAGE_ONLY.get():
            return original(self, trust_remote_code=trust_remote_code)
        # LMDeploy 0.18.0's `InternVL3VisionModel.build_preprocessor`, with the processor built image-only.
        self.processor = image_only_processor(self.arch, self.model_path, trust_remote_code)
        tokenizer = self.processor.tokenizer
        self.image_token = self.processor.image_token
        self.image_token_id = tokenizer.context_image_token_id
        self.image_tokens_per_patch = self.processor.image_seq_length
        self.tokenizer_init_kwargs = tokenizer.init_kwargs

    return build_preprocessor


class TileTransform:
    """One InternVL tile (a PIL image) -> float32 [3, size, size]: what LMDeploy's torchvision
    `Compose([RGB, Resize((size, size), BICUBIC), ToTensor(), Normalize(MEAN, STD)])` computes for
    a PIL image (torchvision resizes a PIL image with PIL's own resampling)."""

    MEAN = (0.485, 0.456, 0.406)
    STD = (0.229, 0.224, 0.225)

    def __init__(self, size: int):
        self.size = size
        self._mean = torch.tensor(self.MEAN).view(3, 1, 1)
        self._std = torch.tensor(self.STD).view(3, 1, 1)

    def __call__(self, image) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        image = image.convert("RGB") if image.mode != "RGB" else image
        image = image.resize((self.size, self.size), Image.BICUBIC)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)
        return (pixels - self._mean) / self._std


def _patch_internvl_chat_preprocessor(original):

    @functools.wraps(original)
    def build_preprocessor(self, trust_remote_code: bool = False):
        if not _IMAGE_ONLY.get() or not getattr(self.hf_config, "dynamic_image_size", False):
            return original(self, trust_remote_code=trust_remote_code)  # CLIP processor path: no torchvision
        # LMDeploy 0.18.0's `InternVLVisionModel.build_preprocessor`, dynamic-tile path, with its
        # torchvision transform replaced by `TileTransform`.
        from lmdeploy.vl.model.internvl import _normalize_vision_config

        self.config = self.hf_config
        self.vision_config = _normalize_vision_config(self.config.vision_config)
        self.transform = TileTransform(self.vision_config.image_size)
        self.processor = self._preprocess_v1_5
        patch_size = self.vision_config.patch_size
        self.image_tokens_per_patch = int((self.hf_config.force_image_size // patch_size) ** 2 *
                                          (self.hf_config.downsample_ratio ** 2))

    return build_preprocessor


def _patch_qwen2_vl_preprocessor(original):

    @functools.wraps(original)
    def build_preprocessor(self, trust_remote_code: bool = False):
        if not _IMAGE_ONLY.get():
            return original(self, trust_remote_code=trust_remote_code)
        # LMDeploy 0.18.0's `Qwen2VLModel.build_preprocessor`, with the processor built image-only.
        self.processor = image_only_processor(self.hf_config.architectures[0], self.model_path, trust_remote_code)
        tokenizer = self.processor.tokenizer
        self.image_token = self.processor.image_token
        self.image_token_id = tokenizer.encode(self.image_token)[-1]

    return build_preprocessor


def _apply_vl_model_patches() -> None:
    import lmdeploy.vl.engine as vl_engine
    from lmdeploy.vl.model.internvl import InternVLVisionModel
    from lmdeploy.vl.model.internvl3_hf import InternVL3VisionModel
    from lmdeploy.vl.model.qwen2 import Qwen2VLModel

    wrap(vl_engine, "_resolve_mm_feature_dtype", _patch_resolve_dtype)
    wrap(InternVL3VisionModel, "build_preprocessor", _patch_internvl_preprocessor)
    wrap(InternVLVisionModel, "build_preprocessor", _patch_internvl_chat_preprocessor)
    wrap(Qwen2VLModel, "build_preprocessor", _patch_qwen2_vl_preprocessor)


def apply() -> None:
    from lmdeploy.serve.core.vl_async_engine import VLAsyncEngine

    wrap(VLAsyncEngine, "__init__", _patch_vl_engine_init)
