// The `route` op on every backend: a mask's routing, computed once and handed to every routed op of a model (their
// `routing` argument), which then route nothing (docs/design.md "Sharing the routing"). CogVLM-style models apply one
// token-type mask to every layer's QKV, dense and MLP: routing it per op repeats the same work dozens of times per
// forward pass. Layout: routed::shared_routing_size (csrc/ops/routed_gemm.h).
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/routed_gemm.h"

namespace fused {
namespace {
constexpr const char* kOp = "route";

void check_route_mask(const at::Tensor& mask) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, kOp, ": mask must be a bool tensor, got ", mask.scalar_type());
}

at::Tensor route_cuda(const at::Tensor& mask) {
  check_route_mask(mask);
  check_cuda(mask, "mask", kOp);
  c10::cuda::CUDAGuard guard(mask.device());
  return routed::route_shared(mask);
}

at::Tensor route_meta(const at::Tensor& mask) {
  check_route_mask(mask);
  // M may be symbolic (torch.compile with dynamic shapes)
  return at::empty_symint({routed::shared_routing_size(mask.sym_numel())}, mask.options().dtype(at::kInt));
}
}  // namespace

at::Tensor routing_cpu(const at::Tensor& mask, bool aligned) {
  const at::Tensor m = mask.reshape({-1});
  const int64_t M = m.numel(), count1 = m.sum().item<int64_t>(), count0 = M - count1;
  // kernels/routing.py: each expert's rows in token order, text from 0, vision from start_1; aligned: each segment
  // padded to kAlign (end = start_1 + its padded length), unaligned: none (start_1 = count_0, end = M)
  const int64_t start1 = aligned ? routed::align_up(count0) : count0;
  const int64_t end = aligned ? start1 + routed::align_up(count1) : M;
  const int64_t perm_len = routed::perm_rows(M, aligned);
  at::Tensor buf = at::full({aligned ? routed::routing_buffer_size(M) : routed::unaligned_routing_size(M)}, -1,
                            m.options().dtype(at::kInt));
  buf.narrow(0, 0, 5).copy_(at::tensor({int64_t{0}, start1, end, count0, count1}, at::kInt));
  at::Tensor perm = buf.narrow(0, routed::kSegSlots, perm_len);
  perm.narrow(0, 0, count0).copy_(m.logical_not().nonzero().flatten());
  perm.narrow(0, start1, count1).copy_(m.nonzero().flatten());
  return buf;
}

at::Tensor route_cpu(const at::Tensor& mask) {
  check_route_mask(mask);
  const int64_t M = mask.numel();
  at::Tensor buf = at::full({routed::shared_routing_size(M)}, -1, mask.options().dtype(at::kInt));
  buf.narrow(0, 0, routed::routing_buffer_size(M)).copy_(routing_cpu(mask, /*aligned=*/true));
  buf.narrow(0, routed::unaligned_section(M), routed::unaligned_routing_size(M))
      .copy_(routing_cpu(mask, /*aligned=*/false));
  return buf;
}

void check_routing_of_mask(const at::Tensor& routing, const at::Tensor& mask, const char* op) {
  const at::Tensor m = mask.reshape({-1});
  const int64_t M = m.numel();
  // The entries the kernels read: seg and perm of each routing the buffer holds (linear_dual_forward's CUDA routing
  // leaves the others unwritten).
  const auto used = [&](const at::Tensor& t, bool aligned) {
    const int64_t off = aligned ? 0 : routed::unaligned_section(M);
    const int64_t perm = routed::perm_rows(M, aligned);
    return at::cat({t.narrow(0, off, 5), t.narrow(0, off + routed::kSegSlots, perm)});
  };
  const bool shared = routing.numel() == routed::shared_routing_size(M);
  const at::Tensor want = shared ? route_cpu(m) : routing_cpu(m, /*aligned=*/true);
  TORCH_CHECK(used(routing, true).equal(used(want, true)) &&
                  (!shared || used(routing, false).equal(used(want, false))),
              op, ": routing is not the routing of this mask (pass what fused.route(mask)",
              shared ? "" : " or linear_dual_forward", " returned for the same mask)");
}

}  // namespace fused

TORCH_LIBRARY_IMPL(fused, CPU, m) { m.impl("route", fused::route_cpu); }
TORCH_LIBRARY_IMPL(fused, CUDA, m) { m.impl("route", fused::route_cuda); }
TORCH_LIBRARY_IMPL(fused, Meta, m) { m.impl("route", fused::route_meta); }
