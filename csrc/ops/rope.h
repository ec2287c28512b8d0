// RoPE (TransformerEngine semantics; see docs/design.md): shared argument checks and the per-backend entry points.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "ops/torch_launch.h"

namespace fused {

enum class RopeFormat { SBHD, BSHD, THD };

// Everything the backends need to know about one rope call, after validation; RopeSymGeometry has the symbolic sizes
// of a Meta kernel's tensors (torch.export / torch.compile with dynamic shapes).
template <typename Int>
struct RopeGeometryOf {
  RopeFormat format;
  Int S;     // sequence length (sbhd/bshd); 0 for thd
  Int B;     // batch (sbhd/bshd) or number of packed sequences (thd)
  Int rows;  // tokens: S*B, or t for thd
  Int H, D, D2;
  Int s_max;  // positions available in freqs
};
using RopeGeometry = RopeGeometryOf<int64_t>;
using RopeSymGeometry = RopeGeometryOf<c10::SymInt>;

struct RopeOptions {
  std::string tensor_format;
  bool interleaved;
  std::optional<at::Tensor> cu_seqlens;       // int32 [B + 1] (thd)
  std::optional<at::Tensor> start_positions;  // int32 [B]
  int64_t cp_size;
  int64_t cp_rank;
};

// Strides of `x` over (s or t, b, h, d) for the kernel; b is 0 for thd.
std::array<int64_t, 4> rope_strides(const at::Tensor& x, RopeFormat f);

// Shape, dtype and device checks that need no data. `what` names the tensor. The _symint one reads symbolic sizes
// (the Meta kernels) and guards only what the kernel needs: a sequence that fits in freqs, an even local length under
// context parallelism; the other runs the same checks on concrete tensors (the CPU and CUDA kernels).
RopeSymGeometry check_rope_inputs_symint(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o,
                                         const char* what);
RopeGeometry check_rope_inputs(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o,
                               const char* what);
// rope_*_qk: both checked as above, on one device and of one dtype, agreeing in every dimension but heads. Returns
// q's geometry.
RopeSymGeometry check_rope_qk_inputs_symint(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs,
                                            const RopeOptions& o);
RopeGeometry check_rope_qk_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs,
                                  const RopeOptions& o);

// The checks that read cu_seqlens / start_positions values. On CUDA tensors they cost a device-to-host copy
// (a host sync), so the CUDA path runs them only while sync checks are on (see set_sync_checks).
void check_rope_values(const RopeGeometry& g, const RopeOptions& o);

// Global switch for checks that synchronize with the device (default on). Returns the previous value.
bool set_sync_checks(bool enabled);
bool sync_checks_enabled();

// Positions of every row (int64 on the CPU), in row order: sbhd (s, b), bshd (b, s), thd (t). CPU path only.
at::Tensor rope_positions_cpu(const RopeGeometry& g, const RopeOptions& o);

// Backends. `backward` selects the transpose. rope_cpu also serves as the reference semantics.
at::Tensor rope_cpu(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o, bool backward);
at::Tensor rope_cuda(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o, bool backward);
// q and k at the same positions in one launch (head counts may differ); in place when `inplace`.
std::tuple<at::Tensor, at::Tensor> rope_qk_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs,
                                                const RopeOptions& o, bool backward);
void rope_inplace_cuda(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o);
// Every rope_kernel variant the CUDA launcher can ask for on a device of compute capability cc (variant_check.cpp).
std::vector<VariantRequest> rope_requestable_variants(int cc);

}  // namespace fused

namespace fused {
inline RopeOptions rope_options(c10::string_view tensor_format, bool interleaved,
                                const std::optional<at::Tensor>& cu_seqlens,
                                const std::optional<at::Tensor>& start_positions, int64_t cp_size, int64_t cp_rank) {
  return RopeOptions{std::string(tensor_format), interleaved, cu_seqlens, start_positions, cp_size, cp_rank};
}
}  // namespace fused

// The argument list every rope op shares after its tensor arguments (see csrc/torch_bindings.cpp).
#define FUSED_ROPE_ARGS                                                                                 \
  c10::string_view tensor_format, bool interleaved, const std::optional<at::Tensor>& cu_seqlens,       \
      const std::optional<at::Tensor>&start_positions, int64_t cp_size, int64_t cp_rank
#define FUSED_ROPE_OPTS fused::rope_options(tensor_format, interleaved, cu_seqlens, start_positions, cp_size, cp_rank)
