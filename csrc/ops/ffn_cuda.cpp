// CUDA implementation of ffn on the routed GEMM core (csrc/ops/routed_gemm.h).
//
// Forward: route (mask: the routing kernels, or for M <= 4096 on the TMA path the x gather's own programs; single
//   expert: none on the TMA path, else perm = arange) ->
//   h = routed_swiglu(x) into an expert-ordered buffer -> out = routed_linear(h, w2) scattered back (+ the residual,
//   when given, added in that GEMM's epilogue).
//   TMA (sm_90, H and I multiples of 16 elements, a TMA swiglu for the dtype/precision): an unaligned routing (no
//   padding rows), so h is exactly [M, I], the only buffer of the size of the intermediate. A routing given (the
//   route op's, shared by the model's routed ops) is read, not recomputed; its unaligned section. Where x's rows are
//   gathered before the gate/up GEMM (dual expert above the decode sizes; docs/perf.md), they go into out's storage:
//   out [M, H] is written only by the down projection, after the gate/up GEMM has read them (stream order; with
//   programmatic dependent launch, the down kernel's griddepcontrol.wait). Peak extra memory: M * I elements plus
//   perm / seg (4 bytes per token) when the op routes the mask itself, M * I elements given a routing. A single
//   expert whose x TMA reads in place has no routing (route_identity): h is the only allocation.
//   Pointer kernels otherwise (x gathered through perm inside the swiglu kernel; h [M_pad, I] on the aligned
//   routing they need).
//
// ffn_forward: the same, and the gate/up kernel's epilogue also stores gate and up (fp32 accumulators rounded to the
//   dtype) into gate_up [M, 2I] in token order (kernels/gemm_tiles.py _save_gate_up): 2 * M * I more elements written.
//
// Backward. Gate and up come from one of two places (ffn's `recompute`):
//  * saved (the default): gate_up from ffn_forward, kept by autograd from the forward: 2 * M * I elements per layer,
//    half of what a plain PyTorch SwiGLU MLP keeps (gate, silu(gate), up and h). The backward then runs only the six
//    GEMMs the gradients need (forward + backward 9 passes of 2*M*H*I flops).
//  * recomputed: the forward keeps only its inputs (x, which is saved anyway, and the weights); the backward computes
//    gate and up again: two more GEMM passes (8 in the backward instead of 6, ~1.2x the flops of forward + backward).
// Then:
//   dh = dy·w2                                          (routed_linear)
//   h, dgate, dup from gate, up, dh                     (one elementwise kernel, fp32 math; saved: gate and up read
//                                                        from gate_up, through perm into expert order on TMA)
//   (recompute on the TMA path, where the paired gate/up GEMM serves: gate and up from one GEMM whose epilogue
//   computes h, dgate, dup directly, reading dh: gate and up are never stored)
//   dw2 = dyᵀ·h, dw1 = dgateᵀ·x, dw3 = dupᵀ·x           (routed_grad_weight, per expert)
//   dx = dgate·w1 + dup·w3                              (two routed_linear grad-input passes, the second adding
//                                                        the first's output in its epilogue)
//   TMA path: x and dy are gathered once and every intermediate is expert-ordered ([M_pad, .]); pointer path:
//   intermediates in token order ([M, .]), rows gathered / scattered through perm inside the kernels.
//   output_mask: the grad-weight GEMMs run only for the weights asked for (one expert's programs where the other is
//   frozen), the grad-input GEMMs only for grad_x; the recompute (dh, h, dup, dgate) always.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <torch/library.h>

#include "ops/ffn.h"
#include "ops/routed_gemm.h"

