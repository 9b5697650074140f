// prefill_attention and paged_prefill_attention: flash-style causal attention of each sequence's
// new tokens over its keys, tiled and in float32 with an online softmax (prefill_tile.h).
//
// Work items are (sequence, kv head, tile of query tokens): the G = Hq / Hkv query heads of a kv
// head run together (a tile's rows are its tokens x G heads), so each key and value row is
// loaded once per item and used by every row of the tile. An item walks its sequence's keys in
// chunks (the paged op: one cache block per chunk, read in place; the varlen op: 64 keys), up to
// the last key its last token sees. Items are handed out largest first from a shared counter, so
// the long tiles at the end of a causal sequence do not leave a thread waiting at the end.
//
// prefill_attention: keys are the sequence's own tokens (key/value [T, Hkv, D/Dv]); token i of
// the sequence is at position i. paged_prefill_attention: keys are read from the paged caches
// ([NB, BS, Hkv, D] views, any layout) through the block table; sequence b has kv_len[b]
// positions of which the last n_b are the new tokens, so token i is at kv_len[b] - n_b + i and
// sees positions 0 .. that. int8 caches (k_scale, v_scale, v_zero [Hkv] float32): K's scale is
// folded into the query with the softmax scale and K's zero drops out of the softmax (as in
// attention.cpp); V is dequantised, (v - zero) * scale, as each chunk is converted to float32.
//
// A sliding window W (keys pos - W + 1 .. pos) skips the chunks wholly before the window of the
// tile's first row and masks the rest; a soft cap c turns each scaled score s into c tanh(s / c).
// With a soft cap K's zero no longer drops out of the softmax: an int8 K chunk is widened as k - zero.
//
// Bad metadata, handled as the torch vendor does (dlinfer/vendor/torch/attention.py): sequence
// rows are clamped into [0, T); a row several sequences claim belongs to the last of them; rows
// no sequence claims are zero; block ids are clamped into [0, NB), lengths into the block table
// (M * BS); a token before its sequence's first position (kv_len < n) sees no key and is zero.
// Nothing outside the tensors is read or written.
#include "common.h"
#include "entry_points.h"
#include "prefill_tile.h"

#include <atomic>
#include <vector>

