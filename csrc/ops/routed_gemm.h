// The shared core of the routed GEMM ops (linear_dual, ffn; docs/design.md "Routed GEMM ops"):
//  * input checks shared by both ops and every backend (CPU, CUDA, Meta);
//  * on CUDA: routing (perm / seg on the device, no host sync), the experts' weights as the kernels see them, and
//    thin launchers of the AOT-compiled kernels of kernels/routing.py, gather_rows.py, gemm_*.py, grad_weight.py and
//    swiglu_backward.py. Argument lists: the kernels' signatures; grids and the meaning of perm / seg /
//    "expert-ordered padded buffer": kernels/GEMM.md. Variants: aot/manifest.py.
//
// Expert 0 = text (mask false), expert 1 = vision (mask true). A single-expert op (ffn without mask) has only
// expert 0.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernel_decls.h"  // generated: build/aot (aot/cpp_decls.py)
#include "ops/torch_launch.h"

namespace fused {

// ---------------------------------------------------------------------------------------------------------------
// Checks shared by the routed ops. `op` prefixes every message ("linear_dual: ..."), `what` names the argument.
inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// float32 / float16 / bfloat16, and float64 on the CPU (and Meta).
void check_routed_dtype(const at::Tensor& t, const char* op, const char* what);
// Same dtype and device as `ref` (named `ref_what`).
void check_like(const at::Tensor& t, const char* what, const at::Tensor& ref, const char* ref_what, const char* op);
// mask: bool with exactly x's leading shape (x.shape[:-1]).
void check_mask(const at::Tensor& mask, const at::Tensor& x, const char* op);
// A residual (the block's input that the output is added to), if given: x's dtype and device, and the shape `want`
// (named by want_what, e.g. "x's shape").
void check_residual_shape(const std::optional<at::Tensor>& residual, const at::Tensor& x, c10::SymIntArrayRef want,
                          const char* want_what, const char* op);
// Whether two shapes are equal, as a condition for TORCH_SYM_CHECK. The shape checks are written on c10::SymInt
// sizes (sym_sizes) so that the Meta kernels serve tensors of symbolic size (torch.export with Dim, torch.compile
// with dynamic shapes): a condition that follows from how the sizes were made (x's and mask's leading dimensions of
// one Dim) holds for every size and costs nothing; one that does not becomes a guard on the sizes (a recompile, or an
// export error naming the dimension), never a specialization to the traced size. On concrete tensors it is a plain
// comparison.
c10::SymBool sym_equal(c10::SymIntArrayRef a, c10::SymIntArrayRef b);
// The product of x's leading dimensions (the rows M of a routed op), symbolic where x's sizes are.
c10::SymInt leading_rows(const at::Tensor& x);
// A CUDA tensor (the CUDA kernels of the routed ops call this for every tensor argument).
void check_cuda(const at::Tensor& t, const char* what, const char* op);
// The `routing` argument of a routed op for a mask of M tokens, when given: a contiguous 1-D int32 tensor on x's device
// of routed::shared_routing_size(M) elements (the `route` op's result), or with `forward_routing` also of
// routed::routing_buffer_size(M) (linear_dual_forward's). The length pins M; the contents are checked against the
// mask on the CPU only (check_routing_of_mask): on CUDA reading them would sync the host, so they are trusted there.
void check_routing(const std::optional<at::Tensor>& routing, const c10::SymInt& M, const at::Tensor& x, const char* op,
                   bool forward_routing);
// On the CPU: `routing` (checked by check_routing) holds the routing of `mask`, in every entry the kernels read.
void check_routing_of_mask(const at::Tensor& routing, const at::Tensor& mask, const char* op);
// The routing of `mask` computed with ATen on the CPU, the reference of the CUDA routing kernels' result: the aligned
// one (routed::routing_buffer_size(M) entries: linear_dual_forward's routing) or the unaligned one (kSegSlots + M +
// kRowTail entries), -1 in every entry the routing does not use.
at::Tensor routing_cpu(const at::Tensor& mask, bool aligned);
// The `route` op on the CPU: both routings in the shared layout, entry for entry the CUDA op's result.
at::Tensor route_cpu(const at::Tensor& mask);
// x.shape[:-1] + [last]; the _symint one for the Meta kernels (x's sizes may be symbolic).
std::vector<int64_t> with_last(const at::Tensor& x, int64_t last);
std::vector<c10::SymInt> with_last_symint(const at::Tensor& x, const c10::SymInt& last);
// The rows of x [..., C] as an [M, C] matrix whose last dimension has unit stride (a view when possible).
at::Tensor as_rows(const at::Tensor& x);

namespace routed {

// The routing's sizes (kAlign, kRowTail, kChunk, kOneBlock*, kSingleBlock, kSegSlots) and the other constants the
// launchers share with the kernels: generated from kernels/*.py into kernel_decls.h (aot/cpp_decls.py), with every
// kernel's argument struct.

// perm int32 [M_pad] and seg int32 [5] = [0, start_1, end, count_0, count_1] on the device (kernels/GEMM.md).
// aligned: each expert's segment starts at a multiple of kAlign and is padded to one (expert-ordered buffers have
// M_pad rows; every kernel takes it). Unaligned (kernels/routing.py, ALIGN = 1): expert 1 starts at count_0, no
// padding rows (expert-ordered buffers have M rows); only the persistent TMA kernels whose outputs are h or scattered
// rows take it (the ffn forward): not the pointer kernels, not a whole-segment expert-ordered output, not the
// grad-weight.
//
// A routing of M <= kOneBlock rows is deferred to the first kernel that reads it: until then perm and seg are
// allocated but unwritten and `pending` holds the mask. The token-order gather GEMMs (the linear_dual forward, the ffn
// decode gate/up) route it in their own programs, one launch fewer, as does the gather of an unaligned one (the ffn
// forward's x: route_gather_rows_kernel); every other launcher first launches the routing kernel. A launcher that
// consumes it clears `pending` (mutable: the state of the device buffers, not of the routing).
struct Routing {
  at::Tensor perm, seg;
  // route(): the one allocation that holds both, int32: seg, 3 unused slots (perm stays 16-byte aligned), perm; an
  // aligned routing's has routing_buffer_size(M) entries (unused ones after perm), an unaligned one's just
  // kSegSlots + M_pad. The linear_dual forward hands it to its backward (routing_of), which then routes nothing.
  at::Tensor buffer;
  int64_t M = 0, M_pad = 0;
  bool single = false;  // one expert: every row is expert 0, seg[4] == 0
  bool aligned = true;
  bool identity = false;  // route_identity: no perm / seg at all (undefined tensors)
  mutable at::Tensor pending;  // bool [M] contiguous while perm / seg are unwritten
  int64_t rows() const { return aligned ? M_pad : M; }  // rows of an expert-ordered buffer
};

// Two experts from a bool mask [M] (any shape; flattened) on the device: one routing kernel for M <= kOneBlock
// (deferred, see Routing), else two (count, scatter); no host sync.
Routing route(const at::Tensor& mask, bool aligned = true);
// Writes a deferred routing's perm / seg now (one launch); nothing when they are written already.
void ensure_routed(const Routing& r);
// n rounded up to a multiple of kAlign: an expert's padded segment on an aligned routing.
inline int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
// M_pad of an aligned routing of M rows (kernels/routing.py padded_rows): both experts' segments padded to kAlign.
inline int64_t aligned_rows(int64_t M) { return align_up(M) + kAlign; }
// M_pad (perm's length) of a two-expert routing of M rows: aligned_rows(M), or M + kRowTail unaligned (no padding;
// the tail lets a row tile read perm past M).
inline int64_t perm_rows(int64_t M, bool aligned) { return aligned ? aligned_rows(M) : M + kRowTail; }
// The launchers' sizing rules, written in C++ and in Python (each launcher computes its grid from them);
// torch.ops.fused._one_block_size / _decode_split expose these for tests/test_kernel_decls.py, which checks that they
// equal kernels/routing.py one_block_size and kernels/gemm_decode.py decode_split.
// The one-block routing's BLOCK for M rows (the smallest that holds the mask; a decode step takes the 64-lane one),
// 0 past kOneBlock.
int64_t one_block_size(int64_t M);
// The decode GEMM's (n_split, k_split) for n output columns and reduction length k. One split where one expert's
// column tiles (a decode token uses one expert) reach half the SMs: the second kernel that sums the splits would cost
// more than it saves. Below that, enough splits that one expert's programs number about twice the SMs, each split at
// least 4 K blocks (fewer would spend more on the partial sums than they save), at most kDecodeMaxSplits (what
// decode_reduce_kernel sums). k_split is a multiple of the K block.
std::pair<int64_t, int64_t> decode_split(int64_t n, int64_t k, int64_t bn, int64_t bk, int64_t sms);

// The length of Routing::buffer for an aligned routing of M rows: kSegSlots (seg and 3 unused) ahead of perm, then
// M + 2 * kAlign entries hold perm (M_pad <= M + 2 * kAlign - 1), and the length pins M exactly (a routing passed
// back to an op is checked by its size; its contents would need a host sync).
template <typename Int>
Int routing_buffer_size(const Int& M) { return M + (kSegSlots + 2 * kAlign); }
// The shared routing of fused::route (the `route` op): one int32 buffer of shared_routing_size(M) entries that holds
// both routings of a mask, written: the aligned one in routing_buffer_size(M) entries from 0 (the layout of
// linear_dual_forward's routing), then the unaligned one (the ffn forward's on the TMA path) from
// unaligned_section(M), a multiple of 4 entries (its perm stays 16-byte aligned): kSegSlots slots (seg and 3 unused),
// perm of M + kRowTail entries. A model routes its mask once and hands the buffer to every routed op of every layer
// (their `routing` argument), which then route nothing.
// (Templates: the Meta kernels compute these sizes on a symbolic M, c10::SymInt.)
template <typename Int>
Int unaligned_section(const Int& M) { return (M + (kSegSlots + 2 * kAlign + 3)) / 4 * 4; }
// The entries of one unaligned routing (seg's slots, then perm of perm_rows(M, false)): the shared routing's second
// section, and the whole buffer of the ffn forward's own routing.
template <typename Int>
Int unaligned_routing_size(const Int& M) { return M + (kSegSlots + kRowTail); }
template <typename Int>
Int shared_routing_size(const Int& M) { return unaligned_section(M) + unaligned_routing_size(M); }
// Both routings of `mask` into a new shared routing buffer, -1 in every entry they do not write; no host sync. One
// launch up to kOneBlock rows (kernels/routing.py routing_shared_kernel), else a memset and two launches each.
at::Tensor route_shared(const at::Tensor& mask);
// The routing of M rows held in `buffer`, written: the aligned one of a linear_dual_forward routing or of a shared
// routing (aligned = true), or the unaligned one of a shared routing (the caller checked its dtype, device and size).
Routing routing_of(const at::Tensor& buffer, int64_t M, bool aligned = true);
// One expert: perm = [0, 1, .., M-1, -1, ..] and seg = [0, end, end, M, 0], end = roundup(M, kAlign) (aligned) or
// M, written by one launch of routing_single_kernel (no host sync); M_pad = max(end, kAlign), or M + kRowTail.
Routing route_single(int64_t M, const at::Tensor& like, bool aligned = true);
// One expert whose rows stay in token order, with no perm / seg at all: the single-expert forward on the TMA path
// (nothing allocated, nothing launched). Its persistent TMA kernels walk rows [0, M) (the `one_rows` argument; they
// read neither perm nor seg) and write token-order outputs in place. Only swiglu and linear with tma take it, with
// token-order operands that TMA addresses in place (tma_in_place); M_pad = M.
Routing route_identity(int64_t M);

// Per-op launch context: dtype, precision and device (compute capability, SM count).
struct Gemm {
  at::ScalarType dtype;
  std::string dt;    // "bf16" | "fp16" | "fp32"
  std::string prec;  // "ieee" (fp32 without allow_tf32) | "tf32"
  int device = 0, cc = 0, sms = 1;
  static Gemm make(const at::Tensor& like, bool allow_tf32);
  // dtype, precision and compute capability only (no device): what the variant keys and config lookups read.
  static Gemm of(at::ScalarType dtype, bool allow_tf32, int cc);
  // Whether the Hopper TMA kernels serve an op whose operands have the inner (contiguous) sizes `dims`: sm_90,
  // a build holding sm_90 images, TMA variants for this dtype/precision (and the TMA swiglu when `swiglu`), every
  // dim > 0 and a multiple of kHint elements (the TMA kernels' hints), and FUSED_GEMM_TMA not set to 0.
  bool tma_usable(std::initializer_list<int64_t> dims, bool swiglu) const;
  // The part of tma_usable that does not depend on the operands: sm_90, a build with its TMA kernels for this
  // dtype/precision (and the TMA swiglu when `swiglu`).
  bool tma_kernels(bool swiglu) const;
};

// Every variant the routed launchers can ask for on a device of compute capability cc, over every dtype, precision,
// token count and flag combination they pass (formed by the launchers' own key functions). A kernel whose config
// table has no entry for a token count it would be asked for shows as key "no config for m=<m>".
std::vector<VariantRequest> requestable_variants(int cc);

// The two experts' weights of one projection, [R, C] each (nn.Linear layout: R = out features, C = in features).
// The pointer kernels take two base pointers and one shared row stride; the TMA kernels one rank-3 descriptor
// over [E, R, C].
class Experts {
 public:
  // Expert 0 (text) and expert 1 (vision). single: only `text` is used (the only expert; `vision` may be it too).
  Experts(const at::Tensor& text, const at::Tensor& vision, bool single);
  const at::Tensor& text() const { return text_; }
  const at::Tensor& vision() const { return single_ ? text_ : vision_; }
  int64_t rows() const { return text_.size(0); }
  int64_t cols() const { return text_.size(1); }
  int64_t ld() const { return ld_; }  // row stride (elements) shared by both experts
  bool single() const { return single_; }
  // Makes both experts contiguous (row stride = cols), e.g. to share one stride with another projection.
  void make_contiguous();

