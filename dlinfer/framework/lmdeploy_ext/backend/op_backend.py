"""LMDeploy ops backends of dlinfer's device types.

Each subclasses LMDeploy's own `DlinferOpsBackend` (backends/dlinfer/op_backend.py), so
`build_op` hands out LMDeploy's dlinfer attention, norm, rotary, activation, linear and MoE
layers, which call `dlinfer.ops` through `lmdeploy/pytorch/kernels/dlinfer`. What this adds:
- `update_step_context`: the attention and MoE metadata those layers read (`step_context.py`);
- KV block shapes in the active vendor's layout (`kv_layout.py`);
- the rotary layer where LMDeploy's dlinfer choice is wrong (Llama 3.x scaling: `rotary.py`);
- non-causal attention without a cache (vision towers), which LMDeploy's dlinfer layer runs
  causally (`bidirectional_attention.py`);
- attention with a sliding window or logit soft-capping, which LMDeploy's dlinfer layer drops
  (`scored_attention.py`);
- the collective backend of tp > 1 from the device type (`DeviceSpec.ccl_backend`: "gloo" on the
  CPU, "nccl" for dlinfer_cuda);
- for the CPU: cache allocation on the host (`cache.py`), and
  with `eager_mode=False` decode steps compiled by `graph_mode/runner.py` (`eager_mode=True`: LMDeploy's
  base `GraphRunner`, every step eager).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from lmdeploy.pytorch.backends.attention import PagedAttentionBuildSpec
from lmdeploy.pytorch.backends.dlinfer.op_backend import DlinferOpsBackend
from lmdeploy.pytorch.backends.flash_attention import FlashAttentionBuildSpec
from lmdeploy.pytorch.backends.rotary_embedding import RotaryEmbeddingBuildSpec

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend.bidirectional_attention import build_bidirectional_attention
from dlinfer.framework.lmdeploy_ext.backend.cache import HostCacheBackend
from dlinfer.framework.lmdeploy_ext.backend.kv_layout import active_kv_layout, block_shape
from dlinfer.framework.lmdeploy_ext.backend.rotary import build_rotary_embedding
from dlinfer.framework.lmdeploy_ext.backend.scored_attention import build_scored_attention
from dlinfer.framework.lmdeploy_ext.backend.step_context import build_attention_metadata, build_moe_metadata


class DlinferDeviceOpsBackend(DlinferOpsBackend):
    """LMDeploy's dlinfer backend bound to one dlinfer device type (`device_spec`)."""

    device_spec: ClassVar[devices.DeviceSpec]

    @classmethod
    def build_op(cls, spec, *, enable_deterministic: bool = False):
        """LMDeploy's dlinfer layer for `spec`, except the rotary layers `rotary.py` builds itself,
        the non-causal attention `bidirectional_attention.py` builds and the windowed or
        soft-capped attention `scored_attention.py` builds."""
        if isinstance(spec, RotaryEmbeddingBuildSpec):
            impl = build_rotary_embedding(spec)
            if impl is not None:
                return impl
        if isinstance(spec, FlashAttentionBuildSpec):
            impl = build_bidirectional_attention(spec)
            if impl is not None:
                return impl
        if isinstance(spec, PagedAttentionBuildSpec):
            impl = build_scored_attention(spec)
            if impl is not None:
                return impl
        return super().build_op(spec, enable_deterministic=enable_deterministic)

    @classmethod
    def get_k_block_shape(cls, block_size: int, num_heads: int, head_size: int, dtype: torch.dtype):
        return block_shape(active_kv_layout(cls.device_spec.torch_device), block_size, num_heads, head_size)

    @classmethod
    def get_v_block_shape(cls, block_size: int, num_heads: int, head_size: int, dtype: torch.dtype):
        return block_shape(active_kv_layout(cls.device_spec.torch_device), block_size, num_heads, head_size)

    @classmethod
    def ccl_backend(cls) -> str:
        """The torch.distributed backend of the tensor-parallel ranks (the device type's)."""
        return cls.device_spec.ccl_backend

    @classmethod
    def update_step_context(cls, step_context):
        """Attach `attn_metadata` for the dlinfer attention layers and `moe_metadata` for the MoE ones."""
        block_size = step_context.cache_config.kernel_block_size
        step_context.attn_metadata = build_attention_metadata(step_context, block_size)
        step_context.moe_metadata = build_moe_metadata()
        return step_context


class CpuOpsBackend(DlinferDeviceOpsBackend):
    """device_type="cpu": dlinfer ops on host tensors, KV cache in host RAM."""

    device_spec = devices.CPU

    @staticmethod
    def get_name() -> str:
        return "dlinfer_cpu"

    @classmethod
    def get_cache_backend(cls):
        return HostCacheBackend

    @staticmethod
    def support_ray() -> bool:
        """LMDeploy's Ray executor runs this device type (patches/ray_executor.py). Only when asked
        for: with tp > 1 and no executor given, `engine_config` chooses 'mp' (LMDeploy would take
        Ray for any backend that supports it)."""
        return True

    @classmethod
    def build_graph_runner(cls, model, model_config, cache_config, backend_config, device):
        """eager_mode=False: decode steps compiled with the dlinfer backend (graph_mode/runner.py)."""
        if backend_config.eager_mode:
            return super().build_graph_runner(model, model_config, cache_config, backend_config, device)
        from dlinfer.framework.lmdeploy_ext.graph_mode.runner import DlinferGraphRunner

        return DlinferGraphRunner(model, model_config, cache_config, backend_config, device)


class CudaOpsBackend(DlinferDeviceOpsBackend):
    """device_type="dlinfer_cuda": dlinfer ops (e.g. DLINFER_VENDOR=triton) on a CUDA GPU.

    Not run on a GPU yet: the code path exists and is exercised on CPU up to device placement.
    """

    device_spec = devices.DLINFER_CUDA

    @staticmethod
    def get_name() -> str:
        return "dlinfer_cuda"

    @staticmethod
    def device_count():
        return torch.cuda.device_count()


_BACKENDS: dict[str, type[DlinferDeviceOpsBackend]] = {
    backend.device_spec.device_type: backend for backend in (CpuOpsBackend, CudaOpsBackend)
}


def backend_for(spec: devices.DeviceSpec) -> type[DlinferDeviceOpsBackend]:
    """The ops backend class of a dlinfer device type."""
    return _BACKENDS[spec.device_type]