namespace fused {
namespace {
constexpr const char* kOp = "ffn";
constexpr int64_t kDualPdlMaxRows = 2048;  // the dual forward launches with PDL up to this many tokens

void check_all_cuda(const at::Tensor& x, FUSED_FFN_ARGS) {
  check_cuda(x, "x", kOp);
  check_cuda(w1, "w1", kOp);
  check_cuda(w3, "w3", kOp);
  check_cuda(w2, "w2", kOp);
  if (present(mask)) check_cuda(*mask, "mask", kOp);
  if (present(u1)) check_cuda(*u1, "u1", kOp);
  if (present(u3)) check_cuda(*u3, "u3", kOp);
  if (present(u2)) check_cuda(*u2, "u2", kOp);
  (void)allow_tf32;
}

// The three projections as the kernels see them: expert 0 = text (u*) for the dual expert, the only expert (w*)
// for the single one; expert 1 = vision (w*).
struct Projections {
  routed::Experts gate, up, down;
};
Projections projections(const FfnGeometry& geo, FUSED_FFN_ARGS) {
  (void)mask;
  (void)allow_tf32;
  if (!geo.dual) return {routed::Experts(w1, w1, true), routed::Experts(w3, w3, true), routed::Experts(w2, w2, true)};
  if (geo.stacked)  // views of the [2, R, C] tensors: the kernels read them in place (Experts::stacked)
    return {routed::Experts(w1[0], w1[1], false), routed::Experts(w3[0], w3[1], false),
            routed::Experts(w2[0], w2[1], false)};
  return {routed::Experts(*u1, w1, false), routed::Experts(*u3, w3, false), routed::Experts(*u2, w2, false)};
}

// ffn's output (+ residual, added in the down projection's epilogue), and with `save` gate_up (ffn_forward).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, FUSED_FFN_ARGS,
                                           const std::optional<at::Tensor>& routing,
                                           const std::optional<at::Tensor>& residual, bool save) {
  check_all_cuda(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32);
  if (present(residual)) check_cuda(*residual, "residual", kOp);
  const FfnGeometry geo = check_ffn_inputs(x, w1, w3, w2, mask, u1, u3, u2, routing);
  check_residual(residual, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({geo.M, geo.H}, x.options());
  // The residual's rows in out's layout ([M, H], row stride H): the epilogue reads it where it writes out.
  at::Tensor res;
  if (present(residual)) res = as_rows(*residual).contiguous();
  at::Tensor gate_up = save ? at::empty({geo.M, 2 * geo.I}, x.options()) : at::Tensor();
  const auto result = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    return {out.view(x.sizes()), save ? gate_up.view(with_last(x, 2 * geo.I)) : gate_up};
  };
  if (geo.M == 0 || geo.H == 0) {
    if (save) gate_up.zero_();  // x·wᵀ over H = 0 columns
    return result();
  }
  if (geo.I == 0) {
    if (res.defined()) out.copy_(res);
    else out.zero_();
    return result();
  }

  const routed::Gemm g = routed::Gemm::make(x, allow_tf32);
  const bool tma = g.tma_usable({geo.H, geo.I}, /*swiglu=*/true);
  // The dual expert's x gather -> gate/up -> down measured 2-3.5% slower with programmatic dependent launch at 4096
  // tokens (paired on / off, H100; two random masks, and a 90% mask in one of two runs; no change single-expert, and
  // 0.3-0.7% faster with it at 1024 / 2048 tokens): launched without it above kDualPdlMaxRows.
  std::optional<NoProgrammaticLaunch> no_pdl;
  if (geo.dual && geo.M > kDualPdlMaxRows) no_pdl.emplace();
  const at::Tensor xr = as_rows(x);
  // A single expert on the TMA path whose x TMA reads in place needs no routing at all, nor does a dual expert given
  // one (the routing section its path reads): h is then the forward's only allocation.
  const routed::Routing r = geo.dual ? (present(routing) ? routed::routing_of(*routing, geo.M, /*aligned=*/!tma)
                                                         : routed::route(*mask, /*aligned=*/!tma))
                            : (tma && routed::tma_in_place(xr)) ? routed::route_identity(geo.M)
                                                                : routed::route_single(geo.M, x, /*aligned=*/!tma);
  Projections p = projections(geo, w1, w3, w2, mask, u1, u3, u2, allow_tf32);
  // Rows of h that belong to no token (padding of an aligned routing) are never written, and the down projection
  // does not store what it computes from them: no initialization needed.
  at::Tensor h = at::empty({r.rows(), geo.I}, x.options());
  routed::swiglu(g, r, routed::tokens(xr), p.gate, p.up, h, tma, /*gather_into=*/out, gate_up);
  routed::linear(g, r, routed::ordered(h), p.down, at::Tensor(), at::Tensor(), routed::tokens(out),
                 /*w_transposed=*/false, tma, res);
  return result();
}
}  // namespace

at::Tensor ffn_cuda(const at::Tensor& x, FUSED_FFN_ARGS, const std::optional<at::Tensor>& routing, bool recompute,
                    const std::optional<at::Tensor>& residual) {
  (void)recompute;
  return std::get<0>(forward(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, residual, /*save=*/false));
}

