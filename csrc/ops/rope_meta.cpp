// What the rope ops accept and what they return, in one place:
//  * the input checks (check_rope_inputs*), which the CPU, CUDA and Meta kernels all run first;
//  * the Meta (shape) kernels: those checks plus the output shapes. torch.compile, torch.export and fake
//    tensors trace through them; sizes stay symbolic (check_rope_inputs_symint), so one trace serves every shape.
#include <ATen/ops/empty.h>
#include <atomic>
#include <torch/library.h>

#include "ops/rope.h"

namespace fused {
namespace {
std::atomic<bool> g_sync_checks{true};
}

bool set_sync_checks(bool enabled) { return g_sync_checks.exchange(enabled); }
bool sync_checks_enabled() { return g_sync_checks.load(); }

std::array<int64_t, 4> rope_strides(const at::Tensor& x, RopeFormat f) {
  switch (f) {
    case RopeFormat::SBHD: return {x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
    case RopeFormat::BSHD: return {x.stride(1), x.stride(0), x.stride(2), x.stride(3)};
    default: return {x.stride(0), 0, x.stride(1), x.stride(2)};
  }
}

RopeSymGeometry check_rope_inputs_symint(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o,
                                         const char* what) {
  RopeSymGeometry g{};
  if (o.tensor_format == "sbhd") g.format = RopeFormat::SBHD;
  else if (o.tensor_format == "bshd") g.format = RopeFormat::BSHD;
  else if (o.tensor_format == "thd") g.format = RopeFormat::THD;
  else TORCH_CHECK_VALUE(false, "rope: tensor_format must be 'sbhd', 'bshd' or 'thd', got '", o.tensor_format, "'");
  const bool thd = g.format == RopeFormat::THD;

  TORCH_CHECK(t.dim() == (thd ? 3 : 4), "rope: ", what, " must have ", thd ? 3 : 4, " dimensions for tensor_format='",
              o.tensor_format, "' (", thd ? "[t, h, d]" : (g.format == RopeFormat::SBHD ? "[s, b, h, d]" : "[b, s, h, d]"),
              "), got shape ", t.sym_sizes());
  const auto dt = t.scalar_type();
  const bool cpu_like = t.device().is_cpu() || t.device().is_meta();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || (cpu_like && dt == at::kDouble),
              "rope: ", what, " must be float32, float16 or bfloat16", cpu_like ? " (or float64 on the CPU)" : "",
              ", got ", dt);
  TORCH_CHECK(freqs.dim() == 4, "rope: freqs must have shape [s_max, 1, 1, d2], got ", freqs.sym_sizes());
  TORCH_SYM_CHECK(freqs.sym_size(1).sym_eq(1).sym_and(freqs.sym_size(2).sym_eq(1)),
                  "rope: freqs must have shape [s_max, 1, 1, d2], got ", freqs.sym_sizes());
  TORCH_CHECK(freqs.scalar_type() == at::kFloat, "rope: freqs must be float32, got ", freqs.scalar_type());
  TORCH_CHECK(freqs.device() == t.device(), "rope: freqs is on ", freqs.device(), " but ", what, " is on ",
              t.device());

  g.H = t.sym_size(thd ? 1 : 2);
  g.D = t.sym_size(thd ? 2 : 3);
  g.D2 = freqs.sym_size(3);
  g.s_max = freqs.sym_size(0);
  TORCH_SYM_CHECK(g.D2.sym_gt(0).sym_and((g.D2 % 2).sym_eq(0)),
                  "rope: freqs' last dimension d2 must be a positive even number, got ", g.D2);
  TORCH_SYM_CHECK(g.D2.sym_le(g.D), "rope: freqs' last dimension d2 = ", g.D2, " exceeds the head dimension d = ", g.D,
                  " of ", what);
  TORCH_CHECK(o.cp_size >= 1, "rope: cp_size must be >= 1, got ", o.cp_size);
  TORCH_CHECK(o.cp_rank >= 0 && o.cp_rank < o.cp_size, "rope: cp_rank must be in [0, cp_size = ", o.cp_size,
              "), got ", o.cp_rank);

  if (thd) {
    TORCH_CHECK(o.cu_seqlens.has_value(), "rope: tensor_format='thd' needs cu_seqlens");
    const at::Tensor& cu = *o.cu_seqlens;
    TORCH_CHECK(cu.scalar_type() == at::kInt, "rope: cu_seqlens must be int32, got ", cu.scalar_type());
    TORCH_CHECK(cu.dim() == 1, "rope: cu_seqlens must have shape [b + 1], got ", cu.sym_sizes());
    TORCH_SYM_CHECK(cu.sym_size(0).sym_ge(1), "rope: cu_seqlens must have shape [b + 1], got ", cu.sym_sizes());
    TORCH_CHECK(cu.device() == t.device(), "rope: cu_seqlens is on ", cu.device(), " but ", what, " is on ",
                t.device());
    g.B = cu.sym_size(0) - 1;
    g.S = 0;
    g.rows = t.sym_size(0);
  } else {
    TORCH_CHECK(!o.cu_seqlens.has_value(), "rope: cu_seqlens is only used with tensor_format='thd'");
    g.S = t.sym_size(g.format == RopeFormat::SBHD ? 0 : 1);
    g.B = t.sym_size(g.format == RopeFormat::SBHD ? 1 : 0);
    g.rows = g.S * g.B;
    if (o.cp_size > 1)  // (a guard on a dynamic length only then: the kernel splits each local sequence in halves)
      TORCH_SYM_CHECK((g.S % 2).sym_eq(0), "rope: with cp_size > 1 the local sequence length must be even, got ", g.S);
    TORCH_SYM_CHECK((g.S * o.cp_size).sym_le(g.s_max).sym_or(g.rows.sym_eq(0)), "rope: freqs has ", g.s_max,
                    " positions but the sequence needs ", g.S * o.cp_size, " (s * cp_size)");
  }
  if (o.start_positions.has_value()) {
    const at::Tensor& sp = *o.start_positions;
    TORCH_CHECK(sp.scalar_type() == at::kInt, "rope: start_positions must be int32, got ", sp.scalar_type());
    TORCH_CHECK(sp.dim() == 1, "rope: start_positions must have shape [b] = [", g.B, "], got ", sp.sym_sizes());
    TORCH_SYM_CHECK(sp.sym_size(0).sym_eq(g.B), "rope: start_positions must have shape [b] = [", g.B, "], got ",
                    sp.sym_sizes());
    TORCH_CHECK(sp.device() == t.device(), "rope: start_positions is on ", sp.device(), " but ", what, " is on ",
                t.device());
  }
  return g;
}

namespace {
RopeGeometry concrete(const RopeSymGeometry& g) {
  return {g.format,         g.S.expect_int(), g.B.expect_int(),  g.rows.expect_int(),
          g.H.expect_int(), g.D.expect_int(), g.D2.expect_int(), g.s_max.expect_int()};
}
}  // namespace

RopeGeometry check_rope_inputs(const at::Tensor& t, const at::Tensor& freqs, const RopeOptions& o,
                               const char* what) {
  return concrete(check_rope_inputs_symint(t, freqs, o, what));
}

RopeSymGeometry check_rope_qk_inputs_symint(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs,
                                            const RopeOptions& o) {
  TORCH_CHECK(k.device() == q.device(), "rope: k is on ", k.device(), " but q is on ", q.device());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "rope: k has dtype ", k.scalar_type(), " but q has ",
              q.scalar_type());
  const RopeSymGeometry gq = check_rope_inputs_symint(q, freqs, o, "q");
  const RopeSymGeometry gk = check_rope_inputs_symint(k, freqs, o, "k");
  TORCH_SYM_CHECK(gk.rows.sym_eq(gq.rows).sym_and(gk.S.sym_eq(gq.S)).sym_and(gk.B.sym_eq(gq.B)).sym_and(
                      gk.D.sym_eq(gq.D)),
                  "rope: q and k must agree in every dimension but heads, got q ", q.sym_sizes(), " and k ",
                  k.sym_sizes());
  return gq;
}

