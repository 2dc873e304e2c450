// The CPU kernel's run-time dispatch (cpu_kernel.h): the processor's best capability, capped by ATEN_CPU_CAPABILITY,
// picks which build of the kernel (engine/src/cpu/, compiled per capability) every call runs.
#include <activekv/check.h>
#include <activekv/cpu_kernel.h>

#include <ATen/Parallel.h>

#include <mutex>
#include <set>
#include <thread>

#include <cstdlib>
#include <cstring>

namespace activekv {

namespace {
enum class Cap { kDefault, kAvx2, kAvx512 };

// The processor's best capability, capped by ATEN_CPU_CAPABILITY as ATen caps its own kernels.
Cap detect() {
  Cap best = Cap::kDefault;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Cap::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    best = Cap::kAvx512;
#endif
  if (const char* env = std::getenv("ATEN_CPU_CAPABILITY")) {
    if (std::strcmp(env, "default") == 0) best = Cap::kDefault;
    if (std::strcmp(env, "avx2") == 0 && best == Cap::kAvx512) best = Cap::kAvx2;
  }
  return best;
}

Cap capability() {
  static const Cap cap = detect();
  return cap;
}
}  // namespace

void attend_blocks_cpu(const AttendArgs& args) {
  switch (capability()) {
    case Cap::kAvx512: return cpu_kernel::AVX512::attend_blocks(args);
    case Cap::kAvx2: return cpu_kernel::AVX2::attend_blocks(args);
    case Cap::kDefault: return cpu_kernel::DEFAULT::attend_blocks(args);
  }
}

void quest_scores_cpu(const QuestArgs& args, int64_t begin, int64_t end) {
  switch (capability()) {
    case Cap::kAvx512: return cpu_kernel::AVX512::quest_scores(args, begin, end);
    case Cap::kAvx2: return cpu_kernel::AVX2::quest_scores(args, begin, end);
    case Cap::kDefault: return cpu_kernel::DEFAULT::quest_scores(args, begin, end);
  }
}

bool cpu_kernel_uses_bf16_query(int64_t head_size) {
  switch (capability()) {
    case Cap::kAvx512: return cpu_kernel::AVX512::uses_bf16_query(head_size);
    case Cap::kAvx2: return cpu_kernel::AVX2::uses_bf16_query(head_size);
    case Cap::kDefault: return cpu_kernel::DEFAULT::uses_bf16_query(head_size);
  }
  return false;
}

bool cpu_kernel_has_amx() {
  switch (capability()) {
    case Cap::kAvx512: return cpu_kernel::AVX512::has_amx();
    case Cap::kAvx2: return cpu_kernel::AVX2::has_amx();
    case Cap::kDefault: return cpu_kernel::DEFAULT::has_amx();
  }
  return false;
}

const char* cpu_kernel_capability() {
  switch (capability()) {
    case Cap::kAvx512: return "avx512";
    case Cap::kAvx2: return "avx2";
    case Cap::kDefault: return "default";
  }
  return "default";
}

int64_t parallel_for_threads(int64_t n) {
  AKV_CHECK_VALUE(n >= 1, "n must be >= 1, got ", n);
  std::mutex mu;
  std::set<std::thread::id> ids;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(ids.size());
}

}  // namespace activekv
