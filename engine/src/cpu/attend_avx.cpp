// The CPU attention kernel's vector path (AVX-512, AVX2 and the default build of at::vec::Vectorized): chunks of
// blocks read in place from the pool, scores, online-softmax merge and P x V per group of query rows, and the kernel's
// entry points of one capability (attend_blocks, uses_bf16_query, has_amx). Compiled once per CPU capability; bfloat16
// KV on AMX goes to attend_amx.cpp. See activekv/cpu_kernel.h for the contract.
#include "kernel_primitives.h"

namespace activekv::cpu_kernel {
namespace CPU_CAPABILITY {

namespace {

// Bytes of a chunk's V up to which P x V walks the whole chunk once per vector of the head (below L1d's 48 KiB on
// the processors measured: docs/benchmarks.md).
constexpr int64_t kChunkVInL1 = 32 * 1024;

// Whether the vector registers (32 with AVX-512, 16 with AVX2) hold the accumulators of 4 query rows times 4 vectors
// of the head beside 4 vectors of V, for P x V block by block.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kWideRows = true;
#else
constexpr bool kWideRows = false;
#endif

// o[i][u] += sum over t < lim[i] of p[i * nk + t] * v[t, j + u * kW ..], keys in order, for the RB rows and NJ vectors
// of the head held in registers (one block's V; p: the rows' probabilities of the block's keys, row stride nk). Both
// loop orders of P x V in chunk_rows accumulate through this.
template <typename T, int RB, int NJ>
inline void accumulate_block(const T* v, int64_t d, int64_t j, const float* p, int64_t nk, const int64_t* lim,
                             Vec (&o)[RB][NJ]) {
  int64_t vmax = 0, vmin = std::numeric_limits<int64_t>::max();
  for (int i = 0; i < RB; ++i) {
    vmax = std::max(vmax, lim[i]);
    vmin = std::min(vmin, lim[i]);
  }
  const auto keys = [&](auto uniform) {  // uniform limits (decode rows, prefill rows past the block): no test per row
    for (int64_t t = 0; t < vmax; ++t) {
      Vec vt[NJ];
      for (int u = 0; u < NJ; ++u) vt[u] = in_register(load_float(v + t * d + j + u * kW));
      for (int i = 0; i < RB; ++i) {
        if (!decltype(uniform)::value && t >= lim[i]) continue;
        const Vec pt(p[i * nk + t]);
        for (int u = 0; u < NJ; ++u) o[i][u] = at::vec::fmadd(pt, vt[u], o[i][u]);
      }
    }
  };
  if (vmin == vmax) {
    keys(std::true_type{});
  } else {
    keys(std::false_type{});
  }
}

// Query rows per call from which a chunk's K is packed (kt below) and scored as a matrix product: a prefill chunk's
// rows, never a decode row's GQA group (whose few rows would not repay the packing).
constexpr int64_t kPackRows = 16;
// Keys per pass of the packed scorer: two vectors (2 x RB accumulators, two loads of kt per query value).
constexpr int64_t kPackKeys = 2 * kW;

// K of a chunk packed for the matrix-product scorer in panels of kPackKeys keys, each panel contiguous (what one pass
// reads, in order): kt[(t / P) * d * P + j * P + t % P] = K[t, j] widened to float32 (P = kPackKeys; key t of the
// chunk, blocks c0 .. c0 + cb - 1 of the args in order), zeros for t in [nk, ldk); ldk = nk rounded up to P.
template <typename T>
void pack_keys(const AttendArgs& a, int64_t c0, int64_t cb, float* kt, int64_t ldk) {
  const int64_t bs = a.block_size, d = a.head_size, nk = cb * bs;
  for (int64_t c = 0; c < cb; ++c) {
    const T* k = static_cast<const T*>(a.kv[c0 + c]);
    for (int64_t t = 0; t < bs; ++t) {
      const int64_t key = c * bs + t;
      float* panel = kt + (key / kPackKeys) * d * kPackKeys + key % kPackKeys;
      for (int64_t j = 0; j < d; ++j) panel[j * kPackKeys] = static_cast<float>(k[t * d + j]);
    }
  }
  for (int64_t key = nk; key < ldk; ++key) {
    float* panel = kt + (key / kPackKeys) * d * kPackKeys + key % kPackKeys;
    for (int64_t j = 0; j < d; ++j) panel[j * kPackKeys] = 0.f;
  }
}

// Scores of the RB query rows r0 .. r0 + RB - 1 against the packed keys [0, n) (n a multiple of kPackKeys, at most
// ldk) as a small matrix product: s[i * nk + t] = scale * sum_j q[r0 + i, j] * K[t, j], each product one chain of
// fused multiply-adds over j in order in one vector lane, so a score does not depend on RB or on the other keys of
// its pass. Keys from nk on (padding) are not stored.
template <int RB>
void score_packed(const AttendArgs& a, int64_t r0, const float* kt, int64_t n, float scale, float* s, int64_t nk) {
  const int64_t d = a.head_size;
  const float* q = a.q + r0 * d;
  for (int64_t t = 0; t < n; t += kPackKeys) {
    const float* panel = kt + t * d;  // (t / kPackKeys) * d * kPackKeys
    Vec acc[RB][2];
    for (int i = 0; i < RB; ++i) acc[i][0] = acc[i][1] = Vec(0.f);
    for (int64_t j = 0; j < d; ++j) {
      const Vec k0 = Vec::loadu(panel + j * kPackKeys), k1 = Vec::loadu(panel + j * kPackKeys + kW);
      for (int i = 0; i < RB; ++i) {
        const Vec qv(q[i * d + j]);
        acc[i][0] = at::vec::fmadd(qv, k0, acc[i][0]);
        acc[i][1] = at::vec::fmadd(qv, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < RB; ++i) {
      float* si = s + i * nk + t;
      if (t + kPackKeys <= nk) {
        (acc[i][0] * Vec(scale)).store(si);
        (acc[i][1] * Vec(scale)).store(si + kW);
      } else {
        alignas(64) float tmp[kPackKeys];
        (acc[i][0] * Vec(scale)).store(tmp);
        (acc[i][1] * Vec(scale)).store(tmp + kW);
        std::copy(tmp, tmp + (nk - t), si);
      }
    }
  }
}

// Columns of the head per panel of the packed V (two vectors: 2 x RB accumulators per pass of P x V).
constexpr int64_t kPackCols = 2 * kW;
// Bytes of packed float32 K per chunk of the packed path at most: keys per chunk = kPackChunkBytes / (4 x head size),
// at least 256 (whole blocks, at least one). Its packed K and V (128 KiB each: 512 keys at head size 64, 256 at 128)
// stay in L2 while every row group of the call walks them; a larger tile (block 128: 2048 keys) is taken in chunks of
// this many keys, each merged on its own, fixed by the call's blocks and so by the tile, not by the rows. Against
// chunks of 256 keys at head size 64: 2-3% less time per prefill chunk at block 128.
constexpr int64_t kPackChunkBytes = 128 * 1024;
inline int64_t pack_chunk_keys(int64_t head_size) {
  return std::max<int64_t>(256, kPackChunkBytes / (4 * head_size));
}

// V of a chunk packed for the matrix-product P x V in panels of kPackCols columns of the head, each panel contiguous
// over the chunk's keys (what one pass reads, in order): vt[(j / P) * nk * P + t * P + j % P] = V[t, j] widened to
// float32 (P = kPackCols; key t of the chunk, blocks c0 .. c0 + cb - 1 of the args in order), zeros for the columns
// of the last panel past the head size.
template <typename T>
void pack_values(const AttendArgs& a, int64_t c0, int64_t cb, float* vt) {
  const int64_t bs = a.block_size, d = a.head_size, nk = cb * bs;
  const int64_t dp = (d + kPackCols - 1) / kPackCols * kPackCols;
  for (int64_t c = 0; c < cb; ++c) {
    const T* v = static_cast<const T*>(a.kv[c0 + c]) + bs * d;
    for (int64_t t = 0; t < bs; ++t) {
      const int64_t key = c * bs + t;
      const T* vr = v + t * d;
      float* row = vt + key * kPackCols;  // key's values of panel 0
      const auto dst = [&](int64_t j) { return row + (j / kPackCols) * nk * kPackCols + j % kPackCols; };
      int64_t j = 0;
      for (; j + kW <= d; j += kW) load_float(vr + j).store(dst(j));
      for (; j < dp; ++j) *dst(j) = j < d ? static_cast<float>(vr[j]) : 0.f;
    }
  }
}

// P x V of the RB rows r0 .. r0 + RB - 1 against the packed V (vt, nk keys): acc[i][j] = acc[i][j] * alpha[i] + sum
// of p[i * nk + t] * V[t, j] over the row's visible keys t of the chunk in order (lim: the rows' visible keys per
// block, [RB, cb]). Per panel of kPackCols columns, RB x 2 accumulators in registers over the chunk's keys, each key's
// two vectors of V loaded once for the RB rows and each probability broadcast once for both: per element one chain of
// fused multiply-adds in key order, so a row's result does not depend on RB or on the other rows.
template <int RB>
void values_packed(const AttendArgs& a, int64_t r0, const float* vt, int64_t cb, const float* p, int64_t nk,
                   const int64_t* lim, const float* alpha) {
  const int64_t bs = a.block_size, d = a.head_size;
  float* acc[RB];
  for (int i = 0; i < RB; ++i) acc[i] = a.acc + (r0 + i) * d;
  for (int64_t j = 0; j < d; j += kPackCols) {
    const float* panel = vt + (j / kPackCols) * nk * kPackCols;
    const int64_t cols = std::min(kPackCols, d - j);
    Vec o[RB][2];
    for (int i = 0; i < RB; ++i) {
      if (cols == kPackCols) {
        o[i][0] = Vec::loadu(acc[i] + j) * Vec(alpha[i]);
        o[i][1] = Vec::loadu(acc[i] + j + kW) * Vec(alpha[i]);
      } else {  // a head size off 2 x kW: the last panel's columns past the head read as zeros and are not stored
        alignas(64) float tmp[kPackCols] = {};
        std::copy(acc[i] + j, acc[i] + j + cols, tmp);
        o[i][0] = Vec::loadu(tmp) * Vec(alpha[i]);
        o[i][1] = Vec::loadu(tmp + kW) * Vec(alpha[i]);
      }
    }
    for (int64_t c = 0; c < cb; ++c) {
      int64_t lim_c[RB];
      for (int i = 0; i < RB; ++i) lim_c[i] = lim[i * cb + c];
      accumulate_block<float, RB, 2>(panel + c * bs * kPackCols, kPackCols, 0, p + c * bs, nk, lim_c, o);
    }
    for (int i = 0; i < RB; ++i) {
      if (cols == kPackCols) {
        o[i][0].store(acc[i] + j);
        o[i][1].store(acc[i] + j + kW);
      } else {
        alignas(64) float tmp[kPackCols];
        o[i][0].store(tmp);
        o[i][1].store(tmp + kW);
        std::copy(tmp, tmp + cols, acc[i] + j);
      }
    }
  }
}

// One chunk of a prefill chunk's rows (16 or more per call) for RB query rows r0 .. r0 + RB - 1, against the chunk's K
// and V packed (kt, vt): the scores of every key up to the last one a row sees, -inf past each row's limits up to its
// end (its last visible key rounded up to kW: merge_rows reads no further), one online-softmax merge per row, then
// P x V as a matrix product. s: [RB, cb * bs] scratch; valid: [RB, cb] scratch. Its own function (not a branch of
// chunk_rows), so the decode path's instantiations stay as they are.
template <int RB>
void chunk_packed(const AttendArgs& a, int64_t r0, int64_t c0, int64_t cb, float* s, int64_t* valid, const float* kt,
                  const float* vt) {
  const int64_t bs = a.block_size, nk = cb * bs, nkv = nk - nk % kW;
  // fill_valid's limits, and in the same pass the end of the row's last visible key in the chunk (c * bs + valid grows
  // with c wherever valid > 0: the last such block's).
  int64_t any = 0, end[RB], seen = 0;
  for (int i = 0; i < RB; ++i) {
    const int64_t row_seen = keys_seen(a, r0 + i);
    int64_t last = 0;
    for (int64_t c = 0; c < cb; ++c) {
      const int64_t v = visible_in_block(row_seen, a.block_pos[c0 + c] * bs, bs);
      valid[i * cb + c] = v;
      any += v;
      last = v > 0 ? c * bs + v : last;
    }
    seen = std::max(seen, last);
    end[i] = (last + kW - 1) / kW * kW;
    if (end[i] > nkv) end[i] = nk;
  }
  if (any == 0) return;  // a row group before this chunk: nothing to merge
  score_packed<RB>(a, r0, kt, (seen + kPackKeys - 1) / kPackKeys * kPackKeys, static_cast<float>(a.scale), s, nk);
  for (int i = 0; i < RB; ++i)
    for (int64_t c = 0; c * bs < end[i]; ++c)
      std::fill(s + i * nk + c * bs + valid[i * cb + c], s + i * nk + std::min((c + 1) * bs, end[i]), kNegInf);
  float alpha[RB];
  merge_rows<RB>(a, r0, s, nk, alpha, nullptr, 0, end);
  values_packed<RB>(a, r0, vt, cb, s, nk, valid, alpha);
}

// One chunk (blocks c0 .. c0 + cb - 1 of the args, at most chunk_blocks) for RB query rows r0 .. r0 + RB - 1: the
// scores of every key of the chunk, then one online-softmax merge per row (running max, rescale of the accumulator,
// probabilities), then the rows' accumulators walk the chunk's V one vector of the head at a time, the RB rows
// sharing each load. s: [RB, cb * bs] scratch; valid: [RB, cb] scratch; q_bf16: the args' q rounded to bfloat16
// (bfloat16 KV on a processor with AVX512-BF16) or null.
template <typename T, int RB>
void chunk_rows(const AttendArgs& a, int64_t r0, int64_t c0, int64_t cb, float* s, int64_t* valid,
                const at::BFloat16* q_bf16) {
  const int64_t bs = a.block_size, d = a.head_size, nk = cb * bs;
  const float scale = static_cast<float>(a.scale);
  if (fill_valid<RB>(a, r0, c0, cb, valid) == 0) return;  // a prefill row group before this chunk: nothing to merge
  // Scores, block by block so the block's K stays in L1 across the rows; keys past a row's limit become -inf. Whole
  // groups of kW keys go to score_group: every head size with AVX512-BF16 dot products (q_bf16 is given only for head
  // sizes that are multiples of 16 = kW), else head sizes that are multiples of kW.
  const bool whole_groups = q_bf16 != nullptr || d % kW == 0;
  const int64_t k_bytes = bs * d * static_cast<int64_t>(sizeof(T));
  for (int64_t c = 0; c < cb; ++c) {
    const T* k = static_cast<const T*>(a.kv[c0 + c]);
    ask_next_block(a, c0 + c, k_bytes);
    // Groups of kW keys every row sees, scored for the RB rows together (K loaded once for them) where the rows divide
    // kW; then each row's other whole groups alone, and its partial group (or every group of a head size off the
    // vector width without AVX512-BF16) by score_keys.
    int64_t shared = 0;
    if constexpr (RB > 1 && kW % RB == 0) {
      if (whole_groups) {
        int64_t nmin = bs;
        for (int i = 0; i < RB; ++i) nmin = std::min(nmin, valid[i * cb + c]);
        for (; shared + kW <= nmin; shared += kW)
          score_group<T, RB>(a, q_bf16, r0, k + shared * d, scale, s + c * bs + shared, nk);
      }
    }
    for (int i = 0; i < RB; ++i) {
      float* si = s + i * nk + c * bs;
      const int64_t n = valid[i * cb + c];
      int64_t t = shared;
      if (whole_groups)
        for (; t + kW <= n; t += kW) score_group<T, 1>(a, q_bf16, r0 + i, k + t * d, scale, si + t, 0);
      for (; t < n; t += kW) score_keys(a.q + (r0 + i) * d, k + t * d, d, std::min<int64_t>(kW, n - t), scale, si + t);
      for (t = n; t < bs; ++t) si[t] = kNegInf;
    }
  }
  float alpha[RB];
  merge_rows<RB>(a, r0, s, nk, alpha, nullptr, 0);
  // acc = acc * alpha + sum_t p_t v_t; a row reads only its visible keys' V. Per element the sum is acc * alpha, then
  // the chunk's keys in order, whichever of the two loop orders runs (the same results from both).
  float* acc[RB];
  for (int i = 0; i < RB; ++i) acc[i] = a.acc + (r0 + i) * d;
  const int64_t dv = d - d % kW;
  // Columns [j, j + NJ * kW) of the rows' accumulators over the whole chunk: loaded (times alpha) and stored once,
  // in registers across the chunk's blocks.
  const auto walk = [&](int64_t j, auto nj) {
    constexpr int NJ = decltype(nj)::value;
    Vec o[RB][NJ];
    for (int i = 0; i < RB; ++i)
      for (int u = 0; u < NJ; ++u) o[i][u] = Vec::loadu(acc[i] + j + u * kW) * Vec(alpha[i]);
    for (int64_t c = 0; c < cb; ++c) {
      int64_t lim[RB];
      for (int i = 0; i < RB; ++i) lim[i] = valid[i * cb + c];
      accumulate_block<T, RB, NJ>(static_cast<const T*>(a.kv[c0 + c]) + bs * d, d, j, s + c * bs, nk, lim, o);
    }
    for (int i = 0; i < RB; ++i)
      for (int u = 0; u < NJ; ++u) o[i][u].store(acc[i] + j + u * kW);
  };
  // A head of one or two vectors (head size 32 in float32 with AVX-512) is walked in one pass whatever the chunk's
  // size: each block's V read once in address order with no accumulator loads and stores between blocks, which at
  // block 16 cost a quarter of P x V's loads. Against one pass per block: 8% less time per decode step of the e2e
  // tiny model's geometry at block 16 (head size 32, GQA 2), the same at block 128. A head of four vectors (64) walked
  // so measured 5% slower at GQA 3 (1024-token rows, batch 8) and stays block by block.
  if (dv == 2 * kW) {
    walk(0, std::integral_constant<int, 2>{});
  } else if (dv == kW) {
    walk(0, std::integral_constant<int, 1>{});
  } else if (cb * bs * d * static_cast<int64_t>(sizeof(T)) > kChunkVInL1) {
    // The chunk's V outgrows L1 (64-128 KiB at head size 128): block by block, each block's V read once in address
    // order, the rows' accumulators of one, two or four vectors of the head in registers over the block's keys.
    for (int i = 0; i < RB; ++i)
      for (int64_t j = 0; j < dv; j += kW) (Vec::loadu(acc[i] + j) * Vec(alpha[i])).store(acc[i] + j);
    const auto block = [&](const T* v, int64_t j, const int64_t* lim, int64_t c, auto nj) {
      constexpr int NJ = decltype(nj)::value;
      Vec o[RB][NJ];
      for (int i = 0; i < RB; ++i)
        for (int u = 0; u < NJ; ++u) o[i][u] = Vec::loadu(acc[i] + j + u * kW);
      accumulate_block<T, RB, NJ>(v, d, j, s + c * bs, nk, lim, o);
      for (int i = 0; i < RB; ++i)
        for (int u = 0; u < NJ; ++u) o[i][u].store(acc[i] + j + u * kW);
    };
    for (int64_t c = 0; c < cb; ++c) {
      const T* v = static_cast<const T*>(a.kv[c0 + c]) + bs * d;
      int64_t lim[RB];
      for (int i = 0; i < RB; ++i) lim[i] = valid[i * cb + c];
      int64_t j = 0;
      if constexpr (kWideRows) {
        // With 32 vector registers: four vectors of the head at a time (RB x 4 accumulators and 4 of V), so each
        // probability's broadcast and each accumulator's load and store serve twice the multiply-adds.
        for (; j + 4 * kW <= dv; j += 4 * kW) block(v, j, lim, c, std::integral_constant<int, 4>{});
      }
      for (; j + 2 * kW <= dv; j += 2 * kW) block(v, j, lim, c, std::integral_constant<int, 2>{});
      for (; j < dv; j += kW) block(v, j, lim, c, std::integral_constant<int, 1>{});
    }
  } else {
    // The chunk's V fits in L1 (few blocks): two vectors of the head at a time (2 x RB independent chains of fused
    // multiply-adds; one vector's RB chains waited on the adds' latency) over the whole chunk, the accumulators loaded
    // and stored once per chunk instead of once per block.
    int64_t j = 0;
    for (; j + 2 * kW <= dv; j += 2 * kW) walk(j, std::integral_constant<int, 2>{});
    for (; j < dv; j += kW) walk(j, std::integral_constant<int, 1>{});
  }
  for (int64_t j = dv; j < d; ++j) {  // head sizes that are not a multiple of kW
    for (int i = 0; i < RB; ++i) {
      float o = acc[i][j] * alpha[i];
      for (int64_t c = 0; c < cb; ++c) {
        const T* v = static_cast<const T*>(a.kv[c0 + c]) + bs * d + j;
        for (int64_t t = 0; t < valid[i * cb + c]; ++t) o += s[i * nk + c * bs + t] * static_cast<float>(v[t * d]);
      }
      acc[i][j] = o;
    }
  }
}

constexpr int kRowBlock = 4;  // query rows sharing each pass over V (a GQA group of 4 in one pass)
// Query rows per pass of the packed path (a prefill chunk's rows): 6 x 2 accumulators, 2 vectors of K or V and a
// broadcast fit AVX2's 16 vector registers; 12 independent chains of fused multiply-adds cover their latency (the
// same with AVX-512, measured on a processor of one 512-bit load per cycle: its loop waits on the multiply-adds).
constexpr int kPackRowBlock = 6;

// Group g of a call's members (AttendArgs::members) as a call of its own.
AttendArgs member_args(const AttendArgs& a, int64_t g) {
  AttendArgs m = a;
  const int64_t off = g * a.member_stride, d = a.head_size;
  m.q = a.q + off * d;
  if (a.q_bf16 != nullptr) m.q_bf16 = a.q_bf16 + off * d;
  m.m = a.m + off;
  m.l = a.l + off;
  m.acc = a.acc + off * d;
  m.members = 1;
  m.member_stride = 0;
  return m;
}

template <typename T>
void attend(const AttendArgs& a) {
  bool amx = false;
#if defined(CPU_CAPABILITY_AVX512)
  amx = std::is_same_v<T, at::BFloat16> && use_amx(a);
#endif
  if (a.members > 1 && (amx || a.rows < kPackRows)) {  // only the packed path shares anything between the groups
    for (int64_t g = 0; g < a.members; ++g) attend<T>(member_args(a, g));
    return;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if (amx) return attend_amx(a);
#endif
  // A chunk never spans more than the call's blocks: scratch for those, not for a tile of any size (the chunks are the
  // same either way).
  const int64_t bs = a.block_size, d = a.head_size;
  const int64_t cmax = std::max<int64_t>(1, std::min(a.chunk_blocks, a.num_blocks));
  thread_local std::vector<float> s;
  thread_local std::vector<int64_t> valid;
  s.resize(kPackRowBlock * cmax * bs);
  valid.resize(kPackRowBlock * cmax);
  const at::BFloat16* qb = std::is_same_v<T, at::BFloat16> && uses_bf16_query(d) ? a.q_bf16 : nullptr;
  if (a.rows >= kPackRows) {
    // A prefill chunk's rows: each chunk's K and V packed once (float32 panels) for the matrix-product scorer and
    // P x V, kPackRowBlock rows per pass, chunks of at most pack_chunk_keys(d) keys.
    thread_local std::vector<float> kt, vt;
    const int64_t cstep = std::max<int64_t>(1, std::min(cmax, pack_chunk_keys(d) / bs));
    const int64_t ldk = (cstep * bs + kPackKeys - 1) / kPackKeys * kPackKeys;
    kt.resize(d * ldk);
    vt.resize((d + kPackCols - 1) / kPackCols * kPackCols * cstep * bs);
    for (int64_t c0 = 0; c0 < a.num_blocks; c0 += cstep) {
      const int64_t cb = std::min(cstep, a.num_blocks - c0);
      bool seen = false;  // by the row of the last query token (the causal limit grows with the token)
      for (int64_t c = 0; c < cb && !seen; ++c)
        seen = visible_in_block(keys_seen(a, std::min(a.num_q, a.rows) - 1), a.block_pos[c0 + c] * bs, bs) > 0;
      if (!seen) continue;  // a chunk past every row of the call (a run's later tiles): nothing to pack or merge
      pack_keys<T>(a, c0, cb, kt.data(), (cb * bs + kPackKeys - 1) / kPackKeys * kPackKeys);
      pack_values<T>(a, c0, cb, vt.data());
      const float *k = kt.data(), *v = vt.data();
      for (int64_t g = 0; g < a.members; ++g) {  // every group of rows against the chunk packed once
        const AttendArgs ag = a.members > 1 ? member_args(a, g) : a;
        int64_t r0 = 0;
        for (; r0 + kPackRowBlock <= ag.rows; r0 += kPackRowBlock)
          chunk_packed<kPackRowBlock>(ag, r0, c0, cb, s.data(), valid.data(), k, v);
        switch (ag.rows - r0) {
          case 5: chunk_packed<5>(ag, r0, c0, cb, s.data(), valid.data(), k, v); break;
          case 4: chunk_packed<4>(ag, r0, c0, cb, s.data(), valid.data(), k, v); break;
          case 3: chunk_packed<3>(ag, r0, c0, cb, s.data(), valid.data(), k, v); break;
          case 2: chunk_packed<2>(ag, r0, c0, cb, s.data(), valid.data(), k, v); break;
          case 1: chunk_packed<1>(ag, r0, c0, cb, s.data(), valid.data(), k, v); break;
          default: break;
        }
      }
    }
    return;
  }
  for (int64_t c0 = 0; c0 < a.num_blocks; c0 += cmax) {
    const int64_t cb = std::min(cmax, a.num_blocks - c0);
    int64_t r0 = 0;
    for (; r0 + kRowBlock <= a.rows; r0 += kRowBlock)
      chunk_rows<T, kRowBlock>(a, r0, c0, cb, s.data(), valid.data(), qb);
    switch (a.rows - r0) {
      case 3: chunk_rows<T, 3>(a, r0, c0, cb, s.data(), valid.data(), qb); break;
      case 2: chunk_rows<T, 2>(a, r0, c0, cb, s.data(), valid.data(), qb); break;
      case 1: chunk_rows<T, 1>(a, r0, c0, cb, s.data(), valid.data(), qb); break;
      default: break;
    }
  }
}

}  // namespace

bool uses_bf16_query(int64_t head_size) {
#if defined(CPU_CAPABILITY_AVX512)
  return has_bf16_dot() && head_size % 16 == 0;  // score_keys_bf16_rows' tail handles 16 values
#else
  (void)head_size;
  return false;
#endif
}

bool has_amx() {
#if defined(CPU_CAPABILITY_AVX512)
  return amx_ready();
#else
  return false;
#endif
}

void attend_blocks(const AttendArgs& args) {
  switch (args.dtype) {
    case at::kFloat: return attend<float>(args);
    case at::kBFloat16: return attend<at::BFloat16>(args);
    case at::kHalf: return attend<at::Half>(args);
    default: TORCH_CHECK_TYPE(false, "the CPU kernel supports float32, bfloat16 and float16 KV, got ", args.dtype);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace activekv::cpu_kernel
