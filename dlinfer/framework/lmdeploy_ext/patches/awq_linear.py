"""AWQ checkpoints in the engine's dtype on dlinfer's device types (written against LMDeploy 0.18.0).

Why: LMDeploy runs every AWQ model in float16. `_update_torch_dtype` returns float16 for
`quant_method == "awq"` whatever dtype was asked (pytorch/config.py), and `AwqLinear`
creates its `scales` and `bias` in float16 whatever the model's dtype (`AwqLinear.__init__` in
nn/linear/awq.py, `create_weights(..., self.dtype, ...)`). The CPU device type does not run
float16.

How, for dlinfer device types only (a device type LMDeploy knows keeps its float16):
- patches/model_dtype.py runs the AWQ model in the dtype it chose (float32 on CPU for dtype="auto")
  and records that dtype in the in-memory quantization config under `DTYPE_KEY`, which LMDeploy
  hands to every module it builds (`BuildModelContext.quant_config`, model_inputs.py);
- here `AwqLinear.create_weights` (also used by its merged / QKV subclasses) creates `scales` and
  `bias` in that dtype; the checkpoint's float16 scales are copied into them exactly.

And once per layer after loading (`AwqLinear.update_weights`, which LMDeploy calls from
`process_weights_after_loading`, weight_loader/model_weight_loader.py), when the layer runs
on LMDeploy's dlinfer AWQ implementation (`AwqLinearW4A16Impl`), the loaded `qweight` / `scales` /
`qzeros` go through `dlinfer.ops.repack_weight_quant`: the active vendor's optional load-time
repack (the cpu vendor's k_interleaved or column_tiled layout; docs/design.md). A vendor without the hook keeps
LMDeploy's AWQ gemm layout as loaded. Never per call.
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext.patching import wrap

DTYPE_KEY = "dlinfer_dtype"


def _patch_create_weights(original):

    @functools.wraps(original)
    def create_weights(self, in_features, out_features, w_bit, group_size, bias, dtype, device):
        import torch
        from lmdeploy.pytorch.models.patch import get_build_model_context

        quant_config = get_build_model_context().quant_config
        chosen = quant_config.get(DTYPE_KEY) if quant_config is not None else None
        if chosen is not None:
            dtype = getattr(torch, chosen)
        return original(self, in_features, out_features, w_bit, group_size, bias, dtype, device)

    return create_weights


def _patch_update_weights(original):

    @functools.wraps(original)
    def update_weights(self):
        from lmdeploy.pytorch.backends.dlinfer.awq_modules import AwqLinearW4A16Impl

        import dlinfer.ops

        original(self)
        if not isinstance(self.impl, AwqLinearW4A16Impl):
            return  # another backend's AWQ implementation (a device type LMDeploy knows)
        qweight, scales, qzeros = dlinfer.ops.repack_weight_quant(self.qweight.data, self.scales.data,
                                                                  self.qzeros.data, self.impl.group_size)
        if qweight is not self.qweight.data:
            self.register_all_parameters(qweight, scales, qzeros, self.bias)

    return update_weights


def apply() -> None:
    from lmdeploy.pytorch.nn.linear.awq import AwqLinear

    wrap(AwqLinear, "create_weights", _patch_create_weights)
    wrap(AwqLinear, "update_weights", _patch_update_weights)
