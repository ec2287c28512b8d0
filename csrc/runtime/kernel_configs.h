// Run-time choice of a kernel's block config: a lookup in the bucket table that aot/compile.py generates from
// aot/configs/sm<arch>.json. Framework-free. The cost is one hash lookup and a scan of a few buckets (no search,
// no allocation): see docs/perf.md "Kernel configs and tuning".
#pragma once
#include <cstdint>
#include <string>

#include "runtime/kernel_table.h"

namespace fused {

// The architecture whose cubins (and so whose config table) a device of compute capability `cc` runs, mirroring
// the launcher's image choice: the highest built architecture of the same major version not above cc, else the
// lowest built one if not above cc (its PTX), else -1 (no image can run).
int table_arch(int cc);

// The bucket of (kernel, family) for m rows of a GEMM with n output columns and reduction length k (the grad-weight
// kernels: the weight's [n, k]; aot/config_table.py) on a device of compute capability cc: the first bucket whose
// shape class admits n and k and whose max_m admits m. n or k negative: unknown, only the general class (no bound)
// admits it (every n and k with FUSED_SHAPE_CLASSES=0 in the environment). wt: the linear GEMMs' orientation, 1 the
// grad-input (W transposed), 0 the forward, -1 unknown (only classes of either orientation admit it). nullptr when the
// table of that architecture has no such entry (e.g. a TMA kernel off sm_90, or a family the kernel lacks).
const KernelConfig* find_config(const char* kernel, const char* family, int cc, int64_t m, int64_t n, int64_t k,
                                int wt = -1);

// Whether the bucket turns an alternative-design kernel off for its m ("off": true in the table; cfg "off").
inline bool config_off(const KernelConfig& c) { return c.cfg[0] == 'o' && std::string(c.cfg) == "off"; }

// The same, but a missing entry throws std::invalid_argument naming the kernel, family and architecture.
const KernelConfig& kernel_config(const char* kernel, const char* family, int cc, int64_t m, int64_t n, int64_t k,
                                  int wt = -1);

// Mean nanoseconds per find_config call over `iters` calls (benchmarks/bench_config_lookup.py).
double time_config_lookups(int64_t iters);

}  // namespace fused
