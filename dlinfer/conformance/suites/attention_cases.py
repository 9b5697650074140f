"""The attention parity cases: per case its sequences ((history, new tokens) each), heads, head
dims, block size, and the input variations it exercises. Shared by `attention.py`'s checks."""

from dataclasses import dataclass

import torch

from dlinfer.vendor.base import FEATURE_ALIBI, FEATURE_SLIDING_WINDOW, FEATURE_SOFTCAP

I64 = torch.int64


@dataclass(frozen=True)
class AttnCase:
    id: str
    seqs: tuple  # ((history, new), ...) per sequence
    hq: int
    hkv: int
    d: int
    dv: int
    bs: int
    small: bool
    index_dtype: torch.dtype = torch.int32
    lens_on_cpu: bool = True
    packed: bool = True  # q/k/v as strided views of one qkv buffer
    scale: float = None  # softmax_scale
    alibi: bool = False
    latent: bool = False  # MLA: value_cache = key_cache[..., :Dv], the values the keys' first Dv dims
    window: int = 0  # sliding_window (0: none)
    softcap: float = 0.0  # logit_softcapping (0: none)

    @property
    def features(self):
        """The optional vendor features the case needs (None: none)."""
        needed = tuple(f for f, on in ((FEATURE_ALIBI, self.alibi), (FEATURE_SLIDING_WINDOW, self.window),
                                      (FEATURE_SOFTCAP, self.softcap)) if on)
        return needed or None

    @property
    def score_options(self) -> dict:
        """The op keywords of the case's window and soft cap."""
        return {"sliding_window": self.window or None, "logit_softcapping": self.softcap or None}

    @property
    def kv_lens(self):
        return [h + n for h, n in self.seqs]

    @property
    def q_lens(self):
        return [n for _, n in self.seqs]

    @property
    def cu_ends(self):
        out, acc = [], 0
        for n in self.q_lens:
            acc += n
            out.append(acc)
        return out

    @property
    def T(self):
        return sum(self.q_lens)


# ---------------------------------------------------------------- cases

# prefill_attention: no history (seqs are (0, n)).
PREFILL_CASES = [
    AttnCase("b1_n1_gqa1_d64", ((0, 1),), 2, 2, 64, 64, 16, True, packed=False),
    AttnCase("b3_gqa4_d80", ((0, 5), (0, 1), (0, 9)), 8, 2, 80, 80, 16, True, index_dtype=I64,
             lens_on_cpu=False),
    AttnCase("b2_gqa5_d128_dv64", ((0, 7), (0, 3)), 5, 1, 128, 64, 16, True),
    AttnCase("b2_alibi_scale_d64", ((0, 6), (0, 4)), 4, 2, 64, 64, 16, True, scale=0.3, alibi=True),
    AttnCase("b3_gqa5_d128", ((0, 513), (0, 1), (0, 300)), 10, 2, 128, 128, 16, False),
    AttnCase("b2_gqa1_d64", ((0, 700), (0, 77)), 4, 4, 64, 64, 16, False, index_dtype=I64, packed=False),
    AttnCase("b4_gqa4_d80_alibi", ((0, 129), (0, 64), (0, 250), (0, 17)), 8, 2, 80, 80, 16, False,
             lens_on_cpu=False, alibi=True),
    # Windows shorter and longer than sequences, soft caps small enough to bend the scores.
    AttnCase("b2_window5_gqa4_d64", ((0, 17), (0, 3)), 8, 2, 64, 64, 16, True, window=5),
    AttnCase("b2_window8_softcap2_d128", ((0, 40), (0, 9)), 4, 2, 128, 128, 16, True, window=8, softcap=2.0),
    AttnCase("b1_softcap1_gqa1_d64", ((0, 11),), 2, 2, 64, 64, 16, True, scale=0.5, softcap=1.0, packed=False),
    AttnCase("b2_window100_softcap3_gqa5_d128", ((0, 513), (0, 77)), 10, 2, 128, 128, 16, False, window=100,
             softcap=3.0),
    AttnCase("b2_mla_gqa8_d48_dv32", ((0, 7), (0, 12)), 8, 1, 48, 32, 16, True, latent=True),
    AttnCase("b1_mla_gqa16_d576_dv512", ((0, 150),), 16, 1, 576, 512, 16, False, latent=True),
]