namespace dlinfer_cpu {
namespace {

using prefill::kRowVec;

constexpr int64_t kVarlenChunk = 64;   // keys per chunk of prefill_attention
constexpr int64_t kTileRows = 96;      // rows (tokens x G heads) a tile aims for
constexpr int64_t kMinParallelFlops = 1 << 21;

struct Rows {
  const void* data;
  int64_t s_block, s_pos, s_head;  // element strides; s_block 0 for the varlen op's key/value
};

struct Args {
  int64_t T, Hq, Hkv, G, D, Dv, NB, BS, Mb, chunk, tile;
  float scale;
  const float* alibi = nullptr;    // [Hq]
  const float* k_scale = nullptr;  // [Hkv] (int8 caches)
  const float* k_zero = nullptr;   // [Hkv] (int8 caches with a soft cap)
  const float* v_scale = nullptr;
  const float* v_zero = nullptr;
  int64_t window = 0;  // sliding window (0: none)
  float softcap = 0.f;  // (0: none)
  Rows k, v;
  bool paged;
  IndexReader table;
  int64_t s_table = 0;
};

struct Seq {
  int64_t start, end, kv_len, first_pos, key_base;  // rows [start, end); token start at first_pos
};

struct Item {
  int64_t seq, hkv, t0, t1, cost;
};

struct Scratch {
  std::vector<float> qt, s, acc, m, l, corr, pos, slope, qrow, kbuf, vbuf;
};

// n keys from position p0 on as float32 rows (K rows, their stride, V rows, their stride): in place
// for float32 caches and inputs; converted (and V dequantised) into scratch otherwise.
struct Chunk {
  const float* k;
  int64_t ldk;
  const float* v;
  int64_t ldv;
};

template <typename C>
Chunk load_chunk(const Args& a, const Seq& sq, int64_t seq, int64_t hkv, int64_t p0, int64_t n, Scratch& w) {
  const C* kc = static_cast<const C*>(a.k.data);
  const C* vc = static_cast<const C*>(a.v.data);
  int64_t kb, vb;  // element offsets of the chunk's first K and V row
  if (a.paged) {
    const int64_t j = p0 / a.BS;
    const int64_t blk = std::min(std::max<int64_t>(a.table[seq * a.s_table + j], 0), a.NB - 1);
    kb = blk * a.k.s_block + (p0 % a.BS) * a.k.s_pos + hkv * a.k.s_head;
    vb = blk * a.v.s_block + (p0 % a.BS) * a.v.s_pos + hkv * a.v.s_head;
  } else {
    kb = (sq.key_base + p0) * a.k.s_pos + hkv * a.k.s_head;
    vb = (sq.key_base + p0) * a.v.s_pos + hkv * a.v.s_head;
  }
  if constexpr (std::is_same_v<C, float>) {
    return {kc + kb, a.k.s_pos, vc + vb, a.v.s_pos};
  } else {
    float* kf = w.kbuf.data();
    float* vf = w.vbuf.data();
    for (int64_t p = 0; p < n; ++p) {
      const C* kr = kc + kb + p * a.k.s_pos;
      const C* vr = vc + vb + p * a.v.s_pos;
      if constexpr (std::is_same_v<C, int8_t>) {
        const float s = a.v_scale[hkv], z = a.v_zero[hkv], zk = a.k_zero ? a.k_zero[hkv] : 0.f;
        for (int64_t d = 0; d < a.D; ++d) kf[p * a.D + d] = static_cast<float>(kr[d]) - zk;
        for (int64_t d = 0; d < a.Dv; ++d) vf[p * a.Dv + d] = (static_cast<float>(vr[d]) - z) * s;
      } else {
        to_float(kr, kf + p * a.D, a.D);
        to_float(vr, vf + p * a.Dv, a.Dv);
      }
    }
    return {kf, a.D, vf, a.Dv};
  }
}

// One item: rows t0..t1 of sequence `seq`, kv head hkv. `owner` [T]: the sequence each row belongs
// to (rows of other sequences are neither read nor written here).
template <typename T, typename C>
void run_item(const Args& a, const Seq& sq, const Item& it, const int64_t* owner, const T* q, int64_t sq_t,
              int64_t sq_h, T* o, int64_t so_t, int64_t so_h, Scratch& w) {
  const int64_t G = a.G, D = a.D, Dv = a.Dv;
  const int64_t live = (it.t1 - it.t0) * G;
  const int64_t rows = (live + kRowVec - 1) / kRowVec * kRowVec;
  w.qt.assign(D * rows, 0.f);
  w.acc.assign(rows * Dv, 0.f);
  w.m.assign(rows, -std::numeric_limits<float>::infinity());
  w.l.assign(rows, 0.f);
  w.corr.resize(rows);
  w.pos.assign(rows, -1.f);
  w.slope.assign(rows, 0.f);
  w.s.resize(a.chunk * rows);
  const float qscale = a.k_scale ? a.scale * a.k_scale[it.hkv] : a.scale;
  int64_t last = -1;  // the last key position a row of the tile sees
  int64_t earliest = -1;  // the first row's position (rows are in position order)
  std::vector<float>& row = w.qrow;
  row.resize(D);
  for (int64_t t = it.t0; t < it.t1; ++t) {
    const int64_t pos = sq.first_pos + (t - sq.start);
    if (owner[t] != it.seq || pos < 0) continue;  // pos < 0: sees no key, written as zero
    last = std::max(last, pos);
    if (earliest < 0) earliest = pos;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (t - it.t0) * G + g;
      to_float(q + t * sq_t + (it.hkv * G + g) * sq_h, row.data(), D);
      for (int64_t d = 0; d < D; ++d) w.qt[d * rows + r] = row[d] * qscale;
      w.pos[r] = static_cast<float>(pos);
      if (a.alibi) w.slope[r] = a.alibi[it.hkv * G + g];
    }
  }
  const prefill::RowState st{w.m.data(),  w.l.data(), w.corr.data(), w.pos.data(), a.alibi ? w.slope.data() : nullptr,
                             static_cast<float>(a.window), a.softcap};
  // the first chunk holding a key some row sees: the window of the earliest row starts there
  const int64_t from = a.window > 0 && earliest >= 0 ? std::max<int64_t>(0, earliest - a.window + 1) / a.chunk * a.chunk : 0;
  for (int64_t p0 = from; p0 <= last; p0 += a.chunk) {
    const int64_t n = std::min(a.chunk, last + 1 - p0);
    const Chunk c = load_chunk<C>(a, sq, it.seq, it.hkv, p0, n, w);
    prefill::chunk_scores(w.qt.data(), rows, c.k, c.ldk, n, D, w.s.data());
    prefill::chunk_softmax(w.s.data(), rows, n, p0, st);
    prefill::chunk_values(w.s.data(), rows, live, w.corr.data(), c.v, c.ldv, n, Dv, w.acc.data());
  }
  for (int64_t t = it.t0; t < it.t1; ++t) {
    if (owner[t] != it.seq) continue;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (t - it.t0) * G + g;
      float* out = w.acc.data() + r * Dv;
      const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;  // a row that sees no key is zero
      scale(inv, out, Dv);
      from_float(out, o + t * so_t + (it.hkv * G + g) * so_h, Dv);
    }
  }
}

