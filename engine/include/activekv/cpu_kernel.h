#pragma once
/// @file cpu_kernel.h
/// @brief Fast CPU attention kernel: online softmax over chunks of blocks (an attention tile of the geometry) read in
///        place from the pool (no gather copy), one (request row, KV head) at a time, with the GQA group's query rows
///        sharing each pass over V.
///
/// Per chunk and query row: the scores of all the chunk's keys (16 keys at a time in 16 registers, summed by one
/// butterfly of vector additions with AVX-512, no horizontal reduction per key), one online-softmax merge (Milakov &
/// Gimelshein 2018; as in FlashAttention, Dao et al. 2022: running max and sum, the accumulator rescaled once per
/// chunk), then the probabilities times V. 16 query rows or more (a prefill chunk's): chunks of <= 128 KiB of float32
/// K (512 keys at head size 64, at least 256), K and V packed once per chunk in float32 panels, scores and P x V as
/// small matrix products (6 rows x 2 x kW per pass, each value one fused multiply-add chain in one lane, keys in
/// order), no lane reductions; no result depends on its pass.
/// The arithmetic order is fixed per (row, KV head) by the chunking (chunk_blocks, or those chunks from 16 rows on).
///
/// Built once per CPU capability (DEFAULT, AVX2, AVX512) with ATen's `at::vec::Vectorized` and chosen at run time
/// (`ATEN_CPU_CAPABILITY=default|avx2|avx512` caps the choice, as it does for ATen). Float32 accumulation whatever the
/// KV dtype. bfloat16 KV on a processor with AMX (cpu_kernel_has_amx) multiplies on AMX tiles instead, for head sizes
/// that are multiples of 32 and block sizes that are multiples of 16: Q K^T with K read in place, then P V with the
/// probabilities rounded to bfloat16 (as ATen's CPU flash attention and vLLM's CPU_ATTN AMX path round them) spread
/// over AMX's pairs and V read in place (no copy); float32 accumulation, the same chunking and online softmax. The
/// arithmetic order is fixed per (row, KV head) by the chunking (chunks from the first block given), so
/// results are identical run to run, across thread counts and however the caller groups whole chunks; they are not
/// bit-identical to the ATen tile path (vectorised dot products and exp): docs/parity.md states the contract and
/// tests/test_cpu_kernel.py checks it.
#include <ATen/ATen.h>

#include <cstdint>

