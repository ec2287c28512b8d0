// Autocast (torch.autocast, at::autocast) for the routed GEMM ops linear_dual and ffn: one boxed kernel for both. Like
// torch's own linear and matmul (autocast's "lower precision" ops), they cast their floating-point inputs to the
// region's autocast dtype of the device (bf16 or fp16) and run in it. So a module of this library runs in the precision
// its nn.Linear counterpart would inside an autocast region, and activations of the region's dtype can meet fp32
// parameters (without autocast that is a mixed-dtype error). What autocast leaves alone, these leave alone too: float64
// tensors, tensors on another device type, the mask. Outside an autocast region these kernels are not called.
//
// The two experts of a projection held as one [2, R, C] tensor (DualLinear, DualExpertSwiGLU: text at [0], vision at
// [1]) are cast as that one tensor and split again. The halves of the cast stay adjacent, so the kernels read them
// through one descriptor, in the forward and in the paired backward kernel (which needs gate and up at the same expert
// distance). Cast one by one, where the halves land is up to the allocator: the forward would stack them by copy
// whenever the vision half lies below the text half, and the backward whenever the two projections' distances differ.
// And the cast of a leaf parameter is cached for the autocast region, as for nn.Linear's weight. Gradients flow back
// through the cast to the fp32 parameters.
//
// RoPE has no autocast kernel: it is elementwise (autocast leaves those ops alone), so it runs in its input's dtype.
// The backward ops have none either: autograd calls them on the forward's cast tensors.
#include <ATen/core/Tensor.h>
#include <ATen/autocast_mode.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>

namespace {
using at::Tensor;

// t is [i] of `base` along its first dimension (the result of base.unbind(0) or base[i]). Offsets, not data
// pointers: under torch.compile these are fake tensors, which have no data.
bool is_slice_of(const Tensor& t, const Tensor& base, int64_t i) {
  return base.dim() == t.dim() + 1 && base.sizes().slice(1).equals(t.sizes()) &&
         base.strides().slice(1).equals(t.strides()) &&
         t.storage_offset() == base.storage_offset() + i * base.stride(0);
}

bool has_symbolic_shape(const Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }

// The [2, ...] base of t and t's index in it, if t is [0] or [1] of one (and its shape is concrete); else -1.
int64_t expert_slice(const Tensor& t, Tensor* base) {
  if (!t.is_view()) return -1;
  *base = t._base();
  if (has_symbolic_shape(*base) || base->dim() < 1 || base->size(0) != 2) return -1;
  for (int64_t i : {0, 1})
    if (is_slice_of(t, *base, i)) return i;
  return -1;
}

// One boxed kernel for every routed GEMM op, whatever its schema: it casts the op's tensor arguments on the stack
// (at::autocast::cached_cast leaves alone what autocast leaves alone: non-floating tensors such as the mask and the
// routing, float64, other devices, None) and calls the op below autocast. So an argument added to an op is cast with
// no change here. Tensor arguments that are [0] and [1] of one [2, ...] tensor are cast as that tensor (once) and
// split again.
template <c10::DeviceType D>
void routed_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(D));
  const at::ScalarType dt = at::autocast::get_autocast_dtype(D);
  const size_t n = op.schema().arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - n);
  // Slices of a stacked [2, ...] tensor: the base is cast once, if both halves are arguments. On the stack, not the
  // heap: this runs on every call in an autocast region.
  c10::SmallVector<std::pair<Tensor, uint8_t>, 8> bases;  // (base, which halves are arguments: bit i for [i])
  c10::SmallVector<int64_t, 16> slice_of(n, -1), base_of(n, -1);
  for (size_t a = 0; a < n; ++a) {
    if (!args[a].isTensor()) continue;
    Tensor base;
    const int64_t i = expert_slice(args[a].toTensor(), &base);
    if (i < 0) continue;
    size_t b = 0;
    while (b < bases.size() && !bases[b].first.is_same(base)) ++b;
    if (b == bases.size()) bases.emplace_back(base, 0);
    bases[b].second |= uint8_t(1) << i;
    slice_of[a] = i;
    base_of[a] = static_cast<int64_t>(b);
  }
  c10::SmallVector<Tensor, 8> cast_bases(bases.size());
  for (size_t b = 0; b < bases.size(); ++b)
    if (bases[b].second == 3) cast_bases[b] = at::autocast::cached_cast(dt, bases[b].first, D);
  for (size_t a = 0; a < n; ++a) {
    if (!args[a].isTensor()) continue;
    const Tensor t = args[a].toTensor();
    if (base_of[a] >= 0 && cast_bases[base_of[a]].defined()) {
      const Tensor& both = cast_bases[base_of[a]];
      if (!both.is_same(bases[base_of[a]].first)) args[a] = both.select(0, slice_of[a]);
    } else {
      args[a] = at::autocast::cached_cast(dt, t, D);
    }
  }
  op.callBoxed(stack);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, AutocastCUDA, m) {
  m.impl("linear_dual", torch::CppFunction::makeFromBoxedFunction<&routed_autocast<c10::DeviceType::CUDA>>());
  m.impl("ffn", torch::CppFunction::makeFromBoxedFunction<&routed_autocast<c10::DeviceType::CUDA>>());
}

TORCH_LIBRARY_IMPL(fused, AutocastCPU, m) {
  m.impl("linear_dual", torch::CppFunction::makeFromBoxedFunction<&routed_autocast<c10::DeviceType::CPU>>());
  m.impl("ffn", torch::CppFunction::makeFromBoxedFunction<&routed_autocast<c10::DeviceType::CPU>>());
}