# paged_prefill_attention: history + new, history not dividing the block size.
PAGED_PREFILL_CASES = [
    AttnCase("b1_h0_n5_gqa1_d64_bs16", ((0, 5),), 2, 2, 64, 64, 16, True, packed=False),
    AttnCase("b3_gqa4_d80_bs8", ((3, 4), (0, 1), (13, 6)), 8, 2, 80, 80, 8, True, index_dtype=I64,
             lens_on_cpu=False),
    AttnCase("b2_gqa5_d128_dv64_bs16", ((17, 3), (31, 2)), 5, 1, 128, 64, 16, True),
    AttnCase("b2_alibi_scale_d64_bs4", ((5, 3), (0, 4)), 4, 2, 64, 64, 4, True, scale=0.3, alibi=True),
    AttnCase("b4_gqa5_d128_bs64", ((1000, 37), (0, 129), (64, 1), (333, 65)), 10, 2, 128, 128, 64, False),
    AttnCase("b3_gqa1_d64_bs128", ((511, 1), (129, 300), (0, 7)), 4, 4, 64, 64, 128, False,
             index_dtype=I64, packed=False),
    AttnCase("b5_gqa4_d80_bs16_alibi", ((7, 9), (100, 3), (15, 17), (1, 1), (250, 40)), 8, 2, 80, 80, 16,
             False, lens_on_cpu=False, alibi=True),
    AttnCase("b2_window5_gqa4_d64_bs4", ((13, 6), (0, 4)), 8, 2, 64, 64, 4, True, window=5),
    AttnCase("b1_window16_softcap2_d128_bs8", ((40, 9),), 4, 2, 128, 128, 8, True, window=16, softcap=2.0,
             index_dtype=I64, lens_on_cpu=False),
    AttnCase("b2_softcap1_gqa1_d64_bs16", ((17, 3), (0, 5)), 2, 2, 64, 64, 16, True, softcap=1.0, packed=False),
    AttnCase("b3_window64_softcap3_gqa5_d128_bs16", ((1000, 37), (64, 129), (5, 3)), 10, 2, 128, 128, 16, False,
             window=64, softcap=3.0),
    # MLA (DeepSeek through LMDeploy): one latent KV head, values a view of the key cache.
    AttnCase("b2_mla_gqa8_d48_dv32_bs4", ((5, 3), (0, 6)), 8, 1, 48, 32, 4, True, latent=True),
    AttnCase("b2_mla_gqa16_d576_dv512_bs64", ((200, 40), (63, 65)), 16, 1, 576, 512, 64, False, latent=True),
]

# paged_decode_attention: one new token per sequence, and multi-token decode.
DECODE_CASES = [
    AttnCase("b1_kv1_gqa1_d64_bs16", ((0, 1),), 2, 2, 64, 64, 16, True, packed=False),
    AttnCase("b3_gqa4_d80_bs8", ((16, 1), (4, 1), (22, 1)), 8, 2, 80, 80, 8, True, index_dtype=I64,
             lens_on_cpu=False),
    AttnCase("b2_gqa5_d128_dv96_bs16", ((31, 1), (16, 1)), 5, 1, 128, 96, 16, True),
    AttnCase("b2_multitoken_gqa4_d64_bs4", ((5, 3), (9, 2)), 8, 2, 64, 64, 4, True),
    AttnCase("b3_alibi_scale_d64_bs8", ((12, 1), (0, 1), (7, 1)), 4, 2, 64, 64, 8, True, scale=0.3,
             alibi=True),
    AttnCase("b8_gqa5_d128_bs64", ((999, 1), (0, 1), (63, 1), (64, 1), (332, 1), (126, 1), (2046, 1), (8, 1)),
             40, 8, 128, 128, 64, False),
    AttnCase("b4_gqa1_d64_bs16", ((700, 1), (15, 1), (16, 1), (1, 1)), 16, 16, 64, 64, 16, False,
             index_dtype=I64, packed=False),
    AttnCase("b6_gqa4_d80_bs128_alibi", ((200, 1), (127, 1), (128, 1), (0, 1), (1000, 1), (77, 1)), 16, 4, 80,
             80, 128, False, lens_on_cpu=False, alibi=True),
    AttnCase("b3_multitoken_gqa5_d128_bs16", ((40, 4), (0, 3), (17, 5)), 10, 2, 128, 128, 16, False),
    # One token, one kv head, a long history: too little work per (token, head) for the threads,
    # so split-KV kernels cut the keys into several splits and merge them.
    AttnCase("b1_long_gqa8_d128_bs16_split", ((1900, 1),), 8, 1, 128, 128, 16, False),
    AttnCase("b2_long_gqa4_d64_bs32_split", ((1300, 1), (517, 1)), 4, 1, 64, 64, 32, False, index_dtype=I64,
             alibi=True),
    AttnCase("b3_window7_gqa4_d80_bs8", ((16, 1), (4, 1), (22, 1)), 8, 2, 80, 80, 8, True, window=7),
    AttnCase("b2_multitoken_window4_softcap2_d64_bs4", ((9, 2), (5, 3)), 8, 2, 64, 64, 4, True, window=4,
             softcap=2.0, index_dtype=I64, lens_on_cpu=False),
    AttnCase("b2_softcap1_gqa1_d64_bs16", ((30, 1), (0, 1)), 2, 2, 64, 64, 16, True, softcap=1.0, packed=False),
    # A window far shorter than the history: the decode kernels may skip whole blocks (and splits).
    AttnCase("b1_long_window128_gqa8_d128_bs16_split", ((1900, 1),), 8, 1, 128, 128, 16, False, window=128),
    AttnCase("b3_window256_softcap3_gqa5_d128_bs64", ((700, 1), (15, 1), (2046, 1)), 10, 2, 128, 128, 64, False,
             window=256, softcap=3.0),
    AttnCase("b3_mla_gqa8_d48_dv32_bs4", ((9, 1), (0, 1), (22, 1)), 8, 1, 48, 32, 4, True, latent=True,
             index_dtype=I64),
    AttnCase("b2_mla_gqa16_d576_dv512_bs64", ((1000, 1), (63, 1)), 16, 1, 576, 512, 64, False, latent=True),
]
