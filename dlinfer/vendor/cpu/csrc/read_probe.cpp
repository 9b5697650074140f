// The read-bandwidth probe: how fast this machine's cores can read memory, the reference every
// weight-streaming kernel is measured against (dlinfer/vendor/cpu/read_probe.py explores its
// parameters and reports the best; docs/design.md, "The read-bandwidth probe").
//
// read_probe(buffer, threads, streams, prefetch_bytes, hint) reads every byte of `buffer` once and
// returns a checksum (so the loads cannot be optimised away). The buffer is split into `threads`
// contiguous bands, one per OpenMP thread (as the kernels split a weight's rows); each band into
// `streams` equal parts that the thread reads in lockstep, 256 bytes of each part per iteration
// (4 cache lines, 4 independent vector loads; 8 on AVX2), so `streams` sequential streams are in flight per
// thread. With prefetch_bytes > 0 every line is also prefetched that far ahead in its stream
// (hint 0: into L1, _MM_HINT_T0; 1: into L2, _MM_HINT_T1). Per vector of 64 bytes the loop does
// one vpsadbw and one add (the checksum is the sum of every byte, whatever the split), far below
// what a core can do per line from memory (AVX2: two 32-byte vectors a line, the same work per
// byte; without either, a scalar sum that is no probe). A band's tail that is not a multiple of
// 256 bytes per stream is read with scalar loads.
#include "common.h"
#include "entry_points.h"

#include <omp.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace dlinfer_cpu {
namespace {

constexpr int64_t kStep = 256;  // bytes of a stream per iteration: 4 lines
constexpr int kMaxStreams = 8;

template <int S>
uint64_t read_band(const uint8_t* p, int64_t part, int64_t prefetch, int hint) {
  const int64_t body = part - part % kStep;
#if defined(CPU_CAPABILITY_AVX512)
  __m512i acc[S];
  for (int s = 0; s < S; ++s) acc[s] = _mm512_setzero_si512();
  for (int64_t i = 0; i < body; i += kStep) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * part + i;
      if (prefetch > 0) {
        for (int64_t l = 0; l < kStep; l += 64) {
          if (hint == 0) {
            _mm_prefetch(reinterpret_cast<const char*>(q + prefetch + l), _MM_HINT_T0);
          } else {
            _mm_prefetch(reinterpret_cast<const char*>(q + prefetch + l), _MM_HINT_T1);
          }
        }
      }
      const __m512i z = _mm512_setzero_si512();  // vpsadbw against zero: the sums of 8 bytes, per 64-bit lane
      const __m512i a = _mm512_add_epi64(_mm512_sad_epu8(_mm512_loadu_si512(q), z),
                                         _mm512_sad_epu8(_mm512_loadu_si512(q + 64), z));
      const __m512i b = _mm512_add_epi64(_mm512_sad_epu8(_mm512_loadu_si512(q + 128), z),
                                         _mm512_sad_epu8(_mm512_loadu_si512(q + 192), z));
      acc[s] = _mm512_add_epi64(acc[s], _mm512_add_epi64(a, b));
    }
  }
  uint64_t sum = 0;
  for (int s = 0; s < S; ++s) sum += static_cast<uint64_t>(_mm512_reduce_add_epi64(acc[s]));
#elif defined(CPU_CAPABILITY_AVX2)
  // the same loop in 32-byte vectors: 8 loads a step, vpsadbw and adds as above
  __m256i acc[S];
  for (int s = 0; s < S; ++s) acc[s] = _mm256_setzero_si256();
  const __m256i z = _mm256_setzero_si256();
  for (int64_t i = 0; i < body; i += kStep) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * part + i;
      if (prefetch > 0) {
        for (int64_t l = 0; l < kStep; l += 64) {
          if (hint == 0) {
            _mm_prefetch(reinterpret_cast<const char*>(q + prefetch + l), _MM_HINT_T0);
          } else {
            _mm_prefetch(reinterpret_cast<const char*>(q + prefetch + l), _MM_HINT_T1);
          }
        }
      }
      __m256i t = acc[s];
      for (int l = 0; l < kStep; l += 64) {
        const __m256i a = _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + l)), z);
        const __m256i b = _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + l + 32)), z);
        t = _mm256_add_epi64(t, _mm256_add_epi64(a, b));
      }
      acc[s] = t;
    }
  }
  uint64_t sum = 0;
  for (int s = 0; s < S; ++s) {
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[s]);
    sum += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