  // The rank-3 TMA view: shape [E, R, C], strides [stride_e, ld, 1] (elements), from `base`, the lower of the two
  // weights; `map` says which index holds which expert (kernels/gemm_tma.py _w_index: bit e = the index of expert e;
  // 2 = [text, vision], 1 = [vision, text], 0 = both experts are the one weight at index 0, also the single expert's).
  // Zero-copy, whichever expert lies lower in memory, when both bases and the row stride are 16-byte aligned and the
  // experts are |vision - text| apart (a multiple of 16 bytes, rows not overlapping, below TMA's 2^40-byte stride
  // limit) or the same tensor: views of one [2, R, C] tensor in either expert order, or two separate tensors. Otherwise
  // the experts are stacked into a new [2, R, C] tensor: a copy of both weights per call (2*R*C elements), kept for the
  // rest of the op (e.g. reused by the grad-input and the forward GEMMs of one call).
  struct Stacked {
    const void* base;
    int64_t experts, stride_e, ld;
    int map;
    // The rank-3 tensor descriptor [experts, rows, cols] over it (the TMA kernels' W).
    DescArg desc(int64_t rows, int64_t cols) const { return {base, {experts, rows, cols}, {stride_e, ld, 1}}; }
  };
  const Stacked& stacked();
  bool stacked_by_copy() const { return stack_.defined(); }
  // The stacked view of a contiguous [E, R, C] tensor in the canonical order (stride_e = R * C, ld = C, text first;
  // E = 1 only for a single expert): stacked() where it already is that, else a copy. Two projections of one shape
  // then share one expert stride, row stride and order (the paired gate/up kernels take one descriptor over both).
  const Stacked& stacked_contiguous();

