// CUDA implementation of decode_attention: validates (no host sync), then launches the AOT-compiled
// kernels/decode_attention.py: decode_attention_kernel, and decode_attention_combine_kernel where the cache length is
// split over several programs per KV head. Nothing here reads device memory or depends on cache_lens' values, so a
// call is CUDA-graph capturable and one captured graph serves every length.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernel_decls.h"  // generated: build/aot (aot/cpp_decls.py)
#include "ops/decode_attention.h"
#include "ops/torch_launch.h"
#include "runtime/kernel_configs.h"
#include "runtime/launcher.h"

namespace fused {
namespace {

constexpr const char* kKernel = "decode_attention_kernel";

// The variant keys (aot/manifest.py _decode_attention_variants).
std::string attention_key(const KernelConfig& cfg, const char* dtype) {
  return std::string("cfg=") + cfg.cfg + ",dtype=" + dtype;
}
// The attention kernel is compiled only with its divisibility hints (aot/manifest.py _decode_attention_variants):
// 16-byte aligned tensors whose strides are multiples of kHint elements. A stride of a size-1 dimension never
// moves the address, so it is passed as 0.
int64_t stride_arg(const at::Tensor& t, int d) { return t.size(d) == 1 ? 0 : t.stride(d); }
bool hinted(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (stride_arg(t, d) % routed::kHint != 0) return false;
  return true;
}
// q, k_new, v_new (T <= 16 rows per sequence) that the kernel cannot take are copied into tensors that it can.
at::Tensor hinted_copy(const at::Tensor& t) { return hinted(t) ? t : t.clone(at::MemoryFormat::Contiguous); }
std::string combine_key(const char* dtype) {
  return "cols=" + std::to_string(attention::kCombineCols) + ",dtype=" + dtype +
         ",splits=" + std::to_string(attention::kCombineMaxSplits);
}

}  // namespace

at::Tensor decode_attention_cuda(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                 const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& cache_lens,
                                 std::optional<double> scale) {
  TORCH_CHECK(q.is_cuda(), "decode_attention: q must be a CUDA tensor, got one on ", q.device());
  const DecodeAttentionGeometry g = check_decode_attention_inputs(q, k_cache, v_cache, k_new, v_new, cache_lens);
  TORCH_CHECK_VALUE(g.D == 64 || g.D == 128 || g.D == 256,
                    "decode_attention: the head dim must be 64, 128 or 256 on CUDA (the compiled kernels), got ", g.D);
  const char* dtype = variant_dtype(q.scalar_type());  // bf16 or fp16 (checked)
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({g.B, g.T, g.Hq, g.D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (g.B == 0) return out;
  for (const auto& [cache, name] : {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}})
    TORCH_CHECK_VALUE(hinted(*cache), "decode_attention: on CUDA ", name, " must start 16-byte aligned with strides that "
                      "are multiples of ", routed::kHint, " elements (any cache torch allocates; a view of one that "
                      "starts inside a row does not); got data_ptr % 16 = ",
                      reinterpret_cast<uintptr_t>(cache->data_ptr()) % 16, ", strides ", cache->strides());
  const at::Tensor qh = hinted_copy(q), knh = hinted_copy(k_new), vnh = hinted_copy(v_new);

  const int device = q.get_device();
  const int64_t G = g.Hq / g.Hkv, R = G * g.T;  // query rows per KV head
  // The config (BLOCK_M x BLOCK_N x HEAD_D, warps, stages) from the table of the device's architecture: m is the
  // query rows of a KV head, the shape class the head dim (aot/configs/sm<arch>.json).
  const KernelConfig& cfg = kernel_config(kKernel, "half", device_capability(device), R, g.D, -1);
  TORCH_CHECK(cfg.block[2] == g.D, "decode_attention: the config table's entry for head dim ", g.D, " (", cfg.cfg,
              ") is compiled for head dim ", cfg.block[2]);
  const int64_t chunks = cdiv(R, cfg.block[0]);
  TORCH_CHECK(chunks <= 65535 && R <= 65535, "decode_attention: too many query rows per KV head (", R, ")");
  const int64_t n_split = decode_attention_split(g.B * g.Hkv * chunks, g.S, cfg.block[1], device_sm_count(device));
  TORCH_CHECK(g.B * g.Hkv <= std::numeric_limits<int32_t>::max() / attention::kCombineMaxSplits,
              "decode_attention: too many sequences x KV heads (", g.B * g.Hkv, ") for one launch");

  // The splits' fp32 partials, from torch's caching allocator (graph-safe): acc [B * Hkv, n_split, R, D], then
  // (m, l) [B * Hkv, n_split, R, 2]. Every entry the combine reads is written by the attention kernel first.
  const int64_t parts = g.B * g.Hkv * n_split * R;
  at::Tensor ws = n_split > 1 ? at::empty({parts * (g.D + 2)}, q.options().dtype(at::kFloat)) : out;
  void* ws_p = ws.data_ptr();
  void* ml_p = n_split > 1 ? static_cast<void*>(static_cast<float*>(ws_p) + parts * g.D) : ws_p;

  kernel_args::decode_attention_kernel args{
      .q_ptr = qh.data_ptr(), .k_new_ptr = knh.data_ptr(), .v_new_ptr = vnh.data_ptr(),
      .k_cache_ptr = k_cache.data_ptr(), .v_cache_ptr = v_cache.data_ptr(), .lens_ptr = cache_lens.data_ptr(),
      .out_ptr = out.data_ptr(), .ws_ptr = ws_p, .ml_ptr = ml_p, .T = g.T, .HKV = g.Hkv, .G = G, .S = g.S,
      .n_split = n_split, .scale = static_cast<float>(decode_attention_scale(scale, g.D)),
      .sq_b = stride_arg(qh, 0), .sq_t = stride_arg(qh, 1), .sq_h = stride_arg(qh, 2),
      .skn_b = stride_arg(knh, 0), .skn_t = stride_arg(knh, 1), .skn_h = stride_arg(knh, 2),
      .svn_b = stride_arg(vnh, 0), .svn_t = stride_arg(vnh, 1), .svn_h = stride_arg(vnh, 2),
      .skc_b = stride_arg(k_cache, 0), .skc_h = stride_arg(k_cache, 1), .skc_s = stride_arg(k_cache, 2),
      .svc_b = stride_arg(v_cache, 0), .svc_h = stride_arg(v_cache, 1), .svc_s = stride_arg(v_cache, 2)};
  launch_on_current_stream(std::move(args), attention_key(cfg, dtype),
                           Grid{static_cast<uint32_t>(g.B * g.Hkv), static_cast<uint32_t>(n_split),
                                static_cast<uint32_t>(chunks)},
                           q);
  if (n_split > 1) {
    kernel_args::decode_attention_combine_kernel comb{.ws_ptr = ws_p, .ml_ptr = ml_p, .out_ptr = out.data_ptr(),
                                                      .T = g.T, .HKV = g.Hkv, .G = G, .D = g.D, .n_split = n_split};
    launch_on_current_stream(std::move(comb), combine_key(dtype),
                             Grid{static_cast<uint32_t>(g.B * g.Hkv), static_cast<uint32_t>(R),
                                  static_cast<uint32_t>(g.D / attention::kCombineCols)},
                             q);
  }
  return out;
}

std::vector<VariantRequest> decode_attention_requestable_variants(int cc) {
  std::vector<VariantRequest> out;
  for (size_t i = 0; i < kNumConfigs; ++i) {  // every bucket of the table that serves cc
    const KernelConfig& cfg = kConfigs[i];
    if (std::string(cfg.kernel) != kKernel || cfg.arch != table_arch(cc)) continue;
    for (at::ScalarType t : {at::kBFloat16, at::kHalf}) out.push_back({kKernel, attention_key(cfg, variant_dtype(t))});
  }
  if (!out.empty())
    for (at::ScalarType t : {at::kBFloat16, at::kHalf})
      out.push_back({"decode_attention_combine_kernel", combine_key(variant_dtype(t))});
  return out;
}

}  // namespace fused

// The op's kernel on this backend, registered here (the schema: csrc/torch_bindings.cpp).
TORCH_LIBRARY_IMPL(fused, CUDA, m) { m.impl("decode_attention", fused::decode_attention_cuda); }