namespace activekv {

/// One (request row, KV head) step of the online softmax over a list of blocks.
struct AttendArgs {
  at::ScalarType dtype = at::kFloat;  ///< K/V dtype: float32, bfloat16 or float16
  int64_t block_size = 0;
  int64_t head_size = 0;
  int64_t rows = 0;           ///< query rows of this KV head: group_size * num_q_tokens (row = g * num_q + i); from
                              ///< 16 rows on, the matrix-product scorer
  int64_t num_q = 0;          ///< query tokens of the request row
  int64_t first_query_pos = 0;  ///< position of query token 0; token i sits at first_query_pos + i (causal limit)
  double scale = 1.0;         ///< softmax scale, applied to q . k
  const float* q = nullptr;   ///< [rows, head_size] float32
  /// [rows, head_size] q rounded to bfloat16, read only with bfloat16 KV where cpu_kernel_uses_bf16_query(head_size):
  /// K is scored against it with AVX512-BF16 dot products. Elsewhere K is widened to float32 and scored against q, as
  /// for the other dtypes, and this may be null
  const at::BFloat16* q_bf16 = nullptr;
  int64_t num_blocks = 0;
  int64_t chunk_blocks = 1;  ///< blocks per online-softmax merge (the geometry's tile_blocks); the last may be short
  const void* const* kv = nullptr;  ///< [num_blocks] each -> [2, block_size, head_size] (K then V) of one block/head
  const int64_t* block_pos = nullptr;  ///< [num_blocks] position of each block in the row (keys at pos * bs + t)
  float* m = nullptr;    ///< [rows] running max (in/out)
  float* l = nullptr;    ///< [rows] running sum (in/out)
  float* acc = nullptr;  ///< [rows, head_size] rescaled accumulator (in/out)
  /// Groups of `rows` query rows the call attends to the same blocks (a prefill run's GQA group members): group g's
  /// rows start member_stride rows after group g - 1's in q, q_bf16, m, l and acc, and sit at the same positions. A
  /// prefill chunk packs each chunk of K and V once for every group; the results are those of one call per group.
  int64_t members = 1;
  int64_t member_stride = 0;
};

/// Run the kernel of the best available capability (any block_size and head_size; vectorised for multiples of the
/// vector width, with scalar tails otherwise).
void attend_blocks_cpu(const AttendArgs& args);

/// Compressed mode's native scoring: the Quest bound (Tang et al., ICML 2024) of a decode row's candidate blocks for
/// every KV head, read in place from the layer's key metadata (no gather copy), the blocks split over ATen's threads.
/// score[h, c] = max over the GQA group's query heads i of sum_d (relu(q_i,d) * max_d + min(q_i,d, 0) * min_d), the
/// same bound as the ATen path (selection.cpp quest_scores) summed in a different order (vectorised fused
/// multiply-adds): equal to it within float32 rounding, identical run to run and for any thread count.
struct QuestArgs {
  int64_t num_kv_heads = 0;
  int64_t group = 0;            ///< query heads per KV head
  int64_t head_size = 0;
  const float* q_pos = nullptr;  ///< [num_kv_heads * group, head_size] float32, relu(q)
  const float* q_neg = nullptr;  ///< [num_kv_heads * group, head_size] float32, min(q, 0)
  at::ScalarType dtype = at::kFloat;  ///< of key_min / key_max: float32, bfloat16 or float16 (widened exactly)
  const void* key_min = nullptr;  ///< [host_blocks, num_kv_heads, head_size] contiguous
  const void* key_max = nullptr;  ///< same shape and dtype as key_min
  const int64_t* blocks = nullptr;  ///< [num_blocks] block ids (rows of key_min / key_max)
  int64_t num_blocks = 0;
  float* score = nullptr;  ///< [num_kv_heads, num_blocks] float32 (out)
};

/// Score the blocks [begin, end) of `args` with the best available capability (one thread; see quest_scores).
void quest_scores_cpu(const QuestArgs& args, int64_t begin, int64_t end);

/// The capability attend_blocks_cpu uses: "avx512", "avx2" or "default".
const char* cpu_kernel_capability();

/// Whether attend_blocks_cpu reads AttendArgs::q_bf16 for bfloat16 KV of this head size: the capability in use is
/// AVX512, the processor has AVX512-BF16 and head_size is a multiple of 16. When false the kernel never reads q_bf16,
/// so a caller need not round the query to bfloat16 (it passes null).
bool cpu_kernel_uses_bf16_query(int64_t head_size);

/// Whether attend_blocks_cpu multiplies bfloat16 KV on AMX tiles (where head_size % 32 == 0 and block_size % 16 == 0):
/// the capability in use is AVX512, the processor has AMX-TILE, AMX-BF16 and AVX512-BF16, Linux grants the process
/// AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16 or later), and ACTIVEKV_CPU_AMX is not "0" (read once
/// per process: the switch to the AVX-512 path, for comparisons).
bool cpu_kernel_has_amx();

/// Distinct threads that ran `n` tasks of grain 1 through at::parallel_for inside the engine library (the call the
/// kernel and the Quest scoring make), with the caller's intra-op thread count. at::parallel_for is a header template:
/// in a library built without OpenMP it runs every range on the calling thread, so this returns 1 whatever the thread
/// count. @throws c10::ValueError if n < 1
int64_t parallel_for_threads(int64_t n);

namespace cpu_kernel {
// One definition per capability (engine/src/cpu/attend_avx.cpp, attend_amx.cpp and quest_scores.cpp compiled three
// times).
namespace DEFAULT { void attend_blocks(const AttendArgs& args); void quest_scores(const QuestArgs& args, int64_t begin, int64_t end); bool uses_bf16_query(int64_t head_size); bool has_amx(); }
namespace AVX2 { void attend_blocks(const AttendArgs& args); void quest_scores(const QuestArgs& args, int64_t begin, int64_t end); bool uses_bf16_query(int64_t head_size); bool has_amx(); }
namespace AVX512 { void attend_blocks(const AttendArgs& args); void quest_scores(const QuestArgs& args, int64_t begin, int64_t end); bool uses_bf16_query(int64_t head_size); bool has_amx(); }
}  // namespace cpu_kernel

}  // namespace activekv