// The sequences' row ranges (clamped, later ones owning shared rows), the items, rows nobody owns.
struct Plan {
  std::vector<Seq> seqs;
  std::vector<int64_t> owner;  // [T], -1: no sequence
  std::vector<Item> items;
  int64_t flops = 0;
};

Plan make_plan(Args& a, const at::Tensor& cu_seqlens_q, const at::Tensor* kv_seq_len) {
  Plan plan;
  const int64_t B = cu_seqlens_q.size(0) - 1;
  IndexReader cu(cu_seqlens_q);
  plan.owner.assign(a.T, -1);
  plan.seqs.resize(std::max<int64_t>(B, 0));
  const int64_t cap = a.paged ? a.Mb * a.BS : 0;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = std::min(std::max<int64_t>(cu[b], 0), a.T);
    const int64_t end = std::min(std::max<int64_t>(cu[b + 1], 0), a.T);
    Seq& s = plan.seqs[b];
    s = Seq{start, std::max(start, end), 0, 0, start};
    const int64_t n = s.end - s.start;
    if (a.paged) {
      s.kv_len = std::min(IndexReader(*kv_seq_len)[b], cap);
      s.first_pos = s.kv_len - n;
    }
    for (int64_t t = s.start; t < s.end; ++t) plan.owner[t] = b;
    longest = std::max(longest, n);
  }
  // tile: about kTileRows rows, smaller while that leaves fewer than 4 items per thread
  int64_t tile = std::max<int64_t>(1, kTileRows / a.G);
  const int64_t threads = at::get_num_threads();
  while (tile > 8 && a.Hkv * ((longest + tile - 1) / tile) < 4 * threads) tile /= 2;
  a.tile = tile;
  for (int64_t b = 0; b < B; ++b) {
    const Seq& s = plan.seqs[b];
    for (int64_t t0 = s.start; t0 < s.end; t0 += tile) {
      const int64_t t1 = std::min(s.end, t0 + tile);
      int64_t keys = std::max<int64_t>(0, s.first_pos + (t1 - 1 - s.start) + 1);
      if (a.window > 0) keys = std::min(keys, a.window + (t1 - t0));
      const int64_t cost = (t1 - t0) * a.G * keys * (a.D + a.Dv) * 2;
      for (int64_t h = 0; h < a.Hkv; ++h) plan.items.push_back(Item{b, h, t0, t1, cost});
      plan.flops += cost * a.Hkv;
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return plan;
}

template <typename T, typename C>
void run(const Args& a, const Plan& plan, const at::Tensor& query, const at::Tensor& out) {
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t n = static_cast<int64_t>(plan.items.size());
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    thread_local Scratch w;
    w.kbuf.resize(a.chunk * a.D);
    w.vbuf.resize(a.chunk * a.Dv);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const Item& it = plan.items[i];
      run_item<T, C>(a, plan.seqs[it.seq], it, plan.owner.data(), q, query.stride(0), query.stride(1), o,
                     out.stride(0), out.stride(1), w);
    }
  };
  if (plan.flops < kMinParallelFlops) {
    worker(0, 1);
  } else {
    at::parallel_for(0, at::get_num_threads(), 1, worker);
  }
  // rows no sequence owns
  for (int64_t t = 0; t < a.T; ++t) {
    if (plan.owner[t] >= 0) continue;
    for (int64_t h = 0; h < a.Hq; ++h) std::memset(o + t * out.stride(0) + h * out.stride(1), 0, a.Dv * sizeof(T));
  }
}

template <typename C>
void dispatch(const Args& a, const Plan& plan, const at::Tensor& query, const at::Tensor& out) {
  AT_DISPATCH_V2(query.scalar_type(), "prefill_attention", AT_WRAP([&] {
                   if constexpr (std::is_same_v<C, int8_t>) {
                     run<scalar_t, int8_t>(a, plan, query, out);
                   } else {
                     run<scalar_t, scalar_t>(a, plan, query, out);
                   }
                 }), at::kFloat, at::kBFloat16, at::kHalf);
}

void common_args(Args& a, const at::Tensor& query, const at::Tensor& out, double softmax_scale,
                 const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window, double logit_softcapping,
                 const char* op) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, op, ": query and out must be [T, H, D]");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), op, ": out's dtype must be query's");
  a.T = query.size(0);
  a.Hq = query.size(1);
  a.D = query.size(2);
  a.Dv = out.size(2);
  a.scale = static_cast<float>(softmax_scale);
  a.window = std::max<int64_t>(sliding_window, 0);
  a.softcap = static_cast<float>(std::max(logit_softcapping, 0.0));
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->is_contiguous() &&
                    alibi_slopes->numel() == a.Hq, op, ": alibi_slopes must be float32 [Hq]");
    a.alibi = alibi_slopes->data_ptr<float>();
  }
}

