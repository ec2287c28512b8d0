// The torch side of a launch: the tensor's device, torch's current stream on it, scratch from torch's allocator.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <utility>

#include "runtime/launcher.h"

namespace fused {

// Launches on the current CUDA stream of `like`'s device (the caller holds a device guard for it).
void launch_on_current_stream(const char* kernel, const std::string& key, const KernelArgs& args, Grid grid,
                              const at::Tensor& like);

// The same with a kernel's generated argument struct (build/aot/kernel_decls.h): the kernel's name comes with it.
template <typename KernelArgStruct>
void launch_on_current_stream(KernelArgStruct args, const std::string& key, Grid grid, const at::Tensor& like) {
  launch_on_current_stream(KernelArgStruct::kernel, key, std::move(args).pack(), grid, like);
}

// Sets every element of the 4-byte-element tensor `t` (contiguous, on a CUDA device) to the bits of `value`, on the
// current stream of its device (one driver memset; the caller holds a device guard).
void fill32_on_current_stream(const at::Tensor& t, uint32_t value);

// An int32 buffer of at least n zeros that the kernels launched on the current stream of `like`'s device leave zero
// again (the stream-K GEMMs' flags: kernels/gemm_tiles.py _sk_leave). One per (device, stream), zeroed once and kept
// for the process: work on one stream runs in order, so no two kernels use it at once. While that stream captures a
// CUDA graph, a fresh zeroed one per call (memory of the graph's pool). The caller holds a device guard.
at::Tensor zeroed_flags_for_current_stream(int64_t n, const at::Tensor& like);

// A zero vector of at least n elements of like's dtype on like's device, which nothing may write: a bias that one
// expert lacks (the routed GEMMs read both experts' biases). One per (device, dtype), kept for the process, so that a
// call allocates and fills nothing (a decode step's QKV with the vision bias only launched a fill kernel per layer).
// While the current stream captures a CUDA graph and no cached one is large enough, a fresh one per call (memory of
// the graph's pool, its fill captured with it); the caller holds a device guard.
at::Tensor zeros_for_reading(int64_t n, const at::Tensor& like);

// The dtype's name in the variant keys ("fp32", "fp16", "bf16"; aot/manifest.py DTYPES), nullptr for a dtype no kernel
// is compiled for.
const char* variant_dtype(at::ScalarType t);

// A variant a launcher asks for: the kernel's name and its key ("dtype=bf16,..."; aot/manifest.py Variant.key_str).
// The launchers list every one they can ask for (routed::requestable_variants, rope_requestable_variants), which the
// build checks against the compiled table (csrc/ops/variant_check.cpp).
struct VariantRequest {
  std::string kernel, key;
  bool operator<(const VariantRequest& o) const { return std::tie(kernel, key) < std::tie(o.kernel, o.key); }
};

// Whether torch's current stream on `like`'s device is capturing a CUDA graph (no host syncs allowed then).
bool current_stream_is_capturing(const at::Tensor& like);

}  // namespace fused
