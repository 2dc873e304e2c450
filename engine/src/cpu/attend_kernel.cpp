// The fast CPU attention kernel, compiled once per CPU capability (CMake sets CPU_CAPABILITY and its flags), in the
// manner of ATen's own native/cpu kernels. See activekv/cpu_kernel.h for the contract.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <activekv/cpu_kernel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace activekv::cpu_kernel {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
constexpr int kW = Vec::size();  // keys scored together, and floats per vector
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

namespace {

// kW values of T at p as one float vector (bfloat16 / float16 widened exactly).
template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bfloat16: the high half
    } else {
      return _mm512_cvtph_ps(h);
    }
#else
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, kW));
    (void)hi;
    return lo;
#endif
  }
}

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// out[t] = sum of the lanes of v[t] for the kW vectors v[0..kW). With AVX-512: a butterfly over the 16 vectors (15
// additions of whole vectors and 30 shuffles for 16 sums) instead of one horizontal reduction per vector (4 dependent
// shuffle-add pairs each). The summation order is fixed either way.
#if defined(CPU_CAPABILITY_AVX512)
inline void lane_sums(const __m512* v, float* out) {
  // Inputs are taken in the order kPerm (an involution), so that lane t of the result is the sum of v[t].
  constexpr int kPerm[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 b[8], c[4], e[2];
  for (int k = 0; k < 8; ++k) {  // 256-bit halves: b[k] = [8 partials of input k | 8 partials of input k + 8]
    const __m512 x = v[kPerm[k]], y = v[kPerm[k + 8]];
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // 128-bit quarters: 4 partials per input
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[k], b[k + 4], 0x88), _mm512_shuffle_f32x4(b[k], b[k + 4], 0xDD));
  for (int k = 0; k < 2; ++k)  // pairs within each quarter: 2 partials per input
    e[k] = _mm512_add_ps(_mm512_shuffle_ps(c[k], c[k + 2], 0x44), _mm512_shuffle_ps(c[k], c[k + 2], 0xEE));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD)));
}

inline void lane_sums(const Vec* v, float* out) {
  static_assert(kW == 16, "AVX-512 float vectors hold 16 lanes");
  __m512 m[16];
  for (int t = 0; t < 16; ++t) m[t] = v[t];
  lane_sums(m, out);
}
#else
inline void lane_sums(const Vec* v, float* out) {
  for (int t = 0; t < kW; ++t) out[t] = reduce_add(v[t]);
}
#endif

// One pass of a group's scores: the kW accumulators of KP = kW / RB keys for RB query rows (acc[i * KP + t]), each
// summed across its lanes by one lane_sums, scaled and stored at out[i * ld + p * KP + t]. One row's kW scores
// (RB = 1) are contiguous and scaled as one vector. The float32 and the AVX512-BF16 scorers both end with this.
template <int RB, typename V>
inline void store_scores(const V* acc, int p, float scale, float* out, int64_t ld) {
  constexpr int KP = kW / RB;
  if constexpr (RB == 1) {
    lane_sums(acc, out);
    (Vec::loadu(out) * Vec(scale)).store(out);
  } else {
    alignas(64) float sums[kW];
    lane_sums(acc, sums);
    for (int i = 0; i < RB; ++i)
      for (int t = 0; t < KP; ++t) out[i * ld + p * KP + t] = sums[i * KP + t] * scale;
  }
}

// Scores of kW consecutive keys, all of them visible, for RB consecutive query rows at once (RB divides kW):
// out[i * ld + t] = scale * (q_i . k_t). Each of a key's vectors of K is loaded once for the RB rows, where
// score_keys loads it once per row; kW / RB keys per pass, whose RB * kW / RB dot products accumulate in kW
// registers and are summed by one lane_sums. Per dot product the same fused multiply-adds in the same order and the
// same lane sum as score_keys (bit-identical to it). head_size a multiple of kW.
template <typename T, int RB>
inline void score_keys_rows(const float* q, const T* k, int64_t d, float scale, float* out, int64_t ld) {
  static_assert(kW % RB == 0, "the rows must divide the keys scored together");
  constexpr int KP = kW / RB;
  for (int p = 0; p < RB; ++p) {
    Vec acc[RB * KP];
    for (int x = 0; x < RB * KP; ++x) acc[x] = Vec(0.f);
    for (int64_t j = 0; j < d; j += kW) {
      Vec qv[RB];
      for (int i = 0; i < RB; ++i) qv[i] = Vec::loadu(q + i * d + j);
      for (int t = 0; t < KP; ++t) {
        const Vec kv = load_float(k + (p * KP + t) * d + j);
        for (int i = 0; i < RB; ++i) acc[i * KP + t] = at::vec::fmadd(qv[i], kv, acc[i * KP + t]);
      }
    }
    store_scores<RB>(acc, p, scale, out, ld);
  }
}