RopeGeometry check_rope_qk_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs,
                                  const RopeOptions& o) {
  return concrete(check_rope_qk_inputs_symint(q, k, freqs, o));
}

void check_rope_values(const RopeGeometry& g, const RopeOptions& o) {
  std::vector<int64_t> start(g.B, 0);
  if (o.start_positions.has_value()) {
    at::Tensor sp = o.start_positions->to(at::kCPU).contiguous();
    const int32_t* p = sp.data_ptr<int32_t>();
    for (int64_t b = 0; b < g.B; ++b) {
      TORCH_CHECK(p[b] >= 0, "rope: start_positions[", b, "] = ", p[b], " is negative");
      start[b] = p[b];
    }
  }
  if (g.format == RopeFormat::THD) {
    at::Tensor cu = o.cu_seqlens->to(at::kCPU).contiguous();
    const int32_t* c = cu.data_ptr<int32_t>();
    TORCH_CHECK(c[0] == 0, "rope: cu_seqlens[0] must be 0, got ", c[0]);
    TORCH_CHECK(int64_t(c[g.B]) == g.rows * o.cp_size, "rope: cu_seqlens[-1] = ", c[g.B],
                " must equal the token count ", g.rows, o.cp_size > 1 ? " times cp_size" : "",
                o.cp_size > 1 ? (" = " + std::to_string(g.rows * o.cp_size)) : std::string());
    for (int64_t b = 0; b < g.B; ++b) {
      const int64_t len = int64_t(c[b + 1]) - c[b];
      TORCH_CHECK(len >= 0, "rope: cu_seqlens must be non-decreasing, but cu_seqlens[", b + 1, "] = ", c[b + 1],
                  " < cu_seqlens[", b, "] = ", c[b]);
      const int64_t unit = o.cp_size > 1 ? 2 * o.cp_size : 1;
      TORCH_CHECK(len % unit == 0, "rope: with cp_size = ", o.cp_size, " every sequence length must be a multiple of ",
                  unit, "; sequence ", b, " has ", len);
      TORCH_CHECK(start[b] + len <= g.s_max, "rope: sequence ", b, " needs positions up to ", start[b] + len,
                  " but freqs has ", g.s_max);
    }
  } else {
    for (int64_t b = 0; b < g.B; ++b)
      TORCH_CHECK(start[b] + g.S * o.cp_size <= g.s_max, "rope: sequence ", b, " (start position ", start[b],
                  ") needs positions up to ", start[b] + g.S * o.cp_size, " but freqs has ", g.s_max);
  }
}

