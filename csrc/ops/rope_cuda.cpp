// CUDA implementation of RoPE: validates, then launches the AOT-compiled kernels/rope.py:rope_kernel.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernel_decls.h"  // generated: build/aot (aot/cpp_decls.py)
#include "ops/rope.h"
#include "ops/torch_launch.h"
#include "runtime/kernel_configs.h"
#include "runtime/launcher.h"

namespace fused {
namespace {

// The flag bits of rope_kernel's `flags` (kBshd, kBackward, kHasStart, kCopyPass): kernel_decls.h, from
// kernels/rope.py.
using namespace rope_flags;

const char* dtype_name(at::ScalarType t) {
  const char* name = variant_dtype(t);
  TORCH_CHECK(name, "rope: unsupported dtype ", t, " on CUDA (float32, float16, bfloat16)");
  return name;
}

// rope_kernel's variant key (aot/manifest.py _rope_variants).
std::string rope_key(const KernelConfig& cfg, const char* dtype, bool interleaved, bool second, bool thd) {
  return std::string("cfg=") + cfg.cfg + ",dtype=" + dtype + ",interleaved=" + (interleaved ? "1" : "0") +
         ",second=" + (second ? "1" : "0") + ",thd=" + (thd ? "1" : "0");
}

void check_cuda_tensor(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.is_cuda(), "rope: ", what, " must be a CUDA tensor, got one on ", x.device());
}

// One launch over `rows` token rows, BLOCK_T (the config's block[0]) per program: x -> out, and x2 -> out2 when x2 is
// defined (same positions, same cos/sin).
void launch_rope(const RopeGeometry& g, const RopeOptions& o, const at::Tensor& freqs, const at::Tensor& x,
                 const at::Tensor& out, const at::Tensor& x2, const at::Tensor& out2, bool backward, bool copy_pass) {
  const bool second = x2.defined();
  const bool thd = g.format == RopeFormat::THD;
  const int64_t H2 = second ? x2.size(thd ? 1 : 2) : 0;
  if (g.rows == 0 || g.D == 0 || g.H + H2 == 0) return;  // q may have no heads while k has some
  at::Tensor f = freqs.stride(3) == 1 ? freqs : freqs.contiguous();
  const at::Tensor& cu = thd ? *o.cu_seqlens : x;  // unused pointers get any valid address
  const at::Tensor& sp = o.start_positions.has_value() ? *o.start_positions : x;
  int flags = (g.format == RopeFormat::BSHD ? kBshd : 0) | (backward ? kBackward : 0) |
              (o.start_positions.has_value() ? kHasStart : 0) | (copy_pass ? kCopyPass : 0);

  const at::Tensor &x2_or_x = second ? x2 : x, &out2_or_out = second ? out2 : out;
  const auto sx = rope_strides(x, g.format), so = rope_strides(out, g.format);
  const auto sx2 = rope_strides(x2_or_x, g.format), so2 = rope_strides(out2_or_out, g.format);
  kernel_args::rope_kernel args{
      .x_ptr = x.data_ptr(), .out_ptr = out.data_ptr(), .x2_ptr = x2_or_x.data_ptr(),
      .out2_ptr = out2_or_out.data_ptr(), .freqs_ptr = f.data_ptr(), .cu_seqlens_ptr = cu.data_ptr(), .start_ptr = sp.data_ptr(), .rows = g.rows,
      .S = g.S, .B = g.B, .H = g.H, .H2 = H2, .D = g.D, .HALF = g.D2 / 2, .s_max = g.s_max,
      .freqs_stride = f.stride(0), .sx_s = sx[0], .sx_b = sx[1], .sx_h = sx[2], .sx_d = sx[3], .so_s = so[0],
      .so_b = so[1], .so_h = so[2], .so_d = so[3], .sx2_s = sx2[0], .sx2_b = sx2[1], .sx2_h = sx2[2],
      .sx2_d = sx2[3], .so2_s = so2[0], .so2_b = so2[1], .so2_h = so2[2], .so2_d = so2[3], .cp_size = o.cp_size,
      .cp_rank = o.cp_rank, .flags = flags};

  // Config (warps, blocks) from the table of the device's architecture (aot/configs/sm<arch>.json); its shape class
  // is the heads per token row (few heads want several tokens per program).
  const KernelConfig& cfg =
      kernel_config("rope_kernel", "all", device_capability(x.get_device()), g.rows, g.H + H2, -1);
  launch_on_current_stream(std::move(args), rope_key(cfg, dtype_name(x.scalar_type()), o.interleaved, second, thd),
                           Grid{static_cast<uint32_t>(cdiv(g.rows, cfg.block[0])), 1, 1}, x);
}

RopeGeometry check_cuda_inputs(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o,
                               const char* what) {
  check_cuda_tensor(t, what);
  RopeGeometry g = check_rope_inputs(t, freqs, o, what);
  dtype_name(t.scalar_type());
  // The kernel indexes tokens in int32, up to the end of its last program's block of tokens (at most 1024).
  TORCH_CHECK(g.rows <= std::numeric_limits<int32_t>::max() - 1024, "rope: too many tokens (", g.rows,
              ") for one launch");
  // Reading cu_seqlens / start_positions costs a device-to-host copy; never during CUDA graph capture.
  if (sync_checks_enabled() && (o.cu_seqlens.has_value() || o.start_positions.has_value()) &&
      !current_stream_is_capturing(t))
    check_rope_values(g, o);
  return g;
}

}  // namespace

