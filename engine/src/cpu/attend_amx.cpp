// The CPU attention kernel's bfloat16 path on AMX tiles (Intel Sapphire Rapids and later): the same chunking, causal
// limits and online softmax as attend_avx.cpp, both products as tile multiplies. Compiled once per CPU capability, with
// code only in the AVX512 build (the other builds hold nothing). See activekv/cpu_kernel.h for the contract.
#include "kernel_primitives.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace activekv::cpu_kernel {
namespace CPU_CAPABILITY {

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

namespace {

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
  const int64_t bs = a.block_size, d = a.head_size, nk = cb * bs, nk32 = (nk + 31) / 32 * 32;
  const float scale = static_cast<float>(a.scale);
  if (fill_valid<RB>(a, r0, c0, cb, valid) == 0) return;  // a prefill row group before this chunk: nothing to merge
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

}  // namespace

bool use_amx(const AttendArgs& a) {
  return a.dtype == at::kBFloat16 && a.q_bf16 != nullptr && a.head_size % 32 == 0 && a.block_size % 16 == 0 &&
         a.chunk_blocks <= 256 && amx_ready();
}

void attend_amx(const AttendArgs& a) {
  // Scratch for the call's blocks at most (a chunk spans no more), not for a tile of any size.
  const int64_t bs = a.block_size, d = a.head_size;
  const int64_t cmax = std::max<int64_t>(1, std::min(a.chunk_blocks, a.num_blocks));
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

}  // namespace CPU_CAPABILITY
}  // namespace activekv::cpu_kernel
#endif