at::Tensor rope_positions_cpu(const RopeGeometry& g, const RopeOptions& o) {
  std::vector<int64_t> start(g.B, 0);
  if (o.start_positions.has_value()) {
    at::Tensor sp = o.start_positions->to(at::kCPU).contiguous();
    for (int64_t b = 0; b < g.B; ++b) start[b] = sp.data_ptr<int32_t>()[b];
  }
  at::Tensor pos = at::empty({g.rows}, at::kLong);
  int64_t* p = pos.data_ptr<int64_t>();
  auto position = [&](int64_t s, int64_t b, int64_t len) {
    int64_t q = s + start[b];
    if (o.cp_size > 1) {
      const int64_t half = len / 2;
      q += s < half ? o.cp_rank * half : len * o.cp_size - (o.cp_rank + 1) * half - half;
    }
    return q;
  };
  if (g.format == RopeFormat::THD) {
    at::Tensor cu = o.cu_seqlens->to(at::kCPU).contiguous();
    const int32_t* c = cu.data_ptr<int32_t>();
    for (int64_t b = 0; b < g.B; ++b) {
      const int64_t begin = c[b] / o.cp_size, end = c[b + 1] / o.cp_size;
      for (int64_t r = begin; r < end; ++r) p[r] = position(r - begin, b, end - begin);
    }
  } else {
    for (int64_t s = 0; s < g.S; ++s)
      for (int64_t b = 0; b < g.B; ++b)
        p[g.format == RopeFormat::SBHD ? s * g.B + b : b * g.S + s] = position(s, b, g.S);
  }
  return pos;
}

}  // namespace fused

namespace {
using at::Tensor;

Tensor like(const Tensor& t) {
  return at::empty_symint(t.sym_sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
}

Tensor fwd(const Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_inputs_symint(t, freqs, FUSED_ROPE_OPTS, "t");
  return like(t);
}
Tensor bwd(const Tensor& g, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_inputs_symint(g, freqs, FUSED_ROPE_OPTS, "grad_output");
  return like(g);
}
void fwd_(Tensor& t, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_inputs_symint(t, freqs, FUSED_ROPE_OPTS, "t");
}
std::tuple<Tensor, Tensor> qk(const Tensor& q, const Tensor& k, const Tensor& freqs, FUSED_ROPE_ARGS) {
  fused::check_rope_qk_inputs_symint(q, k, freqs, FUSED_ROPE_OPTS);
  return {like(q), like(k)};
}
}  // namespace

TORCH_LIBRARY_IMPL(fused, Meta, m) {
  m.impl("rope_fwd", fwd);
  m.impl("rope_bwd", bwd);
  m.impl("rope_fwd_", fwd_);
  m.impl("rope_fwd_qk", qk);
  m.impl("rope_bwd_qk", qk);
}