void finish(const at::Tensor& out, const at::Tensor& out_in) {
  if (!out.is_same(out_in)) out_in.copy_(out);  // an output whose last dim was strided
}

}  // namespace

void prefill_attention(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                       const at::Tensor& cu_seqlens_q, double softmax_scale,
                       const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out_in,
                       int64_t sliding_window, double logit_softcapping) {
  const at::Tensor query = dense_rows(query_in), key = dense_rows(key_in), value = dense_rows(value_in);
  const at::Tensor out = dense_rows(out_in);
  Args a{};
  common_args(a, query, out, softmax_scale, alibi_slopes, sliding_window, logit_softcapping, "prefill_attention");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) == a.T && value.size(0) == a.T &&
                  key.size(2) == a.D && value.size(2) == a.Dv && value.size(1) == key.size(1),
              "prefill_attention: key [T, Hkv, D], value [T, Hkv, Dv]");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "prefill_attention: dtypes must match");
  a.Hkv = key.size(1);
  a.G = a.Hq / a.Hkv;
  a.NB = 1;
  a.BS = 1;
  a.chunk = kVarlenChunk;
  a.paged = false;
  a.k = Rows{key.data_ptr(), 0, key.stride(0), key.stride(1)};
  a.v = Rows{value.data_ptr(), 0, value.stride(0), value.stride(1)};
  if (a.T == 0) return;
  const Plan plan = make_plan(a, cu_seqlens_q, nullptr);
  dispatch<void>(a, plan, query, out);
  finish(out, out_in);
}

void paged_prefill_attention(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& kv_seq_len, double softmax_scale,
                             const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out_in,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                             const std::optional<at::Tensor>& v_zero, const std::optional<at::Tensor>& k_zero,
                             int64_t sliding_window, double logit_softcapping) {
  const at::Tensor query = dense_rows(query_in), out = dense_rows(out_in);
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "paged_prefill_attention: caches [NB, BS, Hkv, D]");
  // A ValueError; the Python wrapper (kernels.py, _rows_dense) sends such caches to the torch vendor first.
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                    "paged_prefill_attention: the last dim of the caches must be dense");
  Args a{};
  common_args(a, query, out, softmax_scale, alibi_slopes, sliding_window, logit_softcapping,
              "paged_prefill_attention");
  const bool int8 = k_scale.has_value();
  const auto cache_type = int8 ? at::kChar : query.scalar_type();
  TORCH_CHECK(key_cache.scalar_type() == cache_type && value_cache.scalar_type() == cache_type,
              "paged_prefill_attention: the caches' dtype must be query's (int8 with scales)");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1, "block_table rows must be dense");
  TORCH_CHECK(cu_seqlens_q.is_contiguous() && kv_seq_len.is_contiguous() &&
                  kv_seq_len.size(0) == cu_seqlens_q.size(0) - 1 && block_table.size(0) == kv_seq_len.size(0),
              "paged_prefill_attention: lengths [B+1] / [B], block_table [B, M]");
  a.NB = key_cache.size(0);
  a.BS = key_cache.size(1);
  a.Hkv = key_cache.size(2);
  a.G = a.Hq / a.Hkv;
  TORCH_CHECK(key_cache.size(3) == a.D && value_cache.size(3) == a.Dv, "paged_prefill_attention: head dims");
  a.chunk = a.BS;
  a.paged = true;
  a.k = Rows{key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)};
  a.v = Rows{value_cache.data_ptr(), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)};
  a.table = IndexReader(block_table);
  a.s_table = block_table.stride(0);
  a.Mb = block_table.size(1);
  if (int8) {
    TORCH_CHECK(v_scale.has_value() && v_zero.has_value(), "paged_prefill_attention: k_scale, v_scale, v_zero");
    for (const at::Tensor* t : {&*k_scale, &*v_scale, &*v_zero})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == a.Hkv,
                  "paged_prefill_attention: scales and zeros must be float32 [Hkv]");
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
    a.v_zero = v_zero->data_ptr<float>();
    if (a.softcap > 0.f) {
      TORCH_CHECK(k_zero.has_value() && k_zero->scalar_type() == at::kFloat && k_zero->is_contiguous() &&
                      k_zero->numel() == a.Hkv, "paged_prefill_attention: a soft cap over an int8 cache needs k_zero [Hkv]");
      a.k_zero = k_zero->data_ptr<float>();
    }
  }
  if (a.T == 0) return;
  if (a.NB == 0 || a.Mb == 0) {
    out_in.zero_();
    return;
  }
  const Plan plan = make_plan(a, cu_seqlens_q, &kv_seq_len);
  if (int8) {
    dispatch<int8_t>(a, plan, query, out);
  } else {
    dispatch<void>(a, plan, query, out);
  }
  finish(out, out_in);
}

}  // namespace dlinfer_cpu
