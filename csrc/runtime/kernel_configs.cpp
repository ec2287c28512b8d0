#include "runtime/kernel_configs.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fused {
namespace {

struct Slot {  // views of the table's own string literals: lookups allocate nothing
  std::string_view kernel, family;
  int arch;
  bool operator==(const Slot& o) const { return arch == o.arch && kernel == o.kernel && family == o.family; }
};
struct SlotHash {
  size_t operator()(const Slot& s) const {
    return std::hash<std::string_view>()(s.kernel) * 31 + std::hash<std::string_view>()(s.family) * 7 + s.arch;
  }
};
using Index = std::unordered_map<Slot, std::vector<const KernelConfig*>, SlotHash>;

const Index& index() {
  static const Index* idx = [] {  // thread-safe one-time build (a few dozen rows)
    auto* m = new Index();
    for (size_t i = 0; i < kNumConfigs; ++i)
      (*m)[Slot{kConfigs[i].kernel, kConfigs[i].family, kConfigs[i].arch}].push_back(&kConfigs[i]);
    return m;
  }();
  return *idx;
}

}  // namespace

int table_arch(int cc) {
  int same_major = -1;
  for (size_t i = 0; i < kNumArchs; ++i)
    if (kArchs[i] / 10 == cc / 10 && kArchs[i] <= cc && kArchs[i] > same_major) same_major = kArchs[i];
  if (same_major >= 0) return same_major;
  return (kNumArchs > 0 && kArchs[0] <= cc) ? kArchs[0] : -1;
}

namespace {
// Whether a class bound admits a size: no bound (-1) admits any, a bound admits known sizes (>= 0) up to it.
bool admits(int64_t bound, int64_t size) { return bound < 0 || (size >= 0 && size <= bound); }

// FUSED_SHAPE_CLASSES=0 (read once per process): every lookup takes the general class, as if the tables had no
// shape classes. A benchmark knob: the classes' effect measured in one build (docs/perf.md).
bool shape_classes_on() {
  static const bool on = [] {
    const char* e = std::getenv("FUSED_SHAPE_CLASSES");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}
}  // namespace

const KernelConfig* find_config(const char* kernel, const char* family, int cc, int64_t m, int64_t n, int64_t k,
                                int wt) {
  const int arch = table_arch(cc);
  if (arch < 0) return nullptr;
  auto it = index().find(Slot{kernel, family, arch});
  if (it == index().end()) return nullptr;
  if (!shape_classes_on()) n = k = wt = -1;
  for (const KernelConfig* c : it->second)  // first match, as aot/config_table.py pick
    if (admits(c->max_n, n) && admits(c->max_k, k) && (c->w_transposed < 0 || c->w_transposed == wt) &&
        admits(c->max_m, m))
      return c;
  return nullptr;  // unreachable for a validated table (it ends with the general class's open bucket)
}

const KernelConfig& kernel_config(const char* kernel, const char* family, int cc, int64_t m, int64_t n, int64_t k,
                                  int wt) {
  if (const KernelConfig* c = find_config(kernel, family, cc, m, n, k, wt)) return *c;
  const int arch = table_arch(cc);
  throw std::invalid_argument(
      std::string("fused: no kernel config for ") + kernel + " (" + family + ") on a device of compute capability " +
      std::to_string(cc) + (arch < 0 ? std::string(" (no built architecture runs on it)")
                                     : " (table of sm_" + std::to_string(arch) + ")") +
      "; this build holds " + kBuiltArchs + ". The tables are aot/configs/sm<arch>.json.");
}

double time_config_lookups(int64_t iters) {
  if (iters <= 0) throw std::invalid_argument("fused: _config_lookup_ns needs iters > 0");
  index();  // built once, outside the timing
  const auto t0 = std::chrono::steady_clock::now();
  uintptr_t sink = 0;
  for (int64_t i = 0; i < iters; ++i)
    sink += reinterpret_cast<uintptr_t>(find_config("routed_linear_tma_kernel", "half", 90, 1 + (i & 0xffff),
                                                    1024 + (i & 0x3fff), 4096));
  const auto t1 = std::chrono::steady_clock::now();
  volatile uintptr_t keep = sink;  // the loop's results are used: it cannot be optimized away
  (void)keep;
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
}

}  // namespace fused
