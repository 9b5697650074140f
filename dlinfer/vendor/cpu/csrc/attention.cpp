// paged_decode_attention: each query token attends to its sequence's cached keys, read straight
// from the paged cache (no gather copy), in float32, with an online softmax.
//
// Work items are (token, kv head, split): the G = Hq / Hkv query heads that share a kv head are
// done together, so each cached key and value row is read once per item and used G times. When
// tokens x kv heads are too few to keep every thread busy (batch 1), each token's keys are cut
// into S splits of whole blocks (flash-decoding): every split keeps its running max m, sum l and
// weighted value sum, and a second pass merges the splits:
//   M = max_s m_s,  out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.
// Per block of BS keys: scores s = (q * scale).k (+ alibi slope * (key pos - query pos)), then
//   m' = max(m, max s);  l = l e^(m - m') + sum e^(s - m');  acc = acc e^(m - m') + sum e^(s - m') v.
// Token i of sequence b (n_b new tokens) sits at position kv_len[b] - n_b + i and sees keys
// 0 .. that position; with a sliding window W only keys pos - W + 1 .. pos: the blocks wholly before
// that are never read (nor counted when the keys are cut into splits), and the keys before it in
// its first block score -inf. A soft cap c turns each scaled score s into c tanh(s / c) before ALiBi
// (with an int8 cache the K zero is then applied, as it no longer drops out). Block ids are clamped into the cache and lengths into the block table (and
// max_kv_seq_len), so bad metadata can never read outside the cache.
//
// The int8 cache (k_scale, k_zero, v_scale, v_zero [Hkv] float32; dlinfer/ops/kv_quant.py): K and
// V rows are read as int8 in place and widened to float32 in registers (attention_block.h
// load_row); the scales and zeros are applied outside the per-key loops, exactly:
//   scores: q.((k - zk) sk) = sk (q.k) - sk zk sum(q). The first term is (q * sk).k, so sk is
//     folded into the query with the softmax scale; the second is the same for every key of a
//     (token, head), and softmax is invariant under such a shift, so k_zero drops out.
//   values: sum_p w_p (v_p - zv) sv / l = sv (sum_p w_p v_p / l - zv), applied to the finished
//     row (after the split merge), only where the token saw a key (l > 0).
//
// query [T, Hq, D], out [T, Hq, Dv]; the caches come as [NB, BS, Hkv, D] / [NB, BS, Hkv, Dv] views
// (dlinfer/vendor/kv_layouts.py `canonical`: a permuted view for head_major), read through their
// block, slot and head strides; block_table [B, M], cu_seqlens_q [B+1], kv_seq_len [B].
#include "attention_block.h"
#include "common.h"
#include "entry_points.h"

#include <cmath>
#include <vector>

