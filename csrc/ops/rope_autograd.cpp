// Autograd of the rope ops, in C++ so gradients flow from Python, TorchScript and libtorch alike. rope_fwd's
// backward is rope_bwd and vice versa (each is the other's transpose), so higher derivatives work too.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/rope.h"

namespace {
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using RopeFn = Tensor(const Tensor&, const Tensor&, c10::string_view, bool, const std::optional<Tensor>&,
                      const std::optional<Tensor>&, int64_t, int64_t);
using RopeQkFn = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, c10::string_view, bool,
                                            const std::optional<Tensor>&, const std::optional<Tensor>&, int64_t,
                                            int64_t);

c10::TypedOperatorHandle<RopeFn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<RopeFn>();
}
c10::TypedOperatorHandle<RopeQkFn> op_qk(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<RopeQkFn>();
}

void save(AutogradContext* ctx, const Tensor& freqs, FUSED_ROPE_ARGS) {
  ctx->save_for_backward({freqs, cu_seqlens.value_or(Tensor()), start_positions.value_or(Tensor())});
  ctx->saved_data["format"] = std::string(tensor_format);
  ctx->saved_data["interleaved"] = interleaved;
  ctx->saved_data["cp_size"] = cp_size;
  ctx->saved_data["cp_rank"] = cp_rank;
}

struct Saved {
  Tensor freqs;
  std::optional<Tensor> cu, start;
  std::string format;
  bool interleaved;
  int64_t cp_size, cp_rank;
};

Saved load(AutogradContext* ctx) {
  auto v = ctx->get_saved_variables();
  Saved s{v[0], std::nullopt, std::nullopt, ctx->saved_data["format"].toStringRef(),
          ctx->saved_data["interleaved"].toBool(), ctx->saved_data["cp_size"].toInt(),
          ctx->saved_data["cp_rank"].toInt()};
  if (v[1].defined()) s.cu = v[1];
  if (v[2].defined()) s.start = v[2];
  return s;
}

// forward_op runs below autograd; backward_op runs with autograd on (so it is itself differentiable).
template <const char* ForwardName, const char* BackwardName>
struct RopeFunction : public torch::autograd::Function<RopeFunction<ForwardName, BackwardName>> {
  static Tensor forward(AutogradContext* ctx, const Tensor& t, const Tensor& freqs, c10::string_view tensor_format,
                        bool interleaved, const std::optional<Tensor>& cu_seqlens,
                        const std::optional<Tensor>& start_positions, int64_t cp_size, int64_t cp_rank) {
    save(ctx, freqs, tensor_format, interleaved, cu_seqlens, start_positions, cp_size, cp_rank);
    at::AutoDispatchBelowADInplaceOrView guard;
    return op(ForwardName).call(t, freqs, tensor_format, interleaved, cu_seqlens, start_positions, cp_size, cp_rank);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Saved s = load(ctx);
    Tensor g = op(BackwardName).call(grads[0].contiguous(), s.freqs, s.format, s.interleaved, s.cu, s.start,
                                     s.cp_size, s.cp_rank);
    return {g, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// `SingleBackwardName` handles the case where only one of the two outputs is used (the other gradient is zero).
template <const char* ForwardName, const char* BackwardName, const char* SingleBackwardName>
struct RopeQkFunction
    : public torch::autograd::Function<RopeQkFunction<ForwardName, BackwardName, SingleBackwardName>> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& freqs,
                               c10::string_view tensor_format, bool interleaved,
                               const std::optional<Tensor>& cu_seqlens, const std::optional<Tensor>& start_positions,
                               int64_t cp_size, int64_t cp_rank) {
    save(ctx, freqs, tensor_format, interleaved, cu_seqlens, start_positions, cp_size, cp_rank);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko] = op_qk(ForwardName).call(q, k, freqs, tensor_format, interleaved, cu_seqlens, start_positions,
                                            cp_size, cp_rank);
    return {qo, ko};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Saved s = load(ctx);
    Tensor gq = grads[0].defined() ? grads[0].contiguous() : Tensor();
    Tensor gk = grads[1].defined() ? grads[1].contiguous() : Tensor();
    Tensor dq, dk;
    if (gq.defined() && gk.defined()) {
      std::tie(dq, dk) =
          op_qk(BackwardName).call(gq, gk, s.freqs, s.format, s.interleaved, s.cu, s.start, s.cp_size, s.cp_rank);
    } else {
      auto one = [&](const Tensor& g) {
        return g.defined() ? op(SingleBackwardName)
                                 .call(g, s.freqs, s.format, s.interleaved, s.cu, s.start, s.cp_size, s.cp_rank)
                           : Tensor();
      };
      dq = one(gq);
      dk = one(gk);
    }
    return {dq, dk, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

constexpr char kFwd[] = "fused::rope_fwd";
constexpr char kBwd[] = "fused::rope_bwd";
constexpr char kFwdQk[] = "fused::rope_fwd_qk";
constexpr char kBwdQk[] = "fused::rope_bwd_qk";

Tensor fwd(const Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return RopeFunction<kFwd, kBwd>::apply(t, freqs, tensor_format, interleaved, cu_seqlens, start_positions, cp_size,
                                         cp_rank);
}
Tensor bwd(const Tensor& g, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return RopeFunction<kBwd, kFwd>::apply(g, freqs, tensor_format, interleaved, cu_seqlens, start_positions, cp_size,
                                         cp_rank);
}
std::tuple<Tensor, Tensor> fwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  auto r = RopeQkFunction<kFwdQk, kBwdQk, kBwd>::apply(q, k, freqs, tensor_format, interleaved, cu_seqlens,
                                                 start_positions, cp_size, cp_rank);
  return {r[0], r[1]};
}
std::tuple<Tensor, Tensor> bwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  auto r = RopeQkFunction<kBwdQk, kFwdQk, kFwd>::apply(q, k, freqs, tensor_format, interleaved, cu_seqlens,
                                                 start_positions, cp_size, cp_rank);
  return {r[0], r[1]};
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Autograd, m) {
  m.impl("rope_fwd", fwd);
  m.impl("rope_bwd", bwd);
  m.impl("rope_fwd_qk", fwd_qk);
  m.impl("rope_bwd_qk", bwd_qk);
  // In place: not differentiable; this fallback raises if t requires grad, as in-place ops must.
  m.impl("rope_fwd_", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(fused, ADInplaceOrView, m) {
  m.impl("rope_fwd_", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}
