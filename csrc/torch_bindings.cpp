// Every op schema of the library, one `def` each: grep an op name here to find its contract.
// Implementations register per dispatch key in csrc/ops/*_{cpu,cuda,meta,autograd}.cpp.
#include <torch/library.h>

#include "ops/rope.h"
#include "runtime/launcher.h"

TORCH_LIBRARY(fused, m) {
  // Rotary position embedding, TransformerEngine's fused semantics (docs/design.md). t: sbhd [s, b, h, d],
  // bshd [b, s, h, d] or thd [t, h, d]; freqs: float32 [s_max, 1, 1, d2]. Returns a contiguous tensor like t.
  m.def("rope_fwd(Tensor t, Tensor freqs, str tensor_format=\"sbhd\", bool interleaved=False, "
        "Tensor? cu_seqlens=None, Tensor? start_positions=None, int cp_size=1, int cp_rank=0) -> Tensor");
  // The exact transpose of rope_fwd: the gradient of t given the gradient of its output.
  m.def("rope_bwd(Tensor grad_output, Tensor freqs, str tensor_format=\"sbhd\", bool interleaved=False, "
        "Tensor? cu_seqlens=None, Tensor? start_positions=None, int cp_size=1, int cp_rank=0) -> Tensor");
  // rope_fwd in place: t is overwritten (not differentiable). Returns nothing, as torch.compile's
  // functionalization requires of custom mutating ops.
  m.def("rope_fwd_(Tensor(a!) t, Tensor freqs, str tensor_format=\"sbhd\", bool interleaved=False, "
        "Tensor? cu_seqlens=None, Tensor? start_positions=None, int cp_size=1, int cp_rank=0) -> ()");
  // rope_fwd of q and k at the same positions in one launch; head counts may differ (GQA).
  m.def("rope_fwd_qk(Tensor q, Tensor k, Tensor freqs, str tensor_format=\"sbhd\", bool interleaved=False, "
        "Tensor? cu_seqlens=None, Tensor? start_positions=None, int cp_size=1, int cp_rank=0) -> (Tensor, Tensor)");
  // rope_bwd of both gradients of rope_fwd_qk in one launch.
  m.def("rope_bwd_qk(Tensor grad_q, Tensor grad_k, Tensor freqs, str tensor_format=\"sbhd\", bool interleaved=False, "
        "Tensor? cu_seqlens=None, Tensor? start_positions=None, int cp_size=1, int cp_rank=0) -> (Tensor, Tensor)");
  // Turns the input checks that read device memory (cu_seqlens, start_positions: a host sync) on or off;
  // returns the previous setting. They are always skipped during CUDA graph capture.
  m.def("set_sync_checks(bool enabled) -> bool", [](bool enabled) { return fused::set_sync_checks(enabled); });
  // The GPU architectures this build holds kernels for, e.g. "sm_80, sm_89, sm_90 (+PTX sm_80)".
  m.def("built_archs() -> str", []() { return std::string(fused::built_archs()); });
}