 private:
  const Stacked& stack_by_copy();  // [E, R, C] contiguous copy of the experts
  at::Tensor text_, vision_, stack_;
  bool single_;
  int64_t ld_;
  std::optional<Stacked> st_;
};

// Whether TMA can read the rows of `t` ([M, C], unit inner stride) where they are: 16-byte aligned base and row stride.
bool tma_in_place(const at::Tensor& t);

// A row operand or result of a routed GEMM: in token order ([M, C], rows through perm) or an expert-ordered
// buffer ([Routing::rows(), C], row r belongs to perm[r]). The last dimension must have unit stride.
struct Rows {
  at::Tensor t;
  bool expert_ordered;
};
inline Rows tokens(const at::Tensor& t) { return {t, false}; }
inline Rows ordered(const at::Tensor& t) { return {t, true}; }

// dst[r] = src[perm[r]] (zero rows where perm[r] < 0): token-order src [M, C] -> expert-ordered [r.rows(), C], a new
// tensor or, when `into` is defined, a view of its storage (contiguous, at least r.rows() * C elements of src's
// dtype; e.g. the op's output, whose rows are written only after the gathered rows were last read).
at::Tensor gather_rows(const Gemm& g, const Routing& r, const at::Tensor& src, const at::Tensor& into = at::Tensor());
// gather_rows of a two-expert routing, and sum_e = the sum of src's rows of expert e ([C] each, dtype of src, fp32
// accumulation in a fixed order): the bias gradients from the gather of dY, with no second pass over it. An
// undefined sum_e is not returned (at least one must be defined).
at::Tensor gather_rows_and_sum(const Gemm& g, const Routing& r, const at::Tensor& src, const at::Tensor& sum0,
                               const at::Tensor& sum1);

// out = a · W_eᵀ (+ bias_e)  (w_transposed = false; W_e [N, K], a [., K], out [., N]), or
// out = a · W_e           (w_transposed = true, grad-input; W_e [K_red, N], a [., K_red], out [., N]).
// tma: the sm_90 kernel (a in token order is gathered first into an expert-ordered buffer, except for a single
// expert, whose token order is the expert order: then a is read in place when TMA can address it); else the pointer kernel
// (a gathered through perm when in token order). bias0/bias1: both defined or both undefined, [N], dtype of a.
// Rows [end, M_pad) of an expert-ordered out are not written; its other padding rows get bias_e (0 without bias).
// residual, when defined: added in the epilogue (out = a · W_eᵀ (+ bias_e) + residual, one rounding), a tensor of out's
// shape and strides, read at the rows out is written, which may be out itself (each element is read by the program
// that writes it); into token-order rows only: the forward (linear_dual's and the ffn down projection's `residual`: a
// transformer block's residual add) and the grad-input (the ffn backward's dx = dgate·W1 + dup·W3).
void linear(const Gemm& g, const Routing& r, const Rows& a, Experts& w, const at::Tensor& bias0,
            const at::Tensor& bias1, const Rows& out, bool w_transposed, bool tma,
            const at::Tensor& residual = at::Tensor());

// The linear forward of a few tokens (kernels/gemm_decode.py), with no routing: out[i] = x[i] · W_eᵀ (+ bias_e)
// (+ residual[i]), e the expert of mask[i], for x [M, K] in token order (unit inner stride), mask bool [M] contiguous,
// w_text / w_vision [N, K] each with its own row stride (no copy in any layout), bias0 / bias1 and residual as for
// linear, out [M, N]. Where its table has a bucket for M (aot/configs/: a decode step's token counts) it launches the
// GEMM with its reduction split over the grid (and, for more than one split, the in-order sum of the splits) and
// returns true; elsewhere it launches nothing and returns false (the caller routes and takes linear).
bool decode_linear(const Gemm& g, const at::Tensor& x, const at::Tensor& mask, const at::Tensor& w_text,
                   const at::Tensor& w_vision, const at::Tensor& bias0, const at::Tensor& bias1, const at::Tensor& out,
                   const at::Tensor& residual = at::Tensor());

// h = silu(a · W1_eᵀ) * (a · W3_eᵀ) into an expert-ordered h [r.rows(), I]; a [., H]; W1_e, W3_e [I, H]. Rows of h
// that belong to no token are not written.
// Pointer kernel: a in token order. TMA: a in token order is read in place for a single expert (as in linear),
// gathered inside the GEMM where the table says so, else gathered first (gather_rows into `gather_into`).
// gate_up, when defined ([M, 2I], unit inner stride, h's dtype): also gets the pre-activations in token order,
// gate_up[t] = [a_t · W1_eᵀ, a_t · W3_eᵀ] (the activations the ffn backward reads instead of recomputing them).
void swiglu(const Gemm& g, const Routing& r, const Rows& a, Experts& gate, Experts& up, const at::Tensor& h, bool tma,
            const at::Tensor& gather_into = at::Tensor(), const at::Tensor& gate_up = at::Tensor());

// The ffn backward's gate/up recompute fused with the SwiGLU backward (routed_swiglu_pair_bwd_tma_kernel), where the
// pair kernel serves m (sm_90 table) and W1 / W3 allow its rank-4 descriptor: from expert-ordered x [M_pad, H] (aligned
// routing, zero padding rows) and dh, held in dgate on entry: h, d_up and d_gate (over dh), all [M_pad, I] of one row
// stride, padding rows below end zero. Returns false, launching nothing, where it does not serve.
bool swiglu_backward_pair(const Gemm& g, const Routing& r, const at::Tensor& x, Experts& gate, Experts& up,
                          const at::Tensor& h, const at::Tensor& dup, const at::Tensor& dgate);

// The SwiGLU backward, one elementwise pass (swiglu_backward_kernel), fp32 math: h = silu(gate) * up, d_up, and d_gate
// over dh. h, dup and dh are contiguous [rows, I]. gate / up: [., I] views of one row stride, read at row perm[r]
// (perm defined: the saved gate_up in token order, into expert-ordered buffers) or r; they may be h and dup
// themselves (in place: the recomputed gate and up).
void swiglu_backward(const Gemm& g, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dh,
                     const at::Tensor& h, const at::Tensor& dup, const at::Tensor& perm);

// dW_e = dy_eᵀ · x_e ([N, K]) and, when db0 is defined, db_e = Σ dy_e ([N]) for e = 0 (dw0, db0) and e = 1 (dw1,
// db1; not touched for a single-expert routing). dy [., N] and x [., K] both in token order or both expert-ordered.
// Outputs in the input dtype (fp32 accumulation over all rows of the expert), every element written.
// tma: the sm_90 kernel, which needs both operands expert-ordered with zero padding rows (gather_rows, or outputs of
// expert-ordered GEMMs without bias), and sums no bias (db0 undefined; gather_rows_and_sum gives db).
// An undefined output is not computed: an expert with neither dW_e nor db_e defined launches no programs (a frozen
// expert costs nothing); at least one expert must have one. A single-expert routing has expert 0 only.
void grad_weight(const Gemm& g, const Routing& r, const Rows& dy, const Rows& x, const at::Tensor& dw0,
                 const at::Tensor& dw1, const at::Tensor& db0, const at::Tensor& db1, bool tma);

}  // namespace routed
}  // namespace fused
