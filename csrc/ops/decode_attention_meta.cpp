// What decode_attention accepts and returns, in one place:
//  * the input checks (check_decode_attention_inputs*), which the CPU, CUDA and Meta kernels all run first: sizes,
//    dtypes, devices and layouts only, nothing that reads device memory (cache_lens' values are checked by the CPU
//    kernel, and guarded against inside the CUDA kernel: checking them there would sync the host);
//  * the Meta (shape) kernel: those checks plus the output's shape. torch.compile, torch.export and fake tensors trace
//    through it with symbolic sizes (one trace serves every batch and cache length);
//  * the split rule of the CUDA launcher (host values only).
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "kernel_decls.h"  // generated: build/aot (aot/cpp_decls.py): fused::attention constants
#include "ops/decode_attention.h"

// TORCH_SYM_CHECK, but a ValueError (a wrong shape is a bad value, as for the CPU kernel's length check).
#define FUSED_SYM_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE((cond).expect_true(__FILE__, __LINE__), __VA_ARGS__)

namespace fused {

DecodeAttentionSymGeometry check_decode_attention_inputs_symint(const at::Tensor& q, const at::Tensor& k_cache,
                                                                const at::Tensor& v_cache, const at::Tensor& k_new,
                                                                const at::Tensor& v_new, const at::Tensor& cache_lens) {
  const char* op = "decode_attention";
  struct Named {
    const at::Tensor& t;
    const char* name;
    const char* shape;
  };
  const Named tensors[] = {{q, "q", "[B, T, Hq, D]"},
                           {k_cache, "k_cache", "[B, Hkv, S, D]"},
                           {v_cache, "v_cache", "[B, Hkv, S, D]"},
                           {k_new, "k_new", "[B, T, Hkv, D]"},
                           {v_new, "v_new", "[B, T, Hkv, D]"}};
  const auto dt = q.scalar_type();
  const bool cpu_like = q.device().is_cpu() || q.device().is_meta();
  TORCH_CHECK_VALUE(dt == at::kHalf || dt == at::kBFloat16 || (cpu_like && (dt == at::kFloat || dt == at::kDouble)),
                    op, ": q must be bfloat16 or float16", cpu_like ? " (or float32 / float64 on the CPU)" : "",
                    ", got ", dt);
  for (const Named& a : tensors) {
    TORCH_CHECK_VALUE(a.t.dim() == 4, op, ": ", a.name, " must have 4 dimensions ", a.shape, ", got shape ",
                      a.t.sym_sizes());
    TORCH_CHECK_VALUE(a.t.scalar_type() == dt, op, ": ", a.name, " has dtype ", a.t.scalar_type(), " but q has ", dt);
    TORCH_CHECK(a.t.device() == q.device(), op, ": ", a.name, " is on ", a.t.device(), " but q is on ", q.device());
    // The kernel reads every row as D contiguous elements; the other strides are passed (a fused QKV output's
    // views work as they are, no copy).
    TORCH_SYM_CHECK(a.t.sym_stride(3).sym_eq(1).sym_or(a.t.sym_size(3).sym_le(1)), op, ": ", a.name,
                    " must have a contiguous last dimension (stride 1), got strides ", a.t.sym_strides());
  }
  TORCH_CHECK_VALUE(cache_lens.scalar_type() == at::kInt, op, ": cache_lens must be int32, got ",
                    cache_lens.scalar_type());
  TORCH_CHECK_VALUE(cache_lens.dim() == 1, op, ": cache_lens must have shape [B], got ", cache_lens.sym_sizes());
  TORCH_CHECK(cache_lens.device() == q.device(), op, ": cache_lens is on ", cache_lens.device(), " but q is on ",
              q.device(), " (it must live on q's device: reading it elsewhere would sync the host)");

  DecodeAttentionSymGeometry g{q.sym_size(0), q.sym_size(1), q.sym_size(2), k_new.sym_size(2), q.sym_size(3),
                               k_cache.sym_size(2)};
  FUSED_SYM_CHECK_VALUE(g.T.sym_ge(1).sym_and(g.T.sym_le(attention::kMaxT)), op, ": q must hold 1 to ",
                        attention::kMaxT, " new tokens per sequence (T = q.shape[1]), got ", g.T);
  FUSED_SYM_CHECK_VALUE(g.Hkv.sym_ge(1), op, ": k_new must have at least one head, got shape ", k_new.sym_sizes());
  FUSED_SYM_CHECK_VALUE((g.Hq % g.Hkv).sym_eq(0).sym_and(g.Hq.sym_ge(1)), op,
                        ": q's heads must be a positive multiple of the KV heads (grouped-query attention), got Hq = ",
                        g.Hq, " and Hkv = ", g.Hkv);
  FUSED_SYM_CHECK_VALUE(g.D.sym_ge(1), op, ": the head dim must be positive, got q of shape ", q.sym_sizes());
  const auto want = [&](const Named& a, std::initializer_list<c10::SymInt> dims) {
    c10::SymBool eq(true);
    int i = 0;
    for (const c10::SymInt& d : dims) eq = eq.sym_and(a.t.sym_size(i++).sym_eq(d));
    FUSED_SYM_CHECK_VALUE(eq, op, ": ", a.name, " must have shape ", a.shape, " = ", c10::SymIntArrayRef(dims),
                          " (from q ", q.sym_sizes(), ", k_new ", k_new.sym_sizes(), ", k_cache ", k_cache.sym_sizes(),
                          "), got ", a.t.sym_sizes());
  };
  want(tensors[3], {g.B, g.T, g.Hkv, g.D});
  want(tensors[4], {g.B, g.T, g.Hkv, g.D});
  want(tensors[1], {g.B, g.Hkv, g.S, g.D});
  want(tensors[2], {g.B, g.Hkv, g.S, g.D});
  FUSED_SYM_CHECK_VALUE(cache_lens.sym_size(0).sym_eq(g.B), op, ": cache_lens must have shape [B] = [", g.B,
                        "], got ", cache_lens.sym_sizes());
  FUSED_SYM_CHECK_VALUE(g.S.sym_ge(g.T), op, ": the cache holds S = ", g.S, " positions, fewer than the T = ", g.T,
                        " new tokens");
  return g;
}

DecodeAttentionGeometry check_decode_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache, const at::Tensor& k_new,
                                                      const at::Tensor& v_new, const at::Tensor& cache_lens) {
  const DecodeAttentionSymGeometry g = check_decode_attention_inputs_symint(q, k_cache, v_cache, k_new, v_new,
                                                                           cache_lens);
  // The caches are written: each must be writable through its own elements only, and they must not share memory.
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(at::has_internal_overlap(*c) != at::MemOverlap::Yes, "decode_attention: ",
                c == &k_cache ? "k_cache" : "v_cache",
                " is written in place and must not overlap itself (e.g. not an expanded tensor)");
  TORCH_CHECK(at::get_overlap_status(k_cache, v_cache) == at::MemOverlapStatus::No,
              "decode_attention: k_cache and v_cache must not share memory (both are written)");
  return {g.B.expect_int(), g.T.expect_int(), g.Hq.expect_int(), g.Hkv.expect_int(), g.D.expect_int(),
          g.S.expect_int()};
}

double decode_attention_scale(const std::optional<double>& scale, int64_t D) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
}

int64_t decode_attention_split(int64_t programs, int64_t S, int64_t block_n, int64_t sms) {
  const auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t blocks = cdiv(S, block_n);
  const int64_t want = cdiv(attention::kSplitCtasPerSm * sms, std::max<int64_t>(programs, 1));
  return std::max<int64_t>(1, std::min({want, cdiv(blocks, attention::kSplitMinBlocks), attention::kCombineMaxSplits}));
}

}  // namespace fused

namespace {
using at::Tensor;

Tensor meta(const Tensor& q, Tensor& k_cache, Tensor& v_cache, const Tensor& k_new, const Tensor& v_new,
            const Tensor& cache_lens, std::optional<double> scale) {
  const auto g = fused::check_decode_attention_inputs_symint(q, k_cache, v_cache, k_new, v_new, cache_lens);
  return at::empty_symint({g.B, g.T, g.Hq, g.D}, q.options().memory_format(at::MemoryFormat::Contiguous));
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) { m.impl("decode_attention", meta); }
