"""Which rotary-embedding layer dlinfer's device types build, where LMDeploy's dlinfer choice is wrong.

Why: LMDeploy 0.18.0's dlinfer `_build_rotary_embedding` (backends/dlinfer/rotary_embedding.py)
builds the Llama 3.x frequencies (`rope_type="llama3"`) from `spec.max_position_embeddings`, the
model's extended context, where the formula (HF transformers, LMDeploy's default backend) takes
the original context `rope_scaling["original_max_position_embeddings"]`. Every Llama 3.1/3.2/3.3
checkpoint would run with shifted frequencies and generate different tokens than HF from the
first positions on, silently.

How: no patch of LMDeploy. Models build their rotary layer through the ops backend's `build_op`;
dlinfer's backend (`op_backend.DlinferDeviceOpsBackend.build_op`) asks `build_rotary_embedding`
first, which builds LMDeploy's own `DlinferLlama3RotaryEmbeddingImpl` with
`llama3_params.original_max_position_embeddings` (as LMDeploy's default backend does) and returns
None for every other rope type, which then takes LMDeploy's dlinfer path unchanged. Only dlinfer's
device types use this backend; ascend/maca/camb keep LMDeploy's behaviour.

Which rope types run at all is decided before the model is built (`model_support.check_model`).
Written against LMDeploy 0.18.0.
"""

from __future__ import annotations

from lmdeploy.pytorch.backends.dlinfer.rotary_embedding import DlinferLlama3RotaryEmbeddingImpl
from lmdeploy.pytorch.backends.rotary_embedding import RopeType, RotaryEmbeddingBuildSpec, RotaryEmbeddingImpl


def build_rotary_embedding(spec: RotaryEmbeddingBuildSpec) -> RotaryEmbeddingImpl | None:
    """dlinfer's rotary layer for `spec`, or None to build LMDeploy's dlinfer one."""
    if spec.emb_type == RopeType.Llama3:
        params = spec.llama3_params
        return DlinferLlama3RotaryEmbeddingImpl(spec.dim, spec.base, spec.scaling_factor, params.low_freq_factor,
                                                params.high_freq_factor, params.original_max_position_embeddings)
    return None