namespace dlinfer_cpu {
namespace {

struct CacheView {
  const void* data;
  int64_t s_block, s_pos, s_head;  // element strides of the [NB, BS, H, D] view
};

struct DecodeArgs {
  int64_t T, Hq, Hkv, G, D, Dv, NB, BS, Mb, S;
  const float* k_scale = nullptr;  // [Hkv] (int8 caches only)
  const float* k_zero = nullptr;   // [Hkv] (int8 caches with a soft cap only)
  const float* v_scale = nullptr;  // [Hkv]
  const float* v_zero = nullptr;   // [Hkv]
  int64_t bytes;  // K/V bytes the call reads
  float scale;
  float softcap = 0.f;  // 0: none
  const float* alibi;  // [Hq] or nullptr
  CacheView k, v;
  const int64_t* tok_seq;  // [T] sequence of each token
  const int64_t* tok_len;  // [T] keys each token sees (0 .. pos), clamped to the block table
  const int64_t* tok_first;  // [T] first key it sees (0 without a window)
  const int64_t* tok_pos;  // [T] query position
  IndexReader table;
  int64_t s_table;
};

// Scratch of one work item, reused across the items a thread runs.
struct ItemScratch {
  std::vector<float> q, scores, acc, row, m, l, shift;
  void size(const DecodeArgs& a) {
    q.resize(a.G * a.D);
    shift.resize(a.G);
    scores.resize(a.G * a.BS);
    acc.resize(a.G * a.Dv);
    row.resize(a.Dv);  // an output row before its rounding to the query's dtype
    m.resize(a.G);
    l.resize(a.G);
  }
};

// K/V bytes below which the whole call runs on the calling thread. 32 KB, not 256: inside a decode
// step the cache comes from memory (the step's weights streamed it out), and there a SmolLM2 layer's
// call at 100-250 tokens of context (36-96 KB, 3 kv heads over 2 threads) took 9.9-11.2 us in
// parallel against 15.5-16.6 on one thread; in a loop (cache hot), 160 tokens: 5.2 against 5.6
// (Zen 5 VM; docs/notes/decode-step-overheads.md).
constexpr int64_t kMinParallelAttentionBytes = 32 * 1024;

// A finished output row of kv head hkv (sum_p w_p v_p / l): (row - zv) * sv for an int8 cache.
inline void dequantise_row(const DecodeArgs& a, int64_t hkv, float* row) {
  if (!a.v_scale) return;
  const float s = a.v_scale[hkv], z = a.v_zero[hkv];
  for (int64_t i = 0; i < a.Dv; ++i) row[i] = (row[i] - z) * s;
}

// Runs one (token, kv head, split) item; leaves m, l (per query head) and acc (G x Dv) in w.
// T: the query's dtype; C: the cache's (T, or int8_t for the int8 cache).
template <typename T, typename C>
void run_item(const DecodeArgs& a, const T* q_tok, int64_t sq_h, int64_t t, int64_t hkv, int64_t split,
              ItemScratch& w) {
  const int64_t G = a.G, D = a.D, Dv = a.Dv, BS = a.BS;
  for (int64_t g = 0; g < G; ++g) to_float(q_tok + (hkv * G + g) * sq_h, w.q.data() + g * D, D);
  // (q * scale) . k: the softmax scale (and an int8 cache's k scale) folded into the query
  scale(a.k_scale ? a.scale * a.k_scale[hkv] : a.scale, w.q.data(), G * D);
  if (a.softcap > 0.f && a.k_zero) {  // the K zero's share of every score: zk sum(q) (it drops out without a cap)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t d = 0; d < D; ++d) sum += w.q[g * D + d];
      w.shift[g] = a.k_zero[hkv] * sum;
    }
  }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const int64_t len = a.tok_len[t], first = a.tok_first[t];
  const int64_t jb = first / BS, blocks = (len + BS - 1) / BS;  // blocks jb .. blocks - 1 hold the keys seen
  const int64_t per_split = (blocks - jb + a.S - 1) / a.S;
  const int64_t j0 = jb + split * per_split, j1 = std::min(blocks, j0 + per_split);
  const int64_t seq = a.tok_seq[t], qpos = a.tok_pos[t];
  const C* kc = static_cast<const C*>(a.k.data);
  const C* vc = static_cast<const C*>(a.v.data);
  auto block_id = [&](int64_t j) { return std::min(std::max<int64_t>(a.table[seq * a.s_table + j], 0), a.NB - 1); };
  int64_t next = j0 < j1 ? block_id(j0) : 0;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = next;
    const int64_t n = std::min(BS, len - j * BS);
    Prefetch ahead;  // the next block's rows, one key's worth per key of this block
    if (j + 1 < j1) {
      next = block_id(j + 1);
      ahead = Prefetch{reinterpret_cast<const char*>(kc + next * a.k.s_block + hkv * a.k.s_head),
                       reinterpret_cast<const char*>(vc + next * a.v.s_block + hkv * a.v.s_head),
                       a.k.s_pos * static_cast<int64_t>(sizeof(C)), a.v.s_pos * static_cast<int64_t>(sizeof(C)),
                       D * static_cast<int64_t>(sizeof(C)), Dv * static_cast<int64_t>(sizeof(C)),
                       std::min(BS, len - (j + 1) * BS)};
    }
    block_scores(w.q.data(), G, D, kc + blk * a.k.s_block + hkv * a.k.s_head, a.k.s_pos, n, w.scores.data(), BS,
                 ahead);
    const int64_t hidden = std::max<int64_t>(0, first - j * BS);  // keys of this block before the window
    for (int64_t g = 0; g < G; ++g) {
      float* s = w.scores.data() + g * BS;
      if (a.softcap > 0.f) {
        const float c = a.softcap, inv = 1.f / a.softcap, z = a.k_zero ? w.shift[g] : 0.f;
        for (int64_t p = 0; p < n; ++p) s[p] = c * std::tanh((s[p] - z) * inv);
      }
      for (int64_t p = 0; p < hidden; ++p) s[p] = -std::numeric_limits<float>::infinity();
      if (a.alibi) {
        const float slope = a.alibi[hkv * G + g];
        for (int64_t p = 0; p < n; ++p) s[p] += slope * static_cast<float>(j * BS + p - qpos);
      }
      online_softmax(s, n, w.m[g], w.l[g], w.acc.data() + g * Dv, Dv);
    }
    block_values(w.scores.data(), BS, G, vc + blk * a.v.s_block + hkv * a.v.s_head, a.v.s_pos, n, Dv, w.acc.data());
  }
}

