// CUDA implementation of RoPE: validates, then launches the AOT-compiled kernels/rope.py:rope_kernel.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/rope.h"
#include "ops/torch_launch.h"
#include "runtime/kernel_configs.h"
#include "runtime/launcher.h"

namespace fused {
namespace {

// Flag bits shared with kernels/rope.py.
constexpr int kBshd = 1, kBackward = 2, kHasStart = 4, kCopyPass = 8;

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

  KernelArgs a;
  a.ptr(x.data_ptr()).ptr(out.data_ptr()).ptr(second ? x2.data_ptr() : x.data_ptr())
      .ptr(second ? out2.data_ptr() : out.data_ptr()).ptr(f.data_ptr()).ptr(cu.data_ptr()).ptr(sp.data_ptr());
  a.i32(g.rows).i32(g.S).i32(g.B).i32(g.H).i32(H2).i32(g.D).i32(g.D2 / 2).i32(g.s_max)
      .i64(f.stride(0));
  for (const at::Tensor* tensor : {&x, &out, second ? &x2 : &x, second ? &out2 : &out})
    for (int64_t s : rope_strides(*tensor, g.format)) a.i64(s);
  a.i32(o.cp_size).i32(o.cp_rank).i32(flags);

  // Config (warps, blocks) from the table of the device's architecture (aot/configs/sm<arch>.json); its shape class
  // is the heads per token row (few heads want several tokens per program).
  const KernelConfig& cfg =
      kernel_config("rope_kernel", "all", device_capability(x.get_device()), g.rows, g.H + H2, -1);
  launch_on_current_stream("rope_kernel", rope_key(cfg, dtype_name(x.scalar_type()), o.interleaved, second, thd), a,
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