at::Tensor rope_cuda(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o, bool backward) {
  const char* what = backward ? "grad_output" : "t";
  RopeGeometry g = check_cuda_inputs(t, freqs, o, what);
  c10::cuda::CUDAGuard guard(t.device());
  at::Tensor out = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  launch_rope(g, o, freqs, t, out, at::Tensor(), at::Tensor(), backward, /*copy_pass=*/true);
  return out;
}

void rope_inplace_cuda(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o) {
  RopeGeometry g = check_cuda_inputs(t, freqs, o, "t");
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes,
              "rope: the in-place rope_fwd_ needs t without internal overlap (e.g. not an expanded tensor)");
  c10::cuda::CUDAGuard guard(t.device());
  launch_rope(g, o, freqs, t, t, at::Tensor(), at::Tensor(), /*backward=*/false, /*copy_pass=*/false);
}

std::tuple<at::Tensor, at::Tensor> rope_qk_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs,
                                                const RopeOptions& o, bool backward) {
  RopeGeometry g = check_cuda_inputs(q, freqs, o, "q");
  check_rope_qk_inputs(q, k, freqs, o);
  check_cuda_tensor(k, "k");
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor qo = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor ko = at::empty(k.sizes(), k.options().memory_format(at::MemoryFormat::Contiguous));
  launch_rope(g, o, freqs, q, qo, k, ko, backward, /*copy_pass=*/true);
  return {qo, ko};
}

std::vector<VariantRequest> rope_requestable_variants(int cc) {
  std::vector<VariantRequest> out;
  if (!find_config("rope_kernel", "all", cc, 0, -1, -1)) return {{"rope_kernel", "no config (all)"}};
  for (size_t i = 0; i < kNumConfigs; ++i) {  // every bucket of the table that serves cc
    const KernelConfig& cfg = kConfigs[i];
    if (std::string(cfg.kernel) != "rope_kernel" || cfg.arch != table_arch(cc)) continue;
    for (at::ScalarType t : {at::kFloat, at::kHalf, at::kBFloat16})
      for (bool interleaved : {false, true})
        for (bool second : {false, true})
          for (bool thd : {false, true})
            out.push_back({"rope_kernel", rope_key(cfg, variant_dtype(t), interleaved, second, thd)});
  }
  return out;
}

}  // namespace fused

// The ops' kernels on this backend, registered here (the schemas: csrc/torch_bindings.cpp).
namespace {
using at::Tensor;

Tensor fwd(const Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_cuda(t, freqs, FUSED_ROPE_OPTS, false);
}
Tensor bwd(const Tensor& g, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_cuda(g, freqs, FUSED_ROPE_OPTS, true);
}
void fwd_(Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) { fused::rope_inplace_cuda(t, freqs, FUSED_ROPE_OPTS); }
std::tuple<Tensor, Tensor> fwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_qk_cuda(q, k, freqs, FUSED_ROPE_OPTS, false);
}
std::tuple<Tensor, Tensor> bwd_qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  return fused::rope_qk_cuda(q, k, freqs, FUSED_ROPE_OPTS, true);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("rope_fwd", fwd);
  m.impl("rope_bwd", bwd);
  m.impl("rope_fwd_", fwd_);
  m.impl("rope_fwd_qk", fwd_qk);
  m.impl("rope_bwd_qk", bwd_qk);
}