// Scores of n <= kW consecutive keys (rows of k, stride d) for one query row: out[t] = scale * (q . k_t), t < n: the
// groups score_group does not take (fewer than kW keys, or a head size off the vector width). The row's vector of q
// is loaded once per kW keys; the dot products accumulate in kW registers, summed by lane_sums, the same per dot
// product as score_keys_rows; a head size that is not a multiple of kW ends with a scalar tail.
template <typename T>
inline void score_keys(const float* q, const T* k, int64_t d, int64_t n, float scale, float* out) {
  const int64_t dv = d - d % kW;
  Vec acc[kW];
  for (int t = 0; t < kW; ++t) acc[t] = Vec(0.f);
  for (int64_t j = 0; j < dv; j += kW) {
    const Vec qv = Vec::loadu(q + j);
    for (int64_t t = 0; t < n; ++t) acc[t] = at::vec::fmadd(qv, load_float(k + t * d + j), acc[t]);
  }
  float sums[kW];
  lane_sums(acc, sums);
  for (int64_t t = 0; t < n; ++t) {
    float r = sums[t];
    for (int64_t j = dv; j < d; ++j) r += q[j] * static_cast<float>(k[t * d + j]);
    out[t] = r * scale;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 bfloat16 values at p as vdpbf16ps' pairs; with half, 16 values and the upper half zero.
__attribute__((target("avx512bf16"))) inline __m512bh bf16_piece(const at::BFloat16* p, bool half) {
  return half ? (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
              : (__m512bh)_mm512_loadu_si512(p);
}

// bfloat16 K with AVX512-BF16 (`vdpbf16ps`: per float lane, two bfloat16 products added to the accumulator): the
// query rows q_bf16 are the float32 rows rounded back to bfloat16, exact because they were widened from the model's
// bfloat16; K is read as stored, with no widening pass. Per key and row, head_size / 32 instructions instead of
// head_size / 16 widenings and fused multiply-adds. Used when the processor has the extension (has_bf16_dot), else
// score_keys. Same result as score_keys up to float32 rounding (each instruction rounds its two products' sum).
// Scores of 16 consecutive keys, all visible, for RB consecutive query rows (row stride head_size) at once, as
// score_keys_rows does for float32: out[i * ld + t] = scale * (q_i . k_t); each of a key's 32-value pieces of K is
// loaded once for the RB rows, 16 / RB keys per pass, their 16 dot products summed by one lane_sums. Per dot product
// the same instructions in the same order for every RB (RB = 1: one row, its 16 scores scaled as one vector), so
// the rows' scores do not depend on how many rows are scored together. head_size a multiple of 16.
template <int RB>
__attribute__((target("avx512bf16"))) void score_keys_bf16_rows(const at::BFloat16* q_bf16, const at::BFloat16* k,
                                                                 int64_t d, float scale, float* out, int64_t ld) {
  static_assert(16 % RB == 0, "the rows must divide the keys scored together");
  constexpr int KP = 16 / RB;
  for (int p = 0; p < RB; ++p) {
    const at::BFloat16* kp = k + p * KP * d;
    __m512 acc[16];
    for (int x = 0; x < 16; ++x) acc[x] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 32) {
      const bool half = j + 32 > d;  // head sizes 80, 112, ...: a last piece of 16 values
      __m512bh qv[RB];
      for (int i = 0; i < RB; ++i) qv[i] = bf16_piece(q_bf16 + i * d + j, half);
      for (int t = 0; t < KP; ++t) {
        const __m512bh kv = bf16_piece(kp + t * d + j, half);
        for (int i = 0; i < RB; ++i) acc[i * KP + t] = _mm512_dpbf16_ps(acc[i * KP + t], qv[i], kv);
      }
    }
    store_scores<RB>(acc, p, scale, out, ld);
  }
}

// Whether the processor has AVX512-BF16 (asked once; __builtin_cpu_init first, as a static initializer may run before
// libgcc's own).
bool has_bf16_dot() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16") != 0);
  return yes;
}

// Whether the bfloat16 AMX path may run (asked once per process): the processor has AMX-TILE and AMX-BF16 (CPUID leaf
// 7: EDX bits 24 and 22) and AVX512-BF16, Linux grants this process the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as oneDNN asks; refused by kernels before 5.16), and the environment
// does not set ACTIVEKV_CPU_AMX=0.
bool amx_ready() {
  static const bool yes = [] {
    const char* env = std::getenv("ACTIVEKV_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((edx & (1u << 24)) == 0 || (edx & (1u << 22)) == 0 || !has_bf16_dot()) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return yes;
}
#endif

// Scores of kW consecutive keys that the RB consecutive query rows r0 .. r0 + RB - 1 all see, into out[i * ld + t]:
// by AVX512-BF16 dot products against q_bf16 where it is given (bfloat16 K), else against the float32 rows (head size
// a multiple of kW). The one scorer of whole groups, for the rows together and for each row alone.
template <typename T, int RB>
inline void score_group(const AttendArgs& a, const at::BFloat16* q_bf16, int64_t r0, const T* k, float scale,
                        float* out, int64_t ld) {
  const int64_t d = a.head_size;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (q_bf16 != nullptr) return score_keys_bf16_rows<RB>(q_bf16 + r0 * d, k, d, scale, out, ld);
  }
#endif
  score_keys_rows<T, RB>(a.q + r0 * d, k, d, scale, out, ld);
}

// Ask for the cache lines of [p, p + bytes) ahead of use. A block's K and V of one head are a few KiB (4 KiB at
// block 16 and head size 32 in float32), read one after another from slots spread over the pool: the hardware's stream
// prefetchers stop at each 4 KiB page, so without this every block starts with demand misses.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Start the hardware's stream prefetchers on a block's K and V (each a run of `half` bytes, K first): ask for the
// first `lines` cache lines of each, and the prefetchers, seeing a stream begin, fetch the rest of its page.
inline void kick_kv(const void* kv, int64_t half, int lines) {
  const char* c = static_cast<const char*>(kv);
  for (int i = 0; i < lines; ++i) {
    __builtin_prefetch(c + 64 * i, 0, 3);
    __builtin_prefetch(c + half + 64 * i, 0, 3);
  }
}

// While block c's K is scored, ask for the next block: a K of a page or more (head size 128 in float32) has its first
// 2 lines and V's asked for, the hardware prefetchers fetching the rest of each page; a smaller K (the e2e model's
// head size 32) is asked for whole, its V left to the hardware. Each measured best for its size (docs/benchmarks.md;
// asking for a whole K of a page or more kept the fill buffers full and stalled).
inline void ask_next_block(const AttendArgs& a, int64_t c, int64_t k_bytes) {
  if (c + 1 >= a.num_blocks) return;
  if (k_bytes >= 4096) {
    kick_kv(a.kv[c + 1], k_bytes, 2);
  } else {
    prefetch_bytes(a.kv[c + 1], k_bytes);
  }
}

// v, held in a register: the compiler may not fold its load into each of the RB fused multiply-adds that read it
// (as it otherwise does, loading V once per query row: on processors that load one 512-bit vector per cycle, such as
// AMD Zen 4, P x V then waits on the loads, not the multiply-adds).
inline Vec in_register(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 x = v;
  asm("" : "+v"(x));
  return x;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 x = v;
  asm("" : "+x"(x));
  return x;
#else
  return v;
#endif
}

// Causal limit: keys of the block starting at key0 that query row r (of the request row) may see, 0 .. bs.
inline int64_t valid_keys(const AttendArgs& a, int64_t r, int64_t key0) {
  const int64_t qpos = a.first_query_pos + r % a.num_q;
  return std::min<int64_t>(a.block_size, std::max<int64_t>(0, qpos - key0 + 1));
}

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

// Online softmax per row r0 + i over a chunk's scores s [RB, nk] (row stride nk), in place: the new running max
// (a.m), the running sum (a.l), the accumulator's rescale alpha[i] and the probabilities in place of the scores. With
// pb (the AMX path; nk a multiple of 16), each probability is also rounded to bfloat16 into pb [RB, ldp] (zeros from
// nk to ldp, and for a row that sees no key of the chunk), and the running sum adds the rounded values, the ones its
// P x V multiplies.
template <int RB>
void merge_rows(const AttendArgs& a, int64_t r0, float* s, int64_t nk, float* alpha, at::BFloat16* pb, int64_t ldp) {
  for (int i = 0; i < RB; ++i) {
    const int64_t r = r0 + i;
    float* si = s + i * nk;
    const int64_t nkv = nk - nk % kW;
    Vec vmx(kNegInf);
    for (int64_t t = 0; t < nkv; t += kW) vmx = at::vec::maximum(vmx, Vec::loadu(si + t));
    float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmx);
    for (int64_t t = nkv; t < nk; ++t) mx = std::max(mx, si[t]);
    if (mx == kNegInf) {  // no key of the chunk is visible to this row
      alpha[i] = 1.f;
      if (pb != nullptr) std::fill(pb + i * ldp, pb + (i + 1) * ldp, at::BFloat16(0.f));
      continue;
    }
    const float m_new = std::max(a.m[r], mx);
    alpha[i] = std::exp(a.m[r] - m_new);  // m = -inf before the first key: alpha = 0
    const Vec vm(m_new);
    Vec sum(0.f);
    float l = 0.f;
    if (pb == nullptr) {
      for (int64_t t = 0; t < nkv; t += kW) {
        const Vec p = (Vec::loadu(si + t) - vm).exp();  // exp(-inf) = 0 for the keys past the limit
        p.store(si + t);
        sum = sum + p;
      }
      l = reduce_add(sum);
      for (int64_t t = nkv; t < nk; ++t) l += si[t] = std::exp(si[t] - m_new);
    } else {
      at::BFloat16* pi = pb + i * ldp;
      for (int64_t t = 0; t < ldp; t += 2 * kW) {  // 32 probabilities per conversion; past nk, zeros
        const Vec lo = t < nk ? (Vec::loadu(si + t) - vm).exp() : Vec(0.f);
        const Vec hi = t + kW < nk ? (Vec::loadu(si + t + kW) - vm).exp() : Vec(0.f);
        const auto rounded = at::vec::convert_from_float<at::BFloat16>(lo, hi);
        rounded.store(pi + t);
        auto [rlo, rhi] = at::vec::convert_to_float<at::BFloat16>(rounded);
        sum = sum + rlo + rhi;
      }
      l = reduce_add(sum);
    }
    a.l[r] = a.l[r] * alpha[i] + l;
    a.m[r] = m_new;
  }
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
  int64_t any = 0;
  for (int i = 0; i < RB; ++i)
    for (int64_t c = 0; c < cb; ++c) any += valid[i * cb + c] = valid_keys(a, r0 + i, a.block_pos[c0 + c] * bs);
  if (any == 0) return;  // a prefill row group before this chunk: nothing to merge
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
  if (cb * bs * d * static_cast<int64_t>(sizeof(T)) > kChunkVInL1) {
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
    // The chunk's V fits in L1 (small heads): two vectors of the head at a time (2 x RB independent chains of fused
    // multiply-adds; one vector's RB chains waited on the adds' latency) over the whole chunk, the accumulators loaded
    // and stored once per chunk instead of once per block.
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

#if defined(CPU_CAPABILITY_AVX512)
// ---- bfloat16 on AMX: both products as tile multiplies (tdpbf16ps: bfloat16 pairs summed into float32) ----
// Scores as S^T = K Q^T: the block's K is the A operand as stored (16 keys x 32 head values per tile row, no copy),
// the query rows, packed once per chunk in AMX's pair layout (VNNI), the B operand. P x V as O = P V: V is the B
// operand as stored too (16 keys x 32 head values, which AMX reads as 16 pairs of head values), and P, rounded to
// bfloat16 (as ATen's CPU flash attention and vLLM's CPU_ATTN AMX path round it), the A operand spread over the pairs
// ((p, 0) for the even head values, (0, p) for the odd ones; chunk_rows_amx). Copying V into the pair layout instead
// (two keys' values of one head value side by side, half the multiplies) measured slower: the copy cost more than
// the tile work it saved (docs/benchmarks.md). One consequence: a non-finite value in V also
// reaches the other head value of its pair (its 0 x inf), where the AVX-512 and ATen paths keep it to its own head
// value. Query rows are multiplied kAmxRows at a time, fewer padded with zeros. Used for bfloat16 KV when
// amx_ready(), the head size is a multiple of 32 and the block size of 16 (use_amx); the tile registers are
// configured per attend call.

constexpr int kAmxRows = 4;  // query rows per tile multiply: the M of P x V, the N of the scores

// The AMX instructions as inline assembly (AT&T operand order), with the memory effects the compiler must see: GCC
// 12's _tile_loadconfig declares only 8 bytes of its 64-byte operand as read (the other stores of the config were
// dropped as dead: ldtilecfg then faulted) and its _tile_loadd no memory read, so a load could pass the stores that
// fill the operand.
#define AKV_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define AKV_TILE_STORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define AKV_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::: "memory")
#define AKV_TILE_DPBF16PS(dst, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #dst ::: "memory")

struct TileConfig {  // the 64-byte operand of ldtilecfg, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile register
  uint8_t rows[16] = {};
};

void amx_configure() {
  TileConfig c;
  const auto set = [&c](int t, int rows, int colsb) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = static_cast<uint16_t>(colsb);
  };
  set(0, 16, 4 * kAmxRows);  // scores: S^T of 16 keys x kAmxRows rows, float32
  set(1, 16, 4 * kAmxRows);  // scores of the next 16 keys
  set(2, 16, 4 * kAmxRows);  // Q: 16 pairs of head values x kAmxRows rows x 2, bfloat16
  set(3, 16, 64);            // K: 16 keys x 32 head values, bfloat16; in P x V, V: the same, read as 16 "pairs"
  set(4, 16, 64);            // the next 16 keys / 32 head values
  set(5, 2 * kAmxRows, 64);  // O: the even head values of 32 (rows 0-3), then the odd ones (rows 4-7), float32
  set(6, 2 * kAmxRows, 64);  // O of the next 32 head values
  set(7, 2 * kAmxRows, 64);  // P of 16 keys spread over pairs: rows 0-3 (p, 0) per key, rows 4-7 (0, p), bfloat16
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// Every attend call configures the tiles and releases them at its end (as ATen's brgemm users call brgemm_release),
// so no other AMX user on the thread (oneDNN in a bfloat16 GEMM) finds or leaves a configuration it did not make.
void amx_release() { asm volatile("tilerelease" ::: "memory"); }

// Per-thread scratch of the AMX path; sizes for chunks of up to nk32 keys (a multiple of 32) and head size d.
struct AmxScratch {
  std::vector<at::BFloat16> qpack, pb, ps, vz;
  std::vector<float> st, ot;
  std::vector<const at::BFloat16*> gv;
  void reserve(int64_t nk32, int64_t d) {
    qpack.resize(d * kAmxRows);             // [d / 32][16 pairs][kAmxRows][2]
    pb.resize(kAmxRows * nk32);             // [kAmxRows][nk32]: P rounded to bfloat16
    ps.resize(2 * kAmxRows * 2 * nk32);     // [2 * kAmxRows][2 * nk32]: P spread over pairs (chunk_rows_amx)
    vz.resize(nk32 / 16 * 16 * d);          // [groups][16][d]: V of partly seen groups of 16 keys, zeros past them
    gv.resize(nk32 / 16);                   // V of each group of 16 keys: in the pool, or in vz
    st.resize(nk32 * kAmxRows);    // [nk32 keys][kAmxRows]: S^T
    ot.resize(d / 32 * 2 * kAmxRows * 16);  // [d / 32][2 * kAmxRows][16]: O, even then odd head values
  }
};

// O's tile rows back in head order: even[n] is head value 2n of 32, odd[n] head value 2n + 1.
inline void interleave_o(__m512 even, __m512 odd, __m512& first, __m512& second) {
  alignas(64) static constexpr int32_t kFirst[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static constexpr int32_t kSecond[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  first = _mm512_permutex2var_ps(even, _mm512_load_si512(kFirst), odd);
  second = _mm512_permutex2var_ps(even, _mm512_load_si512(kSecond), odd);
}

// chunk_rows for bfloat16 KV on AMX (same chunking, causal limits and online softmax; see the section comment).
template <int RB>
void chunk_rows_amx(const AttendArgs& a, int64_t r0, int64_t c0, int64_t cb, float* s, int64_t* valid, AmxScratch& w) {
  using BF = at::BFloat16;
  const int64_t bs = a.block_size, d = a.head_size, nk = cb * bs, nk32 = (nk + 31) / 32 * 32, pairs = nk32 / 2;
  const float scale = static_cast<float>(a.scale);
  int64_t any = 0;
  for (int i = 0; i < RB; ++i)
    for (int64_t c = 0; c < cb; ++c) any += valid[i * cb + c] = valid_keys(a, r0 + i, a.block_pos[c0 + c] * bs);
  if (any == 0) return;  // a prefill row group before this chunk: nothing to merge
  // The rows' query in the pair layout (rows past RB zero): B operand of the scores, 32 head values per tile.
  BF* qp = w.qpack.data();
  for (int64_t ks = 0; ks < d / 32; ++ks)
    for (int64_t p = 0; p < 16; ++p)
      for (int n = 0; n < kAmxRows; ++n)
        for (int e = 0; e < 2; ++e)
          qp[((ks * 16 + p) * kAmxRows + n) * 2 + e] = n < RB ? a.q_bf16[(r0 + n) * d + ks * 32 + 2 * p + e] : BF(0.f);
  int64_t vmax[256];  // keys of each block some row sees (chunk_blocks <= 256: use_amx)
  for (int64_t c = 0; c < cb; ++c) {
    vmax[c] = 0;
    for (int i = 0; i < RB; ++i) vmax[c] = std::max(vmax[c], valid[i * cb + c]);
  }
  // S^T, 16 keys per tile and two tiles at a time (independent accumulation chains sharing each load of Q); a group of
  // 16 keys no row sees is not multiplied (its scores become -inf below).
  float* st = w.st.data();
  const auto seen = [&](int64_t g) { return g * 16 % bs < vmax[g * 16 / bs]; };
  const auto key_row = [&](int64_t g) { return static_cast<const BF*>(a.kv[c0 + g * 16 / bs]) + (g * 16 % bs) * d; };
  for (int64_t g = 0; g < nk / 16; g += 2) {
    // While a block is scored, the next one (ask_next_block); on AMX a K of a page or more also has the first 4 lines
    // of the block after's K and V asked for (docs/benchmarks.md).
    const int64_t k_bytes = bs * d * 2;
    for (int64_t h = g; h < std::min(g + 2, nk / 16); ++h) {
      if (h * 16 % bs != 0) continue;
      const int64_t c = c0 + h * 16 / bs;
      ask_next_block(a, c, k_bytes);
      if (k_bytes >= 4096 && c + 2 < a.num_blocks) kick_kv(a.kv[c + 2], k_bytes, 4);
    }
    const bool s0 = seen(g), s1 = g + 1 < nk / 16 && seen(g + 1);
    if (!s0 && !s1) continue;
    AKV_TILE_ZERO(0);
    AKV_TILE_ZERO(1);
    const BF* k0 = key_row(g);
    const BF* k1 = s1 ? key_row(g + 1) : nullptr;
    for (int64_t ks = 0; ks < d / 32; ++ks) {
      AKV_TILE_LOAD(2, qp + ks * 16 * kAmxRows * 2, 4 * kAmxRows);
      if (s0) {
        AKV_TILE_LOAD(3, k0 + ks * 32, d * 2);
        AKV_TILE_DPBF16PS(0, 3, 2);
      }
      if (s1) {
        AKV_TILE_LOAD(4, k1 + ks * 32, d * 2);
        AKV_TILE_DPBF16PS(1, 4, 2);
      }
    }
    AKV_TILE_STORE(0, st + g * 16 * kAmxRows, 4 * kAmxRows);
    if (g + 1 < nk / 16) AKV_TILE_STORE(1, st + (g + 1) * 16 * kAmxRows, 4 * kAmxRows);
  }
  // S^T to the rows' scores (16 keys x 4 rows -> 4 rows x 16 keys), scaled; keys past a row's limit become -inf.
  static_assert(kAmxRows == 4, "the transposition below is for 4 rows");
  alignas(64) static constexpr int32_t kRowOf[4][16] = {
      {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60},
      {1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61},
      {2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62},
      {3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63}};
  const __m512 vscale = _mm512_set1_ps(scale), vninf = _mm512_set1_ps(kNegInf);
  for (int64_t g = 0; g < nk / 16; ++g) {
    const int64_t c = g * 16 / bs, t0 = g * 16 % bs;
    const float* sg = st + g * 16 * kAmxRows;
    const __m512 z0 = _mm512_loadu_ps(sg), z1 = _mm512_loadu_ps(sg + 16), z2 = _mm512_loadu_ps(sg + 32),
                 z3 = _mm512_loadu_ps(sg + 48);
    for (int i = 0; i < RB; ++i) {
      const int64_t n = std::clamp<int64_t>(valid[i * cb + c] - t0, 0, 16);
      float* si = s + i * nk + g * 16;
      if (n == 0) {
        _mm512_storeu_ps(si, vninf);
        continue;
      }
      const __m512i idx = _mm512_load_si512(kRowOf[i]);
      // lanes 0-7 from z0/z1 (keys 0-7), lanes 8-15 from z2/z3 (keys 8-15), each via a two-source permute
      const __m512 lo = _mm512_permutex2var_ps(z0, idx, z1);
      const __m512 hi = _mm512_permutex2var_ps(z2, idx, z3);
      const __m512 row = _mm512_mask_blend_ps(0xFF00, lo, hi);
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
      _mm512_storeu_ps(si, _mm512_mask_blend_ps(keep, vninf, _mm512_mul_ps(row, vscale)));
    }
  }
  float alpha[RB];
  merge_rows<RB>(a, r0, s, nk, alpha, w.pb.data(), nk32);
  // acc = acc * alpha + P V, with V read in place: a group of 16 keys' V (16 rows of head values, row stride d) is
  // the B operand as stored, AMX taking each row's 32 head values as 16 pairs. A row of P whose pairs are (p_t, 0)
  // then gives the even head values of the 32, and one with (0, p_t) the odd ones, so P goes in spread over pairs
  // (rows 0-3 and 4-7 of one tile), and each product's tile holds the even head values of four query rows over the
  // odd ones. A group no row sees is skipped; one that rows see in part is copied with zeros past the keys seen (its
  // other slots may hold anything, and their zero probabilities must not meet a non-finite value).
  const int64_t groups = nk / 16, ldp = 2 * nk32;  // ps row stride (bfloat16 values)
  BF* ps = w.ps.data();
  const BF* pb = w.pb.data();
  for (int i = 0; i < kAmxRows; ++i) {
    uint32_t* even = reinterpret_cast<uint32_t*>(ps + i * ldp);
    uint32_t* odd = reinterpret_cast<uint32_t*>(ps + (kAmxRows + i) * ldp);
    for (int64_t t = 0; t < nk; t += 16) {
      const __m256i p16 = i < RB ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + i * nk32 + t))
                                 : _mm256_setzero_si256();
      const __m512i x = _mm512_cvtepu16_epi32(p16);
      _mm512_storeu_si512(even + t, x);                        // (p_t, 0): p_t in the low half of each 32 bits
      _mm512_storeu_si512(odd + t, _mm512_slli_epi32(x, 16));  // (0, p_t)
    }
  }
  const BF** gv = w.gv.data();  // V of each group of 16 keys: in the pool, its zero-padded copy in w.vz, or null
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c = g * 16 / bs, t0 = g * 16 % bs, seen_keys = std::clamp<int64_t>(vmax[c] - t0, 0, 16);
    const BF* v = static_cast<const BF*>(a.kv[c0 + c]) + (bs + t0) * d;
    if (seen_keys == 0) {
      gv[g] = nullptr;
    } else if (seen_keys < 16) {
      BF* z = w.vz.data() + g * 16 * d;
      std::copy(v, v + seen_keys * d, z);
      std::fill(z + seen_keys * d, z + 16 * d, BF(0.f));
      gv[g] = z;
    } else {
      gv[g] = v;
    }
  }
  float* ot = w.ot.data();
  constexpr int kO = 2 * kAmxRows * 16;  // floats per O tile
  std::fill(ot, ot + d / 32 * kO, 0.f);
  for (int64_t js = 0; js < d / 32; js += 2) {  // two tiles of 32 head values
    const bool two = js + 1 < d / 32;
    AKV_TILE_LOAD(5, ot + js * kO, 64);
    if (two) AKV_TILE_LOAD(6, ot + (js + 1) * kO, 64);
    for (int64_t g = 0; g < groups; ++g) {
      if (gv[g] == nullptr) continue;
      AKV_TILE_LOAD(7, ps + g * 32, ldp * 2);
      AKV_TILE_LOAD(3, gv[g] + js * 32, d * 2);
      AKV_TILE_DPBF16PS(5, 7, 3);
      if (two) {
        AKV_TILE_LOAD(4, gv[g] + (js + 1) * 32, d * 2);
        AKV_TILE_DPBF16PS(6, 7, 4);
      }
    }
    AKV_TILE_STORE(5, ot + js * kO, 64);
    if (two) AKV_TILE_STORE(6, ot + (js + 1) * kO, 64);
  }
  for (int64_t js = 0; js < d / 32; ++js) {
    for (int i = 0; i < RB; ++i) {
      float* acc = a.acc + (r0 + i) * d + js * 32;
      const Vec al(alpha[i]);
      __m512 first, second;
      interleave_o(_mm512_loadu_ps(ot + js * kO + i * 16), _mm512_loadu_ps(ot + js * kO + (kAmxRows + i) * 16),
                   first, second);
      (Vec::loadu(acc) * al + Vec(first)).store(acc);
      (Vec::loadu(acc + kW) * al + Vec(second)).store(acc + kW);
    }
  }
}

// Whether this call runs on AMX (see the section comment).
bool use_amx(const AttendArgs& a) {
  return a.dtype == at::kBFloat16 && a.q_bf16 != nullptr && a.head_size % 32 == 0 && a.block_size % 16 == 0 &&
         a.chunk_blocks <= 256 && amx_ready();
}

void attend_amx(const AttendArgs& a) {
  const int64_t bs = a.block_size, d = a.head_size, cmax = std::max<int64_t>(1, a.chunk_blocks);
  thread_local std::vector<float> s;
  thread_local std::vector<int64_t> valid;
  thread_local AmxScratch w;
  s.resize(kAmxRows * cmax * bs);
  valid.resize(kAmxRows * cmax);
  w.reserve((cmax * bs + 31) / 32 * 32, d);
  amx_configure();
  for (int64_t c0 = 0; c0 < a.num_blocks; c0 += cmax) {
    const int64_t cb = std::min(cmax, a.num_blocks - c0);
    int64_t r0 = 0;
    for (; r0 + kAmxRows <= a.rows; r0 += kAmxRows) chunk_rows_amx<kAmxRows>(a, r0, c0, cb, s.data(), valid.data(), w);
    switch (a.rows - r0) {
      case 3: chunk_rows_amx<3>(a, r0, c0, cb, s.data(), valid.data(), w); break;
      case 2: chunk_rows_amx<2>(a, r0, c0, cb, s.data(), valid.data(), w); break;
      case 1: chunk_rows_amx<1>(a, r0, c0, cb, s.data(), valid.data(), w); break;
      default: break;
    }
  }
  amx_release();
}
#endif

constexpr int kRowBlock = 4;  // query rows sharing each pass over V (a GQA group of 4 in one pass)

template <typename T>
void attend(const AttendArgs& a) {
#if defined(CPU_CAPABILITY_AVX512)
  if (std::is_same_v<T, at::BFloat16> && use_amx(a)) return attend_amx(a);
#endif
  const int64_t bs = a.block_size, d = a.head_size, cmax = std::max<int64_t>(1, a.chunk_blocks);
  thread_local std::vector<float> s;
  thread_local std::vector<int64_t> valid;
  s.resize(kRowBlock * cmax * bs);
  valid.resize(kRowBlock * cmax);
  const at::BFloat16* qb = std::is_same_v<T, at::BFloat16> && uses_bf16_query(d) ? a.q_bf16 : nullptr;
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

namespace {
// The unreduced bounds of N query heads of a KV head's group for one block over the head size's first dv values (a
// multiple of kW): out[u] = relu(q_u) * max + min(q_u, 0) * min, lane by lane. The N heads share each load of the
// block's min and max; each head sums its positive and negative parts in two vector accumulators (2N independent
// chains, instead of one chain of 2 * dv / kW dependent fused multiply-adds per head), added at the end. q rows have
// stride d.
template <int N, typename M>
inline void group_vectors(const float* qp, const float* qn, const M* mn, const M* mx, int64_t d, int64_t dv,
                          Vec* out) {
  Vec sp[N], sn[N];
  for (int u = 0; u < N; ++u) sp[u] = sn[u] = Vec(0.f);
  for (int64_t j = 0; j < dv; j += kW) {
    const Vec vmx = load_float(mx + j), vmn = load_float(mn + j);
    for (int u = 0; u < N; ++u) {
      sp[u] = at::vec::fmadd(Vec::loadu(qp + u * d + j), vmx, sp[u]);
      sn[u] = at::vec::fmadd(Vec::loadu(qn + u * d + j), vmn, sn[u]);
    }
  }
  for (int u = 0; u < N; ++u) out[u] = sp[u] + sn[u];
}

}  // namespace

namespace {
template <typename M>
void quest_scores_as(const QuestArgs& a, int64_t begin, int64_t end) {
  const int64_t kvh = a.num_kv_heads, g = a.group, d = a.head_size;
  // A block's min (and max) of every head is one run of kvh * d values at a random place (the row's block ids).
  // While a block is scored, the first 4 cache lines of the next block's two runs are asked for, and the hardware's
  // stream prefetchers fetch the rest: asking for whole runs of a page (float32 at 8 KV heads of 128) measured slower
  // than no prefetch, and no prefetch slower than this (docs/benchmarks.md).
  const int64_t kick = std::min<int64_t>(kvh * d * static_cast<int64_t>(sizeof(M)), 4 * 64);
  // Every query head's bound is kept as a vector over the head size's multiple of kW and kW heads' vectors are summed
  // by one lane_sums (a butterfly of vector additions), instead of one horizontal sum per head: 15-21% less time per
  // call (docs/benchmarks.md); a head size off the vector width adds a scalar tail per head.
  const int64_t dv = d - d % kW;
  Vec vbuf[kW];
  thread_local std::vector<float> bounds;  // [kvh * g] the block's bounds (+ kW: lane_sums writes kW at a time)
  bounds.resize(kvh * g + kW);
  for (int64_t c = begin; c < end; ++c) {
    if (c + 1 < end) {
      prefetch_bytes(static_cast<const M*>(a.key_min) + a.blocks[c + 1] * kvh * d, kick);
      prefetch_bytes(static_cast<const M*>(a.key_max) + a.blocks[c + 1] * kvh * d, kick);
    }
    const M* mn_b = static_cast<const M*>(a.key_min) + a.blocks[c] * kvh * d;
    const M* mx_b = static_cast<const M*>(a.key_max) + a.blocks[c] * kvh * d;
    // Every query head's bound of the block into bounds[h * g + u], four heads of a group at a time (they share each
    // load of the block's min and max).
    int64_t filled = 0, done = 0;
    const auto flush = [&]() {
      for (int64_t u = filled; u < kW; ++u) vbuf[u] = Vec(0.f);
      lane_sums(vbuf, bounds.data() + done);
      done += filled;
      filled = 0;
    };
    for (int64_t h = 0; h < kvh; ++h) {
      const M* mn = mn_b + h * d;
      const M* mx = mx_b + h * d;
      for (int64_t i0 = 0; i0 < g; i0 += 4) {
        const int64_t n = std::min<int64_t>(4, g - i0);
        const float* qp = a.q_pos + (h * g + i0) * d;
        const float* qn = a.q_neg + (h * g + i0) * d;
        if (filled + n > kW) flush();
        switch (n) {
          case 4: group_vectors<4>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
          case 3: group_vectors<3>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
          case 2: group_vectors<2>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
          default: group_vectors<1>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
        }
        filled += n;
      }
    }
    if (filled > 0) flush();
    for (int64_t h = 0; dv < d && h < kvh; ++h) {  // the scalar tail
      for (int64_t u = 0; u < g; ++u) {
        const float* qp = a.q_pos + (h * g + u) * d;
        const float* qn = a.q_neg + (h * g + u) * d;
        float& r = bounds[h * g + u];
        for (int64_t t = dv; t < d; ++t)
          r += qp[t] * static_cast<float>(mx_b[h * d + t]) + qn[t] * static_cast<float>(mn_b[h * d + t]);
      }
    }
    for (int64_t h = 0; h < kvh; ++h) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t u = 0; u < g; ++u) {
        // NaN (only from non-finite key metadata) ranks first, as in the ATen path's max over the group
        const float r = bounds[h * g + u];
        best = (std::isnan(r) || r > best) ? r : best;
        if (std::isnan(best)) break;
      }
      a.score[h * a.num_blocks + c] = best;
    }
  }
}
}  // namespace

void quest_scores(const QuestArgs& a, int64_t begin, int64_t end) {
  switch (a.dtype) {  // the metadata's dtype (the engine keeps it in the KV dtype)
    case at::kFloat: return quest_scores_as<float>(a, begin, end);
    case at::kBFloat16: return quest_scores_as<at::BFloat16>(a, begin, end);
    case at::kHalf: return quest_scores_as<at::Half>(a, begin, end);
    default: TORCH_CHECK_TYPE(false, "the Quest kernel reads float32, bfloat16 or float16 key metadata, got ", a.dtype);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace activekv::cpu_kernel
