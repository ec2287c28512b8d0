// The check that every variant a launcher can ask for was compiled: the launchers list what they can ask for (from
// their own key functions and flag lists: routed::requestable_variants, rope_requestable_variants), and this compares
// that with the compiled table (build/aot/kernels_gen.cpp, from aot/manifest.py) for every architecture the build
// targets. setup.py runs it right after building the extension and fails the build on any gap; the CPU tests run it
// too (tests/test_variant_check.py). So at run time "no compiled variant" can only mean a device the build did not
// target.
#include <torch/library.h>

#include <string>
#include <vector>

#include "ops/decode_attention.h"
#include "ops/rms_norm.h"
#include "ops/rope.h"
#include "ops/routed_gemm.h"
#include "runtime/kernel_table.h"

namespace {

// "sm_<arch> <kernel>: <key>" for every variant the launchers can ask for on a built architecture; only_missing:
// those of them that this build did not compile for that architecture.
std::vector<std::string> variants(bool only_missing) {
  std::vector<std::string> out;
  for (size_t i = 0; i < fused::kNumArchs; ++i) {
    const int arch = fused::kArchs[i];
    std::vector<fused::VariantRequest> asked = fused::routed::requestable_variants(arch);
    for (auto& v : fused::rope_requestable_variants(arch)) asked.push_back(std::move(v));
    for (auto& v : fused::decode_attention_requestable_variants(arch)) asked.push_back(std::move(v));
    for (auto& v : fused::rms_norm_requestable_variants(arch)) asked.push_back(std::move(v));
    for (const auto& v : asked)
      if (!only_missing || !fused::has_variant(v.kernel.c_str(), v.key, arch))
        out.push_back("sm_" + std::to_string(arch) + " " + v.kernel + ": " + v.key);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CompositeImplicitAutograd, m) {
  m.impl("_requestable_variants", []() { return variants(/*only_missing=*/false); });
  m.impl("_missing_variants", []() { return variants(/*only_missing=*/true); });
}
