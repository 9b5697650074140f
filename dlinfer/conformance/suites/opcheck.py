"""torch.library.opcheck on every torch.ops.dlinfer op (schema, fake impl, autograd registration,
AOT dispatch), with the canonical arguments of the op table (dlinfer/vendor/op_table.py), under the
vendor. The op list is the table's: an op added there without samples here fails."""

from functools import partial

import torch

import dlinfer.ops  # noqa: F401  (registers torch.ops.dlinfer.*)
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import OPCHECK, Check, Skipped, suite
from dlinfer.conformance.inputs import alloc_cache, device, dtype_name, gen, make_block_table, randn
from dlinfer.vendor.base import FEATURE_ALIBI, FEATURE_KV_QUANT
from dlinfer.vendor.op_table import OPS

F32, I32, I64 = torch.float32, torch.int32, torch.int64


def samples(name, layout, g):
    """(args, kwargs) lists for one op."""
    r = lambda *shape, dtype=F32: randn(shape, dtype, g)  # noqa: E731
    dev = device()
    cu = torch.tensor([0, 3, 5], dtype=I32, device=dev)
    if name == "rms_norm":
        return [((r(5, 64), r(64), 1e-6), {}), ((r(3, 80, dtype=torch.float16), r(80, dtype=torch.float16), 1e-5), {})]
    if name == "add_rms_norm":
        return [((r(5, 64), r(5, 64), r(64), 1e-6), {})]
    if name == "apply_rotary_pos_emb":
        return [((r(5, 4, 64), r(5, 2, 64), r(5, 64), r(5, 64)), {}),
                ((r(3, 2, 128), r(3, 1, 128), r(3, 64), r(3, 64)), {})]
    if name == "silu_and_mul":
        return [((r(5, 128),), {})]
    if name == "linear":
        return [((r(5, 64), r(48, 64), r(48)), {}), ((r(5, 64), r(48, 64), None), {})]
    if name == "moe_gating_topk_softmax":
        return [((r(5, 8), 2), {})]
    if name == "dynamic_quant":
        return [((r(5, 64),), {}), ((r(3, 19, dtype=torch.bfloat16),), {})]
    if name == "linear_w8a8":
        i8 = lambda *shape: torch.randint(-128, 128, shape, generator=g, dtype=I64).to(torch.int8).to(dev)  # noqa: E731
        scales = lambda n: (torch.rand(n, generator=g) / 64).to(dev)  # noqa: E731
        return [((i8(5, 64), i8(48, 64), scales(5), scales(48), torch.float16, r(48, dtype=torch.float16)), {}),
                ((i8(3, 19), i8(7, 19), scales(3), scales(7), torch.float32, None), {})]
    if name == "linear_w8a8_static":
        i8 = lambda *shape: torch.randint(-128, 128, shape, generator=g, dtype=I64).to(torch.int8).to(dev)  # noqa: E731
        one = lambda v: torch.tensor([v], device=dev)  # noqa: E731
        deq = (torch.rand(48, generator=g) / 1000).to(dev)
        bias = torch.randint(-100, 100, (48,), generator=g).to(torch.int32).to(dev)
        return [((r(5, 64), i8(48, 64), one(0.05), one(2.0), deq, torch.float32, bias), {}),
                ((r(3, 64, dtype=torch.bfloat16), i8(48, 64), one(0.05), one(0.0), deq, torch.bfloat16, None), {})]
    if name == "apply_rotary_pos_emb_interleaved":
        return [((r(5, 6, 64), r(5, 64), r(5, 64), native), {}) for native in (True, False)]
    if name == "rms_norm_w8a8":
        return [((r(5, 64), r(64), 1e-6), {}), ((r(3, 80, dtype=torch.float16), r(80, dtype=torch.float16), 1e-5), {})]
    if name == "add_rms_norm_w8a8":
        return [((r(5, 64), r(5, 64), r(64), 1e-6), {})]
    if name == "weight_quant_matmul":
        from dlinfer.conformance.suites.weight_quant import W4Case, column_tile, weights

        out = []
        cases = ((F32, 32, True, True, False), (torch.bfloat16, 64, False, False, True))
        for dtype, group, zeros, bias, tiled in cases:
            qw, s, z, b = weights(W4Case("opcheck", (5,), 64, 136, group, zeros, bias), dtype, g)
            if tiled:
                qw = column_tile(qw)
            out.append(((r(5, 64, dtype=dtype), qw, s, z, b, group), {}))
        return out
    if name == "fused_moe":
        ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], dtype=I64, device=dev)
        w = torch.rand(5, 2, generator=g).to(dev)
        return [((r(5, 32), r(4, 96, 32), r(4, 32, 48), w, ids, renorm), {}) for renorm in (True, False)]
    if name == "fused_moe_w8a8":
        ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], dtype=I64, device=dev)
        w = torch.rand(5, 2, generator=g).to(dev)
        i8 = lambda *shape: torch.randint(-128, 128, shape, generator=g, dtype=I64).to(torch.int8).to(dev)  # noqa: E731
        scales = lambda *shape: (torch.rand(*shape, generator=g) / 512).to(dev)  # noqa: E731
        return [((r(5, 32, dtype=dt), i8(4, 96, 32), scales(4, 96), i8(4, 32, 48), scales(4, 32), w, ids, renorm), {})
                for dt, renorm in ((F32, True), (torch.bfloat16, False))]
    paged = make_block_table([9, 2], 8, g, I32)
    kc = alloc_cache(paged.num_blocks, 8, 2, 64, layout, F32, g)
    vc = alloc_cache(paged.num_blocks, 8, 2, 64, layout, F32, g)
    kv = torch.tensor([9, 2], dtype=I32, device=dev)
    slopes = ref.alibi_slopes(4).to(dev)
    # The int8 cache (quant_bits=8): int8 caches and per-head float32 scales / zeros.
    i8 = lambda c: torch.randint(-128, 128, c.shape, generator=g, dtype=I64).to(torch.int8).to(dev)  # noqa: E731
    kq, vq = i8(kc), i8(vc)
    quant = tuple(torch.tensor(v, device=dev) for v in ([0.02, 0.03], [0.0, 1.5], [0.04, 0.05], [-2.0, 0.0]))
    if name == "fill_kv_cache":
        slots = torch.tensor([3, 4, 17, 30, 9], dtype=I64, device=dev)
        return [((r(5, 2, 64), r(5, 2, 64), kc, vc, slots, layout), {}),
                ((r(5, 2, 64), r(5, 2, 64), kq, vq, slots, layout, *quant), {})]
    if name == "prefill_attention":
        return [((r(5, 4, 64), r(5, 2, 64), r(5, 2, 64), cu, 3, 0.125, a, torch.empty(5, 4, 64, device=dev)), {})
                for a in (None, slopes)]
    if name == "paged_prefill_attention":
        return [((r(5, 4, 64), kc, vc, paged.block_table, cu, kv, 3, 9, 0.125, a, torch.empty(5, 4, 64, device=dev),
                  layout), {}) for a in (None, slopes)] + [
                ((r(5, 4, 64), kq, vq, paged.block_table, cu, kv, 3, 9, 0.125, None, torch.empty(5, 4, 64, device=dev),
                  layout, *quant), {})]
    if name == "paged_decode_attention":
        cu1 = torch.tensor([0, 1, 2], dtype=I32, device=dev)
        return [((r(2, 4, 64), kc, vc, paged.block_table, cu1, kv, 9, 0.125, a, torch.empty(2, 4, 64, device=dev),
                  layout), {}) for a in (None, slopes)] + [
                ((r(2, 4, 64), kq, vq, paged.block_table, cu1, kv, 9, 0.125, None, torch.empty(2, 4, 64, device=dev),
                  layout, *quant), {})]
    raise KeyError(name)