template <typename T, typename C>
void decode(const DecodeArgs& a, const at::Tensor& query, const at::Tensor& out) {
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t sq_t = query.stride(0), sq_h = query.stride(1);
  const int64_t so_t = out.stride(0), so_h = out.stride(1);
  const int64_t items = a.T * a.Hkv * a.S;
  const int64_t G = a.G, Dv = a.Dv, S = a.S;
  // Partial results of every split (S > 1 only): m, l [T, Hq, S]; acc [T, Hq, S, Dv].
  std::vector<float> part_ml, part_acc;
  if (S > 1) {
    part_ml.resize(a.T * a.Hq * S * 2);
    part_acc.resize(a.T * a.Hq * S * Dv);
  }
  auto run_items = [&](int64_t begin, int64_t end) {
    thread_local ItemScratch w;
    w.size(a);
    const float* m = w.m.data();
    const float* l = w.l.data();
    for (int64_t it = begin; it < end; ++it) {
      const int64_t split = it % S, hkv = (it / S) % a.Hkv, t = it / (S * a.Hkv);
      run_item<T, C>(a, q + t * sq_t, sq_h, t, hkv, split, w);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hkv * G + g;
        const float* acc = w.acc.data() + g * Dv;
        if (S == 1) {
          const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // a token that sees no key gets zeros
          float* row = w.row.data();
          for (int64_t i = 0; i < Dv; ++i) row[i] = acc[i] * inv;
          if (l[g] > 0.f) dequantise_row(a, hkv, row);
          from_float(row, o + t * so_t + h * so_h, Dv);
        } else {
          const int64_t pi = (t * a.Hq + h) * S + split;
          part_ml[pi * 2] = m[g];
          part_ml[pi * 2 + 1] = l[g];
          std::memcpy(part_acc.data() + pi * Dv, acc, Dv * sizeof(float));
        }
      }
    }
  };
  // Under kMinParallelAttentionBytes: less work than waking the pool, run on the calling thread.
  at::parallel_for(0, items, grain_for(items, a.bytes, kMinParallelAttentionBytes), run_items);
  if (S == 1) return;
  at::parallel_for(0, a.T * a.Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(Dv);
    for (int64_t th = begin; th < end; ++th) {
      const float* ml = part_ml.data() + th * S * 2;
      float mmax = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) mmax = std::max(mmax, ml[s * 2]);
      std::fill(row.begin(), row.end(), 0.f);
      float total = 0.f;
      if (mmax > -std::numeric_limits<float>::infinity()) {
        for (int64_t s = 0; s < S; ++s) {
          if (ml[s * 2 + 1] == 0.f) continue;
          const float f = std::exp(ml[s * 2] - mmax);
          total += f * ml[s * 2 + 1];
          axpy(f, part_acc.data() + (th * S + s) * Dv, row.data(), Dv);
        }
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t i = 0; i < Dv; ++i) row[i] *= inv;
      const int64_t t = th / a.Hq, h = th % a.Hq;
      if (total > 0.f) dequantise_row(a, h / G, row.data());
      from_float(row.data(), o + t * so_t + h * so_h, Dv);
    }
  });
}

CacheView cache_view(const at::Tensor& cache) {
  return CacheView{cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2)};
}

}  // namespace

// Splits per (token, kv head): only when tokens x kv heads leave threads idle (fewer than two items
// per thread), and never below 256 keys a split.
int64_t decode_num_splits(int64_t tokens, int64_t kv_heads, int64_t longest, int64_t block_size, int64_t threads) {
  const int64_t base = tokens * kv_heads;
  if (base == 0 || base >= 2 * threads) return 1;
  const int64_t want = (2 * threads + base - 1) / base;
  const int64_t most = std::max<int64_t>(1, ((longest + block_size - 1) / block_size * block_size) / 256);
  return std::min(want, most);
}

