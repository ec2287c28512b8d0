// Autocast (torch.autocast, at::autocast) for the routed GEMM ops linear_dual and ffn. Like torch's own linear and
// matmul (autocast's "lower precision" ops), they cast their floating-point inputs to the region's autocast dtype of
// the device (bf16 or fp16) and run in it. So a module of this library runs in the precision its nn.Linear
// counterpart would inside an autocast region, and activations of the region's dtype can meet fp32 parameters
// (without autocast that is a mixed-dtype error). What autocast leaves alone, these leave alone too: float64 tensors,
// tensors on another device type, the mask. Outside an autocast region these kernels are not called.
//
// The two experts of a projection held as one [2, R, C] tensor (DualLinear, DualExpertSwiGLU: text at [0], vision at
// [1]) are cast as that one tensor and split again. The halves of the cast stay adjacent, so the kernels read them
// through one descriptor, in the forward and in the paired backward kernel (which needs gate and up at the same
// expert distance). Cast one by one, where the halves land is up to the allocator: the forward would stack them by
// copy whenever the vision half lies below the text half, and the backward whenever the two projections' distances
// differ. And the cast of a leaf parameter is cached for the autocast region, as for nn.Linear's weight. Gradients
// flow back through the cast to the fp32 parameters.
//
// RoPE has no autocast kernel: it is elementwise (autocast leaves those ops alone), so it runs in its input's dtype.
// The backward ops have none either: autograd calls them on the forward's cast tensors.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <utility>

#include "ops/ffn.h"
#include "ops/linear_dual.h"
#include "ops/routed_gemm.h"  // present

namespace {
using at::Tensor;
using OptT = std::optional<Tensor>;

// t is [i] of `base` along its first dimension (the result of base.unbind(0) or base[i]). Offsets, not data
// pointers: under torch.compile these are fake tensors, which have no data.
bool is_slice_of(const Tensor& t, const Tensor& base, int64_t i) {
  return base.dim() == t.dim() + 1 && base.sizes().slice(1).equals(t.sizes()) &&
         base.strides().slice(1).equals(t.strides()) &&
         t.storage_offset() == base.storage_offset() + i * base.stride(0);
}

bool has_symbolic_shape(const Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }

// (text, vision) of one projection, cast to dt. A missing one stays missing.
template <c10::DeviceType D>
std::pair<OptT, OptT> cast_experts(at::ScalarType dt, const OptT& text, const OptT& vision) {
  if (fused::present(text) && fused::present(vision) && text->is_view() && vision->is_view()) {
    const Tensor base(text->_base());
    if (base.is_same(vision->_base()) && !has_symbolic_shape(base) && base.dim() >= 1 && base.size(0) == 2 &&
        is_slice_of(*text, base, 0) && is_slice_of(*vision, base, 1)) {
      const Tensor both = at::autocast::cached_cast(dt, base, D);
      if (!both.is_same(base)) return {both.select(0, 0), both.select(0, 1)};
    }
  }
  return {at::autocast::cached_cast(dt, text, D), at::autocast::cached_cast(dt, vision, D)};
}

template <c10::DeviceType D>
Tensor linear_dual_autocast(const Tensor& x, const Tensor& mask, const Tensor& weight_v, const Tensor& weight_t,
                            const OptT& bias_v, const OptT& bias_t, bool allow_tf32, const OptT& routing) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(D));
  const at::ScalarType dt = at::autocast::get_autocast_dtype(D);
  const auto [wt, wv] = cast_experts<D>(dt, weight_t, weight_v);
  const auto [bt, bv] = cast_experts<D>(dt, bias_t, bias_v);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fused::linear_dual", "").typed<fused::LinearDualOp>();
  return op.call(at::autocast::cached_cast(dt, x, D), mask, *wv, *wt, bv, bt, allow_tf32, routing);
}

template <c10::DeviceType D>
Tensor ffn_autocast(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2, const OptT& mask,
                    const OptT& u1, const OptT& u3, const OptT& u2, bool allow_tf32, const OptT& routing,
                    bool recompute) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(D));
  const at::ScalarType dt = at::autocast::get_autocast_dtype(D);
  // the text expert (u*) is [0] of a stacked projection, the vision (or only) expert (w*) [1]
  const auto [c_u1, c_w1] = cast_experts<D>(dt, u1, w1);
  const auto [c_u3, c_w3] = cast_experts<D>(dt, u3, w3);
  const auto [c_u2, c_w2] = cast_experts<D>(dt, u2, w2);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused::ffn", "").typed<fused::FfnOp>();
  return op.call(at::autocast::cached_cast(dt, x, D), *c_w1, *c_w3, *c_w2, mask, c_u1, c_u3, c_u2, allow_tf32,
                 routing, recompute);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, AutocastCUDA, m) {
  m.impl("linear_dual", linear_dual_autocast<c10::DeviceType::CUDA>);
  m.impl("ffn", ffn_autocast<c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(fused, AutocastCPU, m) {
  m.impl("linear_dual", linear_dual_autocast<c10::DeviceType::CPU>);
  m.impl("ffn", ffn_autocast<c10::DeviceType::CPU>);
}
