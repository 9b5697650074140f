// W4A16 helpers beside the register kernel (quant_w4.cpp): the float32 weight a block of
// 128-column tiles at a time, for the GEMM path of many rows (weight_quant.py), and the
// canonical -> column_tiled repack, the cpu vendor's load-time hook. Layouts: quant_w4.h.
#include "entry_points.h"
#include "quant_w4.h"

namespace dlinfer_cpu {
using namespace w4;

// Tiles t0..t1 of the float32 weight in lane order, [K, (t1 - t0) * 128]: column (t - t0) * 128 +
// i * 16 + w holds W[k, w.lane_column(t, i, w)] = float(q - z) * s (zero past N): column order for
// column_tiled, the words' interleaved order for canonical, which the caller puts back in order
// after the GEMM (a GEMM does not care about their order; a scatter would cost more than the decode).
at::Tensor w4_dequantise_tiles(const at::Tensor& qweight_in, const at::Tensor& scale_in,
                               const std::optional<at::Tensor>& offset_in, int64_t group_size, int64_t t0, int64_t t1) {
  const DenseWeights d = dense_weights(qweight_in, scale_in, offset_in);
  const at::Tensor& qweight = d.qweight;
  const at::Tensor& scale = d.scale;
  const std::optional<at::Tensor>& offset = d.offset;
  const int64_t N = scale.size(1);
  const int64_t K = qweight.dim() == 3 ? qweight.size(1) : qweight.size(0);
  check_common(scale, offset, K, group_size);
  const int64_t tiles = num_tiles(N / 8);
  TORCH_CHECK(0 <= t0 && t0 <= t1 && t1 <= tiles, "w4_dequantise_tiles: tile range");
  const Packed w = packed_of(qweight, K, N);
  const int64_t width = (t1 - t0) * kTileCols;
  at::Tensor out = empty_tensor({K, width}, scale.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  AT_DISPATCH_V2(scale.scalar_type(), "w4_dequantise_tiles", AT_WRAP([&] {
    using T = scalar_t;
    const Problem<T> p{nullptr, w, scale.data_ptr<T>(), offset.has_value() ? offset->data_ptr<int32_t>() : nullptr,
                       nullptr, nullptr, 0, K, N, group_size};
    at::parallel_for(t0, t1, 1, [&](int64_t tb, int64_t te) {
      alignas(64) int32_t zs[kTileCols];
      alignas(64) float ss[kTileCols];
      for (int64_t t = tb; t < te; ++t) {
        const int nwords = p.w.tile_words(t), rwords = p.w.row_words(t);
#if defined(CPU_CAPABILITY_AVX2)
        const __m256i live[2] = {first_words8(rwords), first_words8(rwords - 8)};  // the tile's words
#endif
        for (int64_t gi = 0; gi < K / group_size; ++gi) {
          group_params(p, t, gi, nwords, zs, ss);
          for (int64_t k = gi * group_size; k < (gi + 1) * group_size; ++k) {
            const int32_t* words = w.row(t, k);
            float* row = o + k * width + (t - t0) * kTileCols;
#if defined(CPU_CAPABILITY_AVX512)
            const __m512i v = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << rwords) - 1u), words);
            for (int i = 0; i < 8; ++i) {
              const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(4 * i)), _mm512_set1_epi32(15));
              const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_loadu_si512(zs + i * kTileWords)));
              _mm512_storeu_ps(row + i * kTileWords, _mm512_mul_ps(d, _mm512_loadu_ps(ss + i * kTileWords)));
            }
#elif defined(CPU_CAPABILITY_AVX2)
            // the same arithmetic in two halves of 8 words (the lanes past rwords read as 0, as below)
            for (int h = 0; h < 2; ++h) {
              const __m256i v = _mm256_maskload_epi32(words + 8 * h, live[h]);
              _Pragma("GCC unroll 8")  // (a #pragma cannot sit inside the dispatch macro)
              for (int i = 0; i < 8; ++i) {
                const int c = i * kTileWords + 8 * h;
                const __m256i q =
                    _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(4 * i)), _mm256_set1_epi32(15));
                const __m256i z = _mm256_load_si256(reinterpret_cast<const __m256i*>(zs + c));
                const __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, z));
                _mm256_storeu_ps(row + c, _mm256_mul_ps(d, _mm256_load_ps(ss + c)));
              }
            }
#else
            for (int i = 0; i < 8; ++i)
              for (int wd = 0; wd < kTileWords; ++wd) {
                const int32_t q = wd < rwords ? (words[wd] >> (4 * i)) & 15 : 0;
                row[i * kTileWords + wd] = static_cast<float>(q - zs[i * kTileWords + wd]) * ss[i * kTileWords + wd];
              }
#endif
          }
        }
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// canonical int32 [K, N/8] -> column_tiled int32 [ceil(N/128), K, 16] (zero past N): bits 4i..4i+3
// of word w of tile t are column 128t + 16i + w, nibble kNibbleOf[w % 8] of canonical word 16t + 2i + w / 8.
at::Tensor w4_column_tiled(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt, "w4_column_tiled: int32 [K, N/8]");
  const at::Tensor q = qweight.contiguous();
  const int64_t K = q.size(0), words = q.size(1), tiles = num_tiles(words);
  at::Tensor out = zeros_tensor({tiles, K, kTileWords}, q.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t n = std::min(kTileWords, words - t * kTileWords);  // canonical words in the tile
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t* in = src + k * words + t * kTileWords;
        uint32_t* o = dst + (t * K + k) * kTileWords;
        for (int i = 0; i < 8; ++i) {
          for (int w = 0; w < static_cast<int>(kTileWords); ++w) {
            const int64_t j = 2 * i + w / 8;  // the column's canonical word in the tile
            if (j < n) o[w] |= ((in[j] >> (4 * kNibbleOf[w % 8])) & 15u) << (4 * i);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace dlinfer_cpu
