"""Helpers shared by the triton vendor's kernels: launch rules and a correctly rounded cast.

Under TRITON_INTERPRET=1 (the CPU interpreter, used by CI) bfloat16 values are numpy uint16, the
interpreter's fp32 -> bf16 conversion truncates instead of rounding to nearest even (and turns
NaN into inf), and bf16 arithmetic is meaningless. The kernels therefore upcast to fp32 right
after every load and downcast only through `cast_to`, which rounds bf16 by hand in the
interpreter (bit-exact with torch for normal numbers and NaN; fp32 subnormals still go through
the interpreter's own conversion) and is a plain `.to` on a GPU. Pure copies (fill_kv_cache,
rotary pass-through dims) move the raw bits and need neither.
"""

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

# Whether this process runs Triton's CPU interpreter. Triton itself decides it once, when
# `@triton.jit` decorates a kernel (at this vendor's import): reading it anywhere else, or later,
# could disagree with the kernels actually defined. Every file of the vendor uses this value.
INTERPRET = bool(knobs.runtime.interpret)
_FIX_BF16 = tl.constexpr(INTERPRET)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """fp32 tensor -> dtype, round to nearest even."""
    if _FIX_BF16 and dtype == tl.bfloat16:
        # Round the fp32 bits to the upper 16 (nearest even), then the truncating cast is exact.
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        bits = tl.where(x != x, 0x7FC00000, bits)  # NaN -> a quiet NaN that survives truncation
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The device's multiprocessors (the launchers' split rules size their grids by it); a CPU
    (the interpreter) counts as one."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


@functools.lru_cache(maxsize=None)
def hopper(device: torch.device) -> bool:
    """An NVIDIA data-centre GPU of sm_90 (Hopper) or sm_100 (Blackwell), with ~227 KB of shared
    memory a block: some launchers take larger tiles there (their shared memory and spills are
    checked for sm_90 and sm_80 by scripts/triton_targets.py). Not sm_120 / sm_121 (consumer
    Blackwell, ~99 KB a block like sm_86), not ROCm (whose GPUs also report major 9), never a CPU."""
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def row_warps(block: int) -> int:
    """num_warps for one program reducing/streaming a row of `block` elements."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (rows may be strided), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