#else
  uint64_t sum = 0;
  for (int64_t i = 0; i < body; i += kStep) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * part + i;
      if (prefetch > 0) {  // the locality argument must be a constant
        if (hint == 0) {
          __builtin_prefetch(q + prefetch, 0, 3);
        } else {
          __builtin_prefetch(q + prefetch, 0, 2);
        }
      }
      for (int64_t l = 0; l < kStep; ++l) sum += q[l];
    }
  }
#endif
  for (int s = 0; s < S; ++s)
    for (int64_t i = body; i < part; ++i) sum += p[s * part + i];
  return sum;
}

uint64_t read_band_any(const uint8_t* p, int64_t part, int streams, int64_t prefetch, int hint) {
  switch (streams) {
    case 1: return read_band<1>(p, part, prefetch, hint);
    case 2: return read_band<2>(p, part, prefetch, hint);
    case 3: return read_band<3>(p, part, prefetch, hint);
    case 4: return read_band<4>(p, part, prefetch, hint);
    case 6: return read_band<6>(p, part, prefetch, hint);
    default: return read_band<8>(p, part, prefetch, hint);
  }
}

}  // namespace

// buffer: uint8 [n], contiguous. threads >= 1; streams in {1, 2, 3, 4, 6, 8}; prefetch_bytes >= 0;
// hint 0 (L1) or 1 (L2). Returns the sum of the buffer's bytes (the same for any parameters).
int64_t read_probe(const at::Tensor& buffer, int64_t threads, int64_t streams, int64_t prefetch_bytes,
                   int64_t hint) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
              "read_probe: buffer must be a dense uint8 [n] tensor, got ", buffer.scalar_type(), " ",
              buffer.sizes());
  TORCH_CHECK(threads >= 1, "read_probe: threads must be >= 1, got ", threads);
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 3 || streams == 4 || streams == 6 || streams == kMaxStreams,
              "read_probe: streams must be 1, 2, 3, 4, 6 or 8, got ", streams);
  TORCH_CHECK(prefetch_bytes >= 0, "read_probe: prefetch_bytes must be >= 0, got ", prefetch_bytes);
  TORCH_CHECK(hint == 0 || hint == 1, "read_probe: hint must be 0 (L1) or 1 (L2), got ", hint);
  const uint8_t* base = buffer.data_ptr<uint8_t>();
  const int64_t n = buffer.numel();
  const int T = static_cast<int>(threads), S = static_cast<int>(streams);
  uint64_t total = 0;
#pragma omp parallel num_threads(T) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // bands of whole 64-byte lines; the last one takes the remainder
    const int64_t lines = n / 64;
    const int64_t b0 = lines * t / nt * 64, b1 = t + 1 == nt ? n : lines * (t + 1) / nt * 64;
    const int64_t part = (b1 - b0) / S;
    // a prefetch past the band would touch the next thread's band or past the buffer; the loop
    // reads part - part % kStep bytes of each stream with the prefetch on, so keep it inside
    const int64_t pf = prefetch_bytes > 0 && prefetch_bytes < part ? prefetch_bytes : 0;
    total += read_band_any(base + b0, part, S, pf, static_cast<int>(hint));
    for (int64_t i = b0 + part * S; i < b1; ++i) total += base[i];
  }
  return static_cast<int64_t>(total);
}

}  // namespace dlinfer_cpu
