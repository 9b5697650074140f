// The float32 weight of a k_interleaved W4 weight (quant_w4_ki.h), a block of 64-column tiles at a
// time: the BLAS path of weight_quant.py for calls of many rows under path 5 (16-bit activations),
// whose per-row product costs more than a GEMM there (docs/design.md, "W4 with 16-bit
// activations"). The values are column_tiled's dequantise's (quant_w4_tiles.cpp): float(q - z) * s,
// the scale widened exactly from the block's float16 or float32.
#include "entry_points.h"
#include "quant_w4_ki.h"

namespace dlinfer_cpu {

// qweight k_interleaved uint8 [ceil(N/64), K/g, B], tiles t0..t1 -> float32 [K, (t1 - t0) * 64]:
// column (t - t0) * 64 + c holds W[k, 64 t + c] (zero past N: the blocks hold zero scales there).
at::Tensor w4_ki_dequantise_tiles(const at::Tensor& qweight, int64_t N, int64_t group_size, int64_t t0, int64_t t1) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.device().is_cpu(),
              "w4_ki_dequantise_tiles: qweight k_interleaved uint8 [ceil(N/64), K/g, B], contiguous, on the CPU");
  TORCH_CHECK(group_size > 0 && group_size % w4v::kBlockK == 0 && group_size <= w4v::kMaxGroup,
              "w4_ki_dequantise_tiles: group size a multiple of 8, at most 1024, got ", group_size);
  const int64_t g = group_size, G = qweight.size(1), B = qweight.size(2), K = G * g, tiles = w4v::num_tiles(N);
  const int64_t sb = w4v::scale_bytes_of(B, g);
  TORCH_CHECK(sb != 0 && qweight.size(0) == tiles, "w4_ki_dequantise_tiles: qweight [ceil(N/64), K/g, B] = [", tiles,
              ", K/g, ", w4v::block_bytes_of(g, 2), " or ", w4v::block_bytes_of(g, 4), "] at N = ", N, ", g = ", g,
              ", got ", qweight.sizes());
  TORCH_CHECK(0 <= t0 && t0 <= t1 && t1 <= tiles, "w4_ki_dequantise_tiles: tile range [", t0, ", ", t1, ") of ",
              tiles, " tiles");
  const w4v::Layout w{qweight.data_ptr<uint8_t>(), K, N, g, G, sb, w4v::param_bytes_of(sb), B};
  const int64_t width = (t1 - t0) * w4v::kCols;
  at::Tensor out = empty_tensor({K, width}, qweight.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(t0, t1, 1, [&](int64_t tb, int64_t te) {
    float zs[w4v::kCols], ss[w4v::kCols];
    for (int64_t t = tb; t < te; ++t)
      for (int64_t gi = 0; gi < G; ++gi) {
        const uint8_t* z = w.zeros(t, gi);
        for (int64_t c = 0; c < w4v::kCols; ++c) {
          zs[c] = static_cast<float>(z[c]);
          ss[c] = sb == 2 ? static_cast<float>(w.scales<at::Half>(t, gi)[c]) : w.scales<float>(t, gi)[c];
        }
        for (int64_t kb = gi * g / w4v::kBlockK; kb < (gi + 1) * g / w4v::kBlockK; ++kb)
          for (int v = 0; v < w4v::kVecs; ++v) {
            const uint8_t* line = w.line(t, kb, v);
            float* rows = o + kb * w4v::kBlockK * width + (t - t0) * w4v::kCols + 16 * v;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
            // lane l of a half's 32-bit words holds its column's rows k..k+3 (a byte each, low nibble)
            // and k+4..k+7 (high nibbles): row r is bits 8 (r % 4) + 4 (r / 4) .. + 3 of the word
            for (int h = 0; h < 2; ++h) {
              const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
              const __m256 z = _mm256_loadu_ps(zs + 16 * v + 8 * h), s = _mm256_loadu_ps(ss + 16 * v + 8 * h);
              for (int r = 0; r < w4v::kBlockK; ++r) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, 8 * (r % 4) + 4 * (r / 4)),
                                                   _mm256_set1_epi32(15));
                _mm256_storeu_ps(rows + r * width + 8 * h, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), z), s));
              }
            }
#else
            for (int r = 0; r < w4v::kBlockK; ++r) {
              const int shift = r < 4 ? 0 : 4;
              for (int l = 0; l < 16; ++l) {
                const float q = static_cast<float>((line[4 * l + r % 4] >> shift) & 15);
                rows[r * width + l] = (q - zs[16 * v + l]) * ss[16 * v + l];  // q - z exact, as float(q - z)
              }
            }
#endif
          }
      }
  });
  return out;
}

}  // namespace dlinfer_cpu