std::tuple<at::Tensor, at::Tensor> ffn_forward_cuda(const at::Tensor& x, FUSED_FFN_ARGS,
                                                    const std::optional<at::Tensor>& routing,
                                                    const std::optional<at::Tensor>& residual) {
  return forward(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, residual, /*save=*/true);
}

FfnGrads ffn_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, FUSED_FFN_ARGS,
                           FfnOutputMask output_mask, const std::optional<at::Tensor>& routing,
                           const std::optional<at::Tensor>& gate_up) {
  check_all_cuda(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32);
  check_cuda(grad_out, "grad_out", kOp);
  const FfnGeometry geo = check_ffn_backward_inputs(grad_out, x, w1, w3, w2, mask, u1, u3, u2, routing);
  const bool saved = present(gate_up);
  if (saved) check_gate_up(*gate_up, x, geo.I, "ffn_backward");
  c10::cuda::CUDAGuard guard(x.device());
  const auto opt = x.options();
  // Per expert e (0 = text, 1 = vision; single: 0 only): grad of the gate, up and down weights where asked for
  // (output_mask: vision = w* at 1..3, text = u* at 4..6; the single expert's w* at 1..3). Each gradient is
  // allocated just before the GEMM that writes it, and each intermediate freed after its last reader: the peak of
  // the backward is then about 3 [M_pad, I] buffers and dw2, or 2 of them and every weight gradient, not all at once.
  // Stacked weights: one [2, ...] gradient per projection (output_mask 1..3), whose halves the kernels write.
  at::Tensor dw1[2], dw3[2], dw2[2], gx, stacked[3];
  const int64_t E = geo.dual ? 2 : 1;
  const auto wanted = [&](int64_t e, int j) { return output_mask[ffn_grad_slot(geo, static_cast<int>(e), j)]; };
  const auto allocate = [&](at::Tensor (&t)[2], int j, at::IntArrayRef size) {
    if (geo.stacked) {
      if (!wanted(0, j)) return;
      stacked[j] = at::empty({2, size[0], size[1]}, opt);
      t[0] = stacked[j][0];
      t[1] = stacked[j][1];
      return;
    }
    for (int64_t e = 0; e < E; ++e)
      if (wanted(e, j)) t[e] = at::empty(size, opt);
  };
  auto result = [&]() -> FfnGrads {  // into the op's slots
    FfnGradArray out;
    out[kGradX] = gx;
    const at::Tensor* per_proj[3] = {dw1, dw3, dw2};  // FfnProj order
    for (int64_t e = 0; e < E; ++e)
      for (int proj : {kGate, kUp, kDown})
        out[ffn_grad_slot(geo, static_cast<int>(e), proj)] = geo.stacked ? stacked[proj] : per_proj[proj][e];
    return to_tuple(out);
  };
  const auto any = [&](int j) { return wanted(0, j) || (E == 2 && wanted(1, j)); };
  const bool want_dw1 = any(kGate), want_dw3 = any(kUp), want_dw2 = any(kDown);
  if (!output_mask[kGradX] && !want_dw1 && !want_dw3 && !want_dw2) return result();
  if (geo.M == 0 || geo.H == 0 || geo.I == 0) {  // every gradient is zero (or empty)
    if (output_mask[kGradX]) gx = at::zeros(x.sizes(), opt);
    allocate(dw1, kGate, {geo.I, geo.H});
    allocate(dw3, kUp, {geo.I, geo.H});
    allocate(dw2, kDown, {geo.H, geo.I});
    for (at::Tensor* t : {&dw1[0], &dw1[1], &dw3[0], &dw3[1], &dw2[0], &dw2[1]})
      if (t->defined()) t->zero_();
    return result();
  }

  const routed::Gemm g = routed::Gemm::make(x, allow_tf32);
  const routed::Routing r = !geo.dual           ? routed::route_single(geo.M, x)
                            : present(routing) ? routed::routing_of(*routing, geo.M)
                                               : routed::route(*mask);
  Projections p = projections(geo, w1, w3, w2, mask, u1, u3, u2, allow_tf32);
  const bool tma = g.tma_usable({geo.H, geo.I}, /*swiglu=*/false);
  const at::Tensor xr = as_rows(x), dyr = as_rows(grad_out);
  // TMA: expert-ordered operands (gathered once); pointer: token order, rows through perm inside the kernels. A
  // single expert whose M is a multiple of the routing's ALIGN has no padding rows, so its token order is already
  // the expert-ordered buffer: x and dy serve in place where TMA can read them there (no gather copies).
  const bool in_place = tma && !geo.dual && r.M_pad == geo.M;
  const auto expert_ordered = [&](const at::Tensor& t) {
    return !tma || (in_place && routed::tma_in_place(t)) ? t : routed::gather_rows(g, r, t);
  };
  at::Tensor xa = expert_ordered(xr);
  at::Tensor dya = expert_ordered(dyr);
  const int64_t rows = tma ? r.M_pad : geo.M;
  auto as = [&](const at::Tensor& t) { return routed::Rows{t, tma}; };
  const at::Tensor none;

  // gate, up and dh, then (in place) h, dup and dgate. Rows [end, M_pad) of these expert-ordered buffers are never
  // written; the elementwise pass computes garbage there that no kernel reads (tiles past `end` are skipped,
  // grad-weight reads only the experts' rows). Every gradient asked for needs dgate or dup (or h, for dw2), so this
  // part runs whatever the output_mask.
  at::Tensor h = at::empty({rows, geo.I}, opt), dup = at::empty({rows, geo.I}, opt);
  at::Tensor dgate = at::empty({rows, geo.I}, opt);
  routed::linear(g, r, as(dya), p.down, none, none, as(dgate), /*w_transposed=*/true, tma);  // dh = dy·w2_e
  if (saved) {
    // gate and up from the forward, token order: read through perm into the expert-ordered buffers (TMA), or in
    // place (the pointer path's buffers are in token order).
    const at::Tensor gu = as_rows(*gate_up);
    routed::ensure_routed(r);
    routed::swiglu_backward(g, gu.narrow(1, 0, geo.I), gu.narrow(1, geo.I, geo.I), dgate, h, dup, tma ? r.perm : none);
  } else if (!(tma && routed::swiglu_backward_pair(g, r, xa, p.gate, p.up, h, dup, dgate))) {
    // Recompute. On the TMA path, where the paired gate/up GEMM serves, gate and up are turned into h, d_up and
    // d_gate in its epilogue (never stored: two [M_pad, I] writes and the elementwise pass's reads of them saved).
    routed::linear(g, r, as(xa), p.gate, none, none, as(h), /*w_transposed=*/false, tma);  // gate = x·w1_eᵀ
    routed::linear(g, r, as(xa), p.up, none, none, as(dup), /*w_transposed=*/false, tma);  // up = x·w3_eᵀ
    routed::swiglu_backward(g, h, dup, dgate, h, dup, none);
  }
  // Weight gradients: only the experts' asked for launch programs (routed::grad_weight skips an undefined output).
  // Order: dw2 (the last reader of h and dy), dx, dw1 (the last of dgate), dw3 (the last of dup and x).
  if (want_dw2) {
    allocate(dw2, kDown, {geo.H, geo.I});
    routed::grad_weight(g, r, as(dya), as(h), dw2[0], dw2[1], none, none, tma);  // dw2_e = dy_eᵀ·h_e
  }
  h.reset();
  dya.reset();
  if (output_mask[kGradX]) {  // dx = dgate·w1_e + dup·w3_e
    gx = at::empty(x.sizes(), opt);
    at::Tensor gx2 = gx.view({geo.M, geo.H});
    routed::linear(g, r, as(dgate), p.gate, none, none, routed::tokens(gx2), /*w_transposed=*/true, tma);
    // the second GEMM adds the first's result in its epilogue, in place: no [M, H] temporary, no add pass
    routed::linear(g, r, as(dup), p.up, none, none, routed::tokens(gx2), /*w_transposed=*/true, tma, gx2);
  }
  if (want_dw1) {
    allocate(dw1, kGate, {geo.I, geo.H});
    routed::grad_weight(g, r, as(dgate), as(xa), dw1[0], dw1[1], none, none, tma);  // dgate_eᵀ·x_e
  }
  dgate.reset();
  if (want_dw3) {
    allocate(dw3, kUp, {geo.I, geo.H});
    routed::grad_weight(g, r, as(dup), as(xa), dw3[0], dw3[1], none, none, tma);  // dup_eᵀ·x_e
  }
  return result();
}

}  // namespace fused

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("ffn", fused::ffn_cuda);
  m.impl("ffn_forward", fused::ffn_forward_cuda);
  m.impl("ffn_backward", fused::ffn_backward_cuda);
}