def _opcheck(vendor, layout, name):
    op = getattr(torch.ops.dlinfer, name).default
    arg_names = [a.name for a in op._schema.arguments]
    alibi_at = arg_names.index("alibi_slopes") if "alibi_slopes" in arg_names else None
    has_alibi = vendor.supports(FEATURE_ALIBI)
    ran, left_out = 0, set()
    for args, kwargs in samples(name, layout or "token_major", gen(5)):
        if alibi_at is not None and args[alibi_at] is not None and not has_alibi:
            left_out.add(FEATURE_ALIBI)  # an ALiBi sample, for a vendor that declares no ALiBi
            continue
        if "k_scale" in arg_names and len(args) > arg_names.index("k_scale") and not vendor.supports(FEATURE_KV_QUANT):
            left_out.add(FEATURE_KV_QUANT)  # an int8-cache sample, for a vendor without one
            continue
        dtype = args[0].dtype
        if dtype.is_floating_point and dtype not in vendor.capabilities.dtypes:
            left_out.add(dtype_name(dtype))
            continue
        torch.library.opcheck(op, args, kwargs)
        ran += 1
    if not ran:
        raise Skipped(f"{vendor.name} declares none of the samples' needs ({', '.join(sorted(left_out))})")
    return f"samples left out: {', '.join(sorted(left_out))}" if left_out else None


@suite("opcheck")
def opcheck(layouts):
    return [Check("opcheck", f"{layout}-{name}" if layout else name, name, OPCHECK,
                  partial(_opcheck, layout=layout, name=name), case="opcheck", layout=layout,
                  head_dim=64 if "attention" in name else None)
            for name, spec in OPS.items() for layout in (layouts if spec.takes_kv_cache else (None,))]