void paged_decode_attention(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& kv_seq_len, int64_t max_kv_seq_len, double softmax_scale,
                            const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out_in,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            const std::optional<at::Tensor>& v_zero, const std::optional<at::Tensor>& k_zero,
                            int64_t sliding_window, double logit_softcapping) {
  const at::Tensor query = dense_rows(query_in), out = dense_rows(out_in);
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "ranks");
  // A ValueError; the Python wrapper (kernels.py, _rows_dense) sends such caches to the torch vendor first.
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                    "paged_decode_attention: the last dim of the caches must be dense");
  const bool int8 = k_scale.has_value();
  const auto cache_type = int8 ? at::kChar : query.scalar_type();
  TORCH_CHECK(key_cache.scalar_type() == cache_type && value_cache.scalar_type() == cache_type &&
                  out.scalar_type() == query.scalar_type(), "paged_decode_attention: dtypes must match");
  TORCH_CHECK(cu_seqlens_q.is_contiguous() && kv_seq_len.is_contiguous(), "lengths must be contiguous");
  DecodeArgs a{};
  a.T = query.size(0);
  a.Hq = query.size(1);
  a.D = query.size(2);
  a.NB = key_cache.size(0);
  a.BS = key_cache.size(1);
  a.Hkv = key_cache.size(2);
  a.Dv = value_cache.size(3);
  a.G = a.Hq / a.Hkv;
  a.Mb = block_table.size(1);
  a.scale = static_cast<float>(softmax_scale);
  a.k = cache_view(key_cache);
  a.v = cache_view(value_cache);
  a.table = IndexReader(block_table);
  a.s_table = block_table.stride(0);
  TORCH_CHECK(block_table.stride(1) == 1, "block_table rows must be dense");
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->is_contiguous(), "alibi_slopes");
    a.alibi = alibi_slopes->data_ptr<float>();
  }
  if (int8) {
    TORCH_CHECK(v_scale.has_value() && v_zero.has_value(), "paged_decode_attention: k_scale, v_scale, v_zero");
    for (const at::Tensor* t : {&*k_scale, &*v_scale, &*v_zero})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == a.Hkv,
                  "paged_decode_attention: scales and zeros must be float32 [Hkv]");
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
    a.v_zero = v_zero->data_ptr<float>();
  }
  a.softcap = static_cast<float>(std::max(logit_softcapping, 0.0));
  if (int8 && a.softcap > 0.f) {
    TORCH_CHECK(k_zero.has_value() && k_zero->scalar_type() == at::kFloat && k_zero->is_contiguous() &&
                    k_zero->numel() == a.Hkv, "paged_decode_attention: a soft cap over an int8 cache needs k_zero [Hkv]");
    a.k_zero = k_zero->data_ptr<float>();
  }
  if (a.T == 0 || a.NB == 0) {
    if (a.T) out_in.zero_();
    return;
  }
  // Per token: its sequence, position and the number of keys it sees.
  const int64_t B = kv_seq_len.size(0);
  IndexReader cu(cu_seqlens_q), kvl(kv_seq_len);
  std::vector<int64_t> tok_seq(a.T, 0), tok_len(a.T, 0), tok_first(a.T, 0), tok_pos(a.T, 0);
  const int64_t cap = std::min(a.Mb * a.BS, std::max<int64_t>(max_kv_seq_len, 0));
  int64_t longest = 0, keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = std::max<int64_t>(cu[b], 0), end = std::min<int64_t>(cu[b + 1], a.T);
    for (int64_t t = start; t < end; ++t) {
      const int64_t pos = kvl[b] - (cu[b + 1] - cu[b]) + (t - cu[b]);
      tok_seq[t] = b;
      tok_pos[t] = pos;
      tok_len[t] = std::min(std::max<int64_t>(pos + 1, 0), cap);
      // the first key seen; at most the last one (a length clamped by bad metadata still leaves a key
      // to see in the first block read, never a block of -inf scores)
      if (sliding_window > 0)
        tok_first[t] = std::min(std::max<int64_t>(pos - sliding_window + 1, 0), std::max<int64_t>(tok_len[t] - 1, 0));
      const int64_t seen = tok_len[t] - tok_first[t] / a.BS * a.BS;  // the keys of the blocks it reads
      longest = std::max(longest, seen);
      keys += seen;
    }
  }
  a.tok_seq = tok_seq.data();
  a.tok_len = tok_len.data();
  a.tok_first = tok_first.data();
  a.tok_pos = tok_pos.data();
  a.bytes = keys * a.Hkv * (a.D + a.Dv) * static_cast<int64_t>(key_cache.element_size());
  a.S = decode_num_splits(a.T, a.Hkv, longest, a.BS, at::get_num_threads());
  if (int8) {
    AT_DISPATCH_V2(query.scalar_type(), "paged_decode_attention",
                   AT_WRAP([&] { decode<scalar_t, int8_t>(a, query, out); }), at::kFloat, at::kBFloat16, at::kHalf);
  } else {
    AT_DISPATCH_V2(query.scalar_type(), "paged_decode_attention",
                   AT_WRAP([&] { decode<scalar_t, scalar_t>(a, query, out); }), at::kFloat, at::kBFloat16, at::kHalf);
  }
  if (!out.is_same(out_in)) out_in.copy_(out);  // an output whose last dim was strided
}

}  // namespace dlinfer_cpu
