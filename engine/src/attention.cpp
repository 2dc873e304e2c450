// Tiled attention with ATen ops (attention.h): grouped queries, causal tile masks, the online softmax's tile fold and
// finish, tile gathers, and tiled_attention over a block-layout KV.
#include <activekv/attention.h>
#include <activekv/check.h>
#include <activekv/geometry.h>

#include <ATen/TensorIndexing.h>

#include <cmath>
#include <limits>

namespace activekv {

at::Tensor group_query(const at::Tensor& q, int64_t num_kv_heads) {
  const int64_t lq = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t g = h / num_kv_heads;
  return q.to(at::kFloat).reshape({lq, num_kv_heads, g, d}).permute({1, 2, 0, 3}).reshape({num_kv_heads, g * lq, d});
}

at::Tensor ungroup_output(const at::Tensor& out, int64_t num_q_tokens) {
  const int64_t kvh = out.size(0), rows = out.size(1), d = out.size(2);
  const int64_t g = rows / num_q_tokens;
  return out.view({kvh, g, num_q_tokens, d}).permute({2, 0, 1, 3}).reshape({num_q_tokens, kvh * g, d});
}

at::Tensor tile_mask(int64_t first_query_pos, int64_t num_q_tokens, int64_t key_start, int64_t num_keys,
                     at::Device device) {
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  auto qpos = at::arange(first_query_pos, first_query_pos + num_q_tokens, opts);
  auto kpos = at::arange(key_start, key_start + num_keys, opts);
  return kpos.unsqueeze(0).gt(qpos.unsqueeze(1));
}

OnlineSoftmax online_softmax_init(int64_t num_kv_heads, int64_t rows, int64_t head_size, at::Device device) {
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  return {at::full({num_kv_heads, rows, 1}, -std::numeric_limits<float>::infinity(), opts),
          at::zeros({num_kv_heads, rows, 1}, opts), at::zeros({num_kv_heads, rows, head_size}, opts)};
}

at::Tensor gather_tile(const at::Tensor& kv, const at::Tensor& slots) {
  return kv.permute({1, 2, 0, 3, 4}).index_select(2, slots);
}

namespace {
// P x V of one tile: p [KVH, G * Lq, keys], v [KVH, keys, D] float32, mask as online_softmax_tile's. A key that some
// query rows see and others do not (the causal diagonal of a prefill tile) and whose V holds a NaN or an inf must
// reach only the rows that see it: in a plain matmul the others' p = 0 meets it, and 0 x NaN (or x inf) is NaN. Such
// keys leave the matmul and are added, one product each, to the rows that see them. Without one (always in decode,
// where every row sees the same keys, and whenever V is finite) this is the plain matmul.
at::Tensor probs_times_values(const at::Tensor& p, const at::Tensor& v, const at::Tensor& mask, int64_t g) {
  const int64_t kvh = p.size(0), rows = p.size(1), keys = p.size(2), lq = mask.size(-2);
  if (lq == 1) return at::matmul(p, v);
  // Keys no row sees have V = 0 already (online_softmax_tile), so "masked for some row" means "seen by some, not all".
  auto bad = v.isfinite().all(-1).logical_not().logical_and(mask.any(-2).reshape({-1, keys}));  // [KVH, keys]
  if (!bad.any().item<bool>()) return at::matmul(p, v);
  auto pv = at::matmul(p, v.masked_fill(bad.unsqueeze(-1), 0.0));
  auto idx = bad.nonzero();  // [nbad, 2]: (KV head, key)
  auto heads = idx.select(1, 0), cols = idx.select(1, 1);
  using at::indexing::Slice;
  auto seen = mask.logical_not().expand({kvh, g, lq, keys}).reshape({kvh, rows, keys});
  auto seen_bad = seen.index({heads, Slice(), cols}).unsqueeze(-1);  // [nbad, rows, 1]
  auto p_bad = p.index({heads, Slice(), cols}).unsqueeze(-1);        // [nbad, rows, 1]
  auto v_bad = v.index({heads, cols}).unsqueeze(1);                   // [nbad, 1, D]
  return pv.index_add_(0, heads, at::where(seen_bad, p_bad * v_bad, 0.0));
}
}  // namespace

void online_softmax_tile(OnlineSoftmax& st, const at::Tensor& qg, const at::Tensor& tile, const at::Tensor& mask,
                         double scale) {
  const int64_t kvh = qg.size(0), rows = qg.size(1), d = qg.size(2);
  const int64_t n = tile.size(2), bs = tile.size(3);
  const int64_t lq = mask.size(-2), g = rows / lq;
  // [KVH, 2, n, bs, D] -> [KVH, n * bs, D]: keys of the tile in position order, per KV head (a view when gathered).
  auto k = tile.select(1, 0).reshape({kvh, n * bs, d}).to(at::kFloat);
  // Keys no query row sees (past the last query's position: slots of the last block nothing has been written to yet,
  // which may hold anything) get V = 0, so that their zero probabilities never meet a non-finite value.
  // (In place on the float32 copy of a bfloat16/float16 tile; a float32 tile may be a view of the caller's KV.)
  auto unseen = mask.all(-2).reshape({-1, n * bs, 1});  // [1 or KVH, n * bs, 1]
  auto v = tile.select(1, 1).reshape({kvh, n * bs, d});
  v = v.scalar_type() == at::kFloat ? v.masked_fill(unseen, 0.0) : v.to(at::kFloat).masked_fill_(unseen, 0.0);
  auto s = at::matmul(qg, k.transpose(1, 2));  // [KVH, G * Lq, n * bs]
  s.mul_(scale);
  s.view({kvh, g, lq, n * bs}).masked_fill_(mask, -std::numeric_limits<float>::infinity());
  auto m_new = at::maximum(st.m, s.amax(-1, true));
  // A row with every key masked so far keeps m = -inf; shift by 0 there so exp gives 0, not NaN.
  auto m_safe = m_new.masked_fill(m_new.isneginf(), 0.0);
  auto p = at::sub(s, m_safe).exp_();
  auto alpha = at::sub(st.m, m_safe).exp_();
  st.l = at::add(at::mul(st.l, alpha), p.sum(-1, true));
  st.acc = at::add(at::mul(st.acc, alpha), probs_times_values(p, v, mask, g));
  st.m = m_new;
}

at::Tensor online_softmax_finish(const OnlineSoftmax& st) { return at::div(st.acc, st.l); }

at::Tensor tiled_attention(const at::Tensor& q, const at::Tensor& kv, int64_t seq_len, int64_t tile_blocks,
                           double scale) {
  AKV_CHECK_VALUE(q.dim() == 3, "q must be [num_q_tokens, num_heads, head_size], got ", shape_str(q.sizes()));
  AKV_CHECK_VALUE(kv.dim() == 5 && kv.size(2) == 2 && kv.size(4) == q.size(2),
                  "kv must be [num_blocks, num_kv_heads, 2, block_size, head_size] with head_size ", q.size(2),
                  ", got ", shape_str(kv.sizes()));
  AKV_CHECK_VALUE(q.size(1) > 0, "q must have num_heads > 0, got ", shape_str(q.sizes()));
  AKV_CHECK_VALUE(kv.size(1) > 0 && q.size(1) % kv.size(1) == 0, "num_heads (", q.size(1),
                  ") must be a multiple of num_kv_heads (", kv.size(1), ")");
  AKV_CHECK_VALUE(tile_blocks > 0, "tile_blocks must be > 0, got ", tile_blocks);
  AKV_CHECK_VALUE(std::isfinite(scale), "scale must be a finite number, got ", scale);
  AKV_CHECK_TYPE(q.is_floating_point() && kv.is_floating_point(), "q and kv must be floating-point tensors, got ",
                 q.scalar_type(), " and ", kv.scalar_type());
  AKV_CHECK_VALUE(kv.device() == q.device(), "kv must be on q's device ", q.device(), ", got ", kv.device());
  check_has_data(q, "q");
  check_has_data(kv, "kv");
  const int64_t lq = q.size(0), bs = kv.size(3);
  AKV_CHECK_VALUE(lq >= 1, "q must hold at least one query token, got ", shape_str(q.sizes()));
  AKV_CHECK_VALUE(lq <= seq_len && seq_len <= kv.size(0) * bs, "need num_q_tokens (", lq, ") <= seq_len (", seq_len,
                  ") <= num_blocks * block_size (", kv.size(0) * bs, ")");
  const int64_t kvh = kv.size(1);
  auto qg = group_query(q, kvh);
  auto st = online_softmax_init(kvh, qg.size(1), q.size(2), q.device());
  const int64_t nb = (seq_len + bs - 1) / bs;
  for (int64_t start = 0; start < nb; start += tile_blocks) {
    const int64_t n = std::min(nb, start + tile_blocks) - start;
    auto mask = tile_mask(seq_len - lq, lq, start * bs, n * bs, q.device());
    online_softmax_tile(st, qg, kv.narrow(0, start, n).permute({1, 2, 0, 3, 4}), mask, scale);
  }
  return ungroup_output(online_softmax_finish(st), lq);
}

}  // namespace activekv
