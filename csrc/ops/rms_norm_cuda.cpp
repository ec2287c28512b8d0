// CUDA implementation of rms_norm: validates, then launches the AOT-compiled kernels/rms_norm.py:rms_norm_kernel, one
// program per row. No host sync: CUDA-graph capturable.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "kernel_decls.h"  // generated: build/aot (aot/cpp_decls.py)
#include "ops/rms_norm.h"
#include "runtime/launcher.h"

namespace fused {
namespace {

constexpr const char* kKernel = "rms_norm_kernel";

// The variant key (aot/manifest.py _rms_norm_variants); the runtime picks the aligned variant or its generic twin.
std::string rms_norm_key(const char* dtype) { return "block=" + std::to_string(rms::kBlock) + ",dtype=" + dtype; }

}  // namespace

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cuda(), "rms_norm: x must be a CUDA tensor, got one on ", x.device());
  check_rms_norm_inputs(x, weight, eps);
  const char* dtype = variant_dtype(x.scalar_type());
  TORCH_CHECK_VALUE(dtype, "rms_norm: unsupported dtype ", x.scalar_type(), " on CUDA (float32, float16, bfloat16)");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t N = x.size(-1);
  if (x.numel() == 0) return out;
  const int64_t M = x.numel() / N;
  TORCH_CHECK_VALUE(N <= std::numeric_limits<int32_t>::max() && M <= std::numeric_limits<int32_t>::max(),
                    "rms_norm: at most 2^31 - 1 rows of 2^31 - 1 elements on CUDA, got ", M, " x ", N);
  // Rows of one stride with contiguous columns: a view where x allows it, else a copy.
  at::Tensor rows = x.reshape({M, N});
  if (N > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  const at::Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
  kernel_args::rms_norm_kernel args{.x_ptr = rows.data_ptr(), .w_ptr = w.data_ptr(), .out_ptr = out.data_ptr(),
                                    .N = N, .stride_xm = M == 1 ? 0 : rows.stride(0), .stride_om = N,
                                    .eps = static_cast<float>(eps)};
  launch_on_current_stream(std::move(args), rms_norm_key(dtype), Grid{static_cast<uint32_t>(M), 1, 1}, x);
  return out;
}

std::vector<VariantRequest> rms_norm_requestable_variants(int cc) {
  (void)cc;  // compiled for every architecture
  std::vector<VariantRequest> out;
  for (at::ScalarType t : {at::kFloat, at::kHalf, at::kBFloat16}) out.push_back({kKernel, rms_norm_key(variant_dtype(t))});
  return out;
}

}  // namespace fused

// The op's kernel on this backend, registered here (the schema: csrc/torch_bindings.cpp).
TORCH_LIBRARY_IMPL(fused, CUDA, m) { m.impl("rms_norm", fused::rms_norm_cuda); }
