// Decode attention against a KV cache (the contract: csrc/torch_bindings.cpp `decode_attention`; the kernel:
// kernels/decode_attention.py): shared argument checks and the per-backend entry points.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "ops/torch_launch.h"

namespace fused {

// The sizes of one call after validation: q [B, T, Hq, D], k_new / v_new [B, T, Hkv, D], caches [B, Hkv, S, D];
// DecodeAttentionSymGeometry has a Meta kernel's symbolic sizes (torch.export / torch.compile with dynamic shapes).
template <typename Int>
struct DecodeAttentionGeometryOf {
  Int B, T, Hq, Hkv, D, S;
};
using DecodeAttentionGeometry = DecodeAttentionGeometryOf<int64_t>;
using DecodeAttentionSymGeometry = DecodeAttentionGeometryOf<c10::SymInt>;

// Shape, dtype, device and layout checks that need no data (no host sync): ValueError (TORCH_CHECK_VALUE) for a
// wrong shape or dtype, RuntimeError for a device or layout, each naming the argument. The _symint one reads symbolic
// sizes (the Meta kernel) and guards only what the kernels need; the other runs the same checks on concrete tensors.
DecodeAttentionSymGeometry check_decode_attention_inputs_symint(const at::Tensor& q, const at::Tensor& k_cache,
                                                                const at::Tensor& v_cache, const at::Tensor& k_new,
                                                                const at::Tensor& v_new, const at::Tensor& cache_lens);
DecodeAttentionGeometry check_decode_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache, const at::Tensor& k_new,
                                                      const at::Tensor& v_new, const at::Tensor& cache_lens);

// The softmax scale: `scale`, or 1/sqrt(D).
double decode_attention_scale(const std::optional<double>& scale, int64_t D);

// The split count of the CUDA kernel for a grid of `programs` (B * Hkv * row chunks) programs over a cache of
// capacity S, key blocks of block_n, on a device with `sms` SMs: host values only (never cache_lens), so one CUDA
// graph serves every length. kernels/decode_attention.py decode_attention_split is the same rule
// (torch.ops.fused._decode_attention_split exposes this one to the test that they agree).
int64_t decode_attention_split(int64_t programs, int64_t S, int64_t block_n, int64_t sms);

// Backends: the output [B, T, Hq, D] (contiguous, q's dtype); k_new / v_new written into the caches.
at::Tensor decode_attention_cpu(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& cache_lens,
                                std::optional<double> scale);
at::Tensor decode_attention_cuda(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                 const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& cache_lens,
                                 std::optional<double> scale);

// Every variant the CUDA launcher can ask for on a device of compute capability cc (variant_check.cpp).
std::vector<VariantRequest> decode_attention_requestable_variants(int cc);

}  // namespace fused
