// CUDA core of the routed GEMM ops: routing and launchers of the AOT-compiled kernels (kernels/GEMM.md).
//
// Variant keys are built here exactly as aot/manifest.py's Variant.key_str ("name=value" pairs sorted by name). The
// block config is part of the keys ("cfg=128x256x64_g8_w8_s3") and the grids are computed from the same table entry,
// so a grid cannot silently disagree with the compiled kernel: a drift fails with "no compiled variant ... for <key>".
#include "ops/routed_gemm.h"


#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "ops/torch_launch.h"
#include "runtime/kernel_configs.h"
#include "runtime/launcher.h"

namespace fused {
namespace routed {
namespace {

std::string make_key(std::initializer_list<std::pair<const char*, std::string>> kv) {
  std::map<std::string, std::string> sorted;
  for (const auto& p : kv) sorted.emplace(p.first, p.second);
  std::string key;
  for (const auto& [k, v] : sorted) key += (key.empty() ? "" : ",") + k + "=" + v;
  return key;
}

std::string flag(bool b) { return b ? "1" : "0"; }

Grid grid(int64_t x, int64_t y = 1) {
  TORCH_CHECK(x >= 0 && x <= std::numeric_limits<int32_t>::max() && y >= 0 && y <= 65535,
              "routed GEMM: problem too large for one launch (grid ", x, " x ", y, ")");
  return Grid{static_cast<uint32_t>(x), static_cast<uint32_t>(y), 1};
}

// ---- block configs: the bucket table generated from aot/configs/sm<arch>.json (runtime/kernel_configs.h). The grid
// is computed from the same entry whose "cfg=" goes into the key.
const char* family(const Gemm& g) {
  if (g.dt != "fp32") return "half";
  return g.prec == "tf32" ? "tf32" : "ieee";
}
// n, k: the GEMM's output columns and reduction length (the grad-weight kernels: the weight's [n, k]), and wt the
// linear GEMMs' orientation (1: the grad-input, W transposed; 0: the forward): the keys of the table's shape classes.
const KernelConfig& config(const Gemm& g, const char* kernel, int64_t m, int64_t n, int64_t k, int wt = -1) {
  return kernel_config(kernel, family(g), g.cc, m, n, k, wt);
}

// gather_rows_kernel's BLOCK_R and BLOCK_C (kGatherRows, kGatherCols, kGatherColsColsum: kernel_decls.h) are in its
// keys as "rows" and "cols": a grid computed with other values finds no compiled variant.
static_assert(kAlign % kGatherRows == 0, "a block of gather_rows' column sums must not mix experts");

// ---- variant keys: one function per kernel forms every key its launcher asks for. Where a key has flags, the
// combinations compiled are aot/manifest.py's FLAG_SETS, which the generated table holds (kFlagSets): the key function
// asserts that a launcher's request is one of them, and requestable_variants() (end of file) forms every key from
// them, so that the build checks that each one's configs and routings are compiled (setup.py;
// tests/test_variant_check.py). Flags go in FLAG_SETS' order (the key functions' parameter order), the first highest.
const FlagSet& flag_set(const char* kernel) {
  const FlagSet* found = nullptr;
  for (size_t i = 0; i < kNumFlagSets && !found; ++i)
    if (std::strcmp(kFlagSets[i].kernel, kernel) == 0) found = &kFlagSets[i];
  TORCH_INTERNAL_ASSERT(found, "routed GEMM: aot/manifest.py FLAG_SETS has no entry for ", kernel);
  return *found;
}
std::string listed_key(int flags, const char* kernel, std::string key) {
  const FlagSet& s = flag_set(kernel);
  TORCH_INTERNAL_ASSERT(std::find(s.combos, s.combos + s.num_combos, flags) != s.combos + s.num_combos,
                        "routed GEMM: ", kernel, " asked for flags ", flags,
                        " that aot/manifest.py FLAG_SETS does not list (add them there)");
  return key;
}
int bits(std::initializer_list<bool> flags) {
  int b = 0;
  for (bool f : flags) b = b << 1 | (f ? 1 : 0);
  return b;
}
// Flag f (0 = the first, highest) of a combination of n flags.
bool flag_bit(int combo, int n, int f) { return (combo >> (n - 1 - f)) & 1; }
std::string align_str(bool aligned) { return std::to_string(aligned ? kAlign : 1); }

// routed_linear_kernel (gather, scatter, wt): the operand paths of aot/manifest.py FLAG_SETS. The linear GEMMs'
// epilogue (bias, residual) is not in their keys: it is a runtime argument of one image (has_bias, has_residual).
std::string linear_key(const Gemm& g, bool gather, bool scatter, bool wt, const KernelConfig& c) {
  return listed_key(bits({gather, scatter, wt}), "routed_linear_kernel",
                    make_key({{"dtype", g.dt}, {"prec", g.prec}, {"gather", flag(gather)}, {"scatter", flag(scatter)},
                              {"wt", flag(wt)}, {"cfg", c.cfg}}));
}
// routed_linear_tma_kernel (scatter, wt): the same with expert-ordered A (FLAG_SETS).
std::string linear_tma_key(const Gemm& g, bool scatter, bool wt, const KernelConfig& c) {
  return listed_key(bits({scatter, wt}), "routed_linear_tma_kernel",
                    make_key({{"dtype", g.dt}, {"prec", g.prec}, {"scatter", flag(scatter)}, {"wt", flag(wt)},
                              {"cfg", c.cfg}}));
}
// The token-order gather GEMMs also route a deferred routing: route = its one-block size, 0 when routed already.
std::string linear_gather_tma_key(const Gemm& g, const KernelConfig& c, int64_t route, bool aligned) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"cfg", c.cfg}, {"route", std::to_string(route)},
                   {"align", align_str(aligned)}});
}
std::string swiglu_gather_tma_key(const Gemm& g, bool save, const KernelConfig& c, int64_t route, bool aligned) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"cfg", c.cfg}, {"route", std::to_string(route)},
                   {"align", align_str(aligned)}, {"save", flag(save)}});
}
std::string swiglu_key(const Gemm& g, bool save, const KernelConfig& c) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"gather", "1"}, {"scatter", "0"}, {"save", flag(save)},
                   {"cfg", c.cfg}});
}
std::string swiglu_tma_key(const Gemm& g, bool save, const KernelConfig& c) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"scatter", "0"}, {"save", flag(save)}, {"cfg", c.cfg}});
}
std::string swiglu_pair_key(const Gemm& g, bool save, const KernelConfig& c) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"save", flag(save)}, {"cfg", c.cfg}});
}
std::string swiglu_pair_bwd_key(const Gemm& g, const KernelConfig& c) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"cfg", c.cfg}});
}
std::string grad_weight_tma_key(const Gemm& g, const KernelConfig& c) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"cfg", c.cfg}});
}
// routed_grad_weight_kernel (gather, dbias): token-order dy / x (linear_dual, the pointer ffn backward).
std::string grad_weight_key(const Gemm& g, bool gather, bool dbias, const KernelConfig& c) {
  return listed_key(bits({gather, dbias}), "routed_grad_weight_kernel",
                    make_key({{"dtype", g.dt}, {"prec", g.prec}, {"gather", flag(gather)}, {"dbias", flag(dbias)},
                              {"cfg", c.cfg}}));
}
std::string decode_linear_key(const Gemm& g, const KernelConfig& c) {
  return make_key({{"dtype", g.dt}, {"prec", g.prec}, {"cfg", c.cfg}});
}
// decode_reduce_kernel's BLOCK_N and MAX_SPLITS (kDecodeReduceCols, kDecodeMaxSplits: kernel_decls.h) are in its key
// as "cols" and "splits".
std::string decode_reduce_key(const Gemm& g) {
  return make_key({{"dtype", g.dt}, {"cols", std::to_string(kDecodeReduceCols)},
                   {"splits", std::to_string(kDecodeMaxSplits)}});
}
std::string gather_rows_key(const Gemm& g, bool colsum) {
  return make_key({{"dtype", g.dt}, {"colsum", flag(colsum)}, {"rows", std::to_string(kGatherRows)},
                   {"cols", std::to_string(colsum ? kGatherColsColsum : kGatherCols)}});
}
std::string route_gather_rows_key(const Gemm& g, int64_t block) {
  return make_key({{"dtype", g.dt}, {"block", std::to_string(block)}, {"rows", std::to_string(kGatherRows)},
                   {"cols", std::to_string(kGatherCols)}});
}
std::string expert_colsum_key(const Gemm& g) {
  return make_key({{"dtype", g.dt}, {"rows", std::to_string(kGatherRows)}});
}
std::string swiglu_backward_key(const Gemm& g, bool gather) {
  return make_key({{"dtype", g.dt}, {"gather", flag(gather)}});
}
std::string routing_one_block_key(bool aligned, int64_t block) {
  return make_key({{"align", align_str(aligned)}, {"block", std::to_string(block)}});
}
std::string routing_shared_key(int64_t block) { return make_key({{"block", std::to_string(block)}}); }
std::string routing_count_key() { return make_key({{"chunk", std::to_string(kChunk)}}); }
std::string routing_scatter_key(bool aligned) {
  return make_key({{"chunk", std::to_string(kChunk)}, {"align", align_str(aligned)}});
}
std::string routing_single_key(bool aligned) {
  return make_key({{"align", align_str(aligned)}, {"block", std::to_string(kSingleBlock)}});
}

// Internal invariants of a row operand (the ops guarantee them; a failure is a bug here, not a user error).
void check_rows(const Routing& r, const Rows& x, int64_t cols, const char* what) {
  TORCH_INTERNAL_ASSERT(x.t.dim() == 2 && x.t.size(0) == (x.expert_ordered ? r.rows() : r.M) && x.t.size(1) == cols &&
                            (cols <= 1 || x.t.stride(1) == 1),
                        "routed GEMM: bad ", what, " operand ", x.t.sizes(), " / ", x.t.strides(), " (M = ", r.M,
                        ", expert-ordered rows = ", r.rows(), ", expected ", cols, " columns)");
}

// An upper bound of the row tiles of BLOCK_M rows a persistent kernel walks (cdiv(count_0, bm) + cdiv(count_1, bm)):
// it caps the grid; the programs take the tile count itself from seg.
int64_t max_row_tiles(const Routing& r, int64_t bm) { return r.aligned ? r.M_pad / bm : cdiv(r.M, bm) + 1; }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// Rows [M, C] that a TMA kernel reads by pointer (a gather inside the GEMM): its hints need a 16-byte aligned base
// and a row stride that is a multiple of 16 elements.
bool hinted_rows(const at::Tensor& t) { return aligned16(t.data_ptr()) && t.stride(0) % kHint == 0; }
// A bias or residual for a TMA kernel: itself when 16-byte aligned, else an aligned copy (a user's odd view).
at::Tensor hinted_copy(const at::Tensor& t) {
  return !t.defined() || aligned16(t.data_ptr()) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// A residual read with out's row stride (the kernels take one): the same sizes and dtype, and the same strides where
// they are used (a size-1 dimension's stride never is).
bool same_rows(const at::Tensor& residual, const at::Tensor& out) {
  return residual.sizes() == out.sizes() && residual.scalar_type() == out.scalar_type() && out.dim() == 2 &&
         (out.size(0) <= 1 || residual.stride(0) == out.stride(0)) &&
         (out.size(1) <= 1 || residual.stride(1) == out.stride(1));
}

int64_t row_stride(const at::Tensor& w) { return w.size(0) > 1 ? w.stride(0) : w.size(1); }

at::Tensor unit_inner(const at::Tensor& w) { return (w.size(1) > 1 && w.stride(1) != 1) ? w.contiguous() : w; }

}  // namespace

// ---------------------------------------------------------------------------------------------------------- routing
int64_t one_block_size(int64_t M) {
  return M <= kOneBlockSmall ? kOneBlockSmall : M <= kOneBlockMid ? kOneBlockMid : M <= kOneBlock ? kOneBlock : 0;
}

namespace {

// The mask argument of a routing kernel: M = 0 masks every load, any valid pointer serves.
const void* mask_arg(const Routing& r) { return r.M > 0 ? r.pending.data_ptr() : r.perm.data_ptr(); }

// For a token-order gather GEMM about to launch: the ROUTE_BLOCK with which it routes a deferred routing in its own
// programs (kernels/GEMM.md 7b; one_block_size(M), in the key as "route"), 0 when perm / seg are written already, and
// its mask argument. The caller clears `pending` once the kernel is launched.
struct RouteHere {
  int64_t block;
  const void* mask;
};
RouteHere route_here(const Routing& r) {
  if (!r.pending.defined()) return {0, r.perm.data_ptr()};
  return {one_block_size(r.M), mask_arg(r)};
}

}  // namespace

// Writes a deferred routing's perm / seg (one launch of the one-block routing kernel); nothing when already written.
void ensure_routed(const Routing& r) {
  if (!r.pending.defined()) return;
  launch_on_current_stream(kernel_args::routing_one_block_kernel{.mask_ptr = mask_arg(r), .perm_ptr = r.perm.data_ptr(),
                                                               .seg_ptr = r.seg.data_ptr(), .M = r.M, .M_pad = r.M_pad},
                           routing_one_block_key(r.aligned, one_block_size(r.M)), grid(1), r.perm);
  r.pending = at::Tensor();
}

Routing routing_of(const at::Tensor& buffer, int64_t M, bool aligned) {
  const int64_t n = buffer.numel();
  TORCH_INTERNAL_ASSERT(buffer.scalar_type() == at::kInt && buffer.is_contiguous() &&
                        (n == shared_routing_size(M) || (aligned && n == routing_buffer_size(M))));
  Routing r;
  r.M = M;
  r.aligned = aligned;
  r.M_pad = perm_rows(M, aligned);
  r.buffer = buffer;
  const int64_t off = aligned ? 0 : unaligned_section(M);
  r.seg = buffer.narrow(0, off, 5);
  r.perm = buffer.narrow(0, off + kSegSlots, r.M_pad);
  return r;
}

namespace {
// route() into `buffer` (int32, kSegSlots + M_pad entries at least: seg's slots, then perm). A mask of up to
// kOneBlock rows is left pending (see Routing).
Routing route_into(const at::Tensor& m, bool aligned, const at::Tensor& buffer) {
  Routing r;
  r.M = m.numel();
  r.aligned = aligned;
  r.M_pad = perm_rows(r.M, aligned);  // kernels/routing.py: padded_rows
  TORCH_INTERNAL_ASSERT(buffer.numel() >= kSegSlots + r.M_pad);
  r.buffer = buffer;
  r.seg = buffer.narrow(0, 0, 5);
  r.perm = buffer.narrow(0, kSegSlots, r.M_pad);
  if (one_block_size(r.M) > 0) {  // one program routes it: deferred to the first kernel that reads perm / seg
    r.pending = m;
    return r;
  }
  const int64_t nb = cdiv(r.M, kChunk);
  at::Tensor counts = at::empty({nb * 2}, buffer.options());  // freed stream-ordered: reused only by later work here
  launch_on_current_stream(
      kernel_args::routing_count_kernel{.mask_ptr = m.data_ptr(), .block_counts_ptr = counts.data_ptr(), .M = r.M},
      routing_count_key(), grid(nb), counts);
  launch_on_current_stream(
      kernel_args::routing_scatter_kernel{.mask_ptr = m.data_ptr(), .block_counts_ptr = counts.data_ptr(),
                                          .perm_ptr = r.perm.data_ptr(), .seg_ptr = r.seg.data_ptr(), .M = r.M,
                                          .M_pad = r.M_pad, .num_blocks = nb},
      routing_scatter_key(r.aligned), grid(nb), counts);
  return r;
}

at::Tensor flat_mask(const at::Tensor& mask) {
  at::Tensor m = mask.reshape({-1}).contiguous();
  TORCH_INTERNAL_ASSERT(m.scalar_type() == at::kBool && m.is_cuda());
  return m;
}
}  // namespace

Routing route(const at::Tensor& mask, bool aligned) {
  const at::Tensor m = flat_mask(mask);
  const int64_t M = m.numel();
  // Aligned: linear_dual_forward may return it (its length pins M). Unaligned (the ffn forward, whose memory target
  // counts every byte beside h): just seg's slots and perm.
  const int64_t n = aligned ? routing_buffer_size(M) : unaligned_routing_size(M);
  return route_into(m, aligned, at::empty({n}, m.options().dtype(at::kInt)));
}

at::Tensor route_shared(const at::Tensor& mask) {
  const at::Tensor m = flat_mask(mask);
  const int64_t M = m.numel();
  // Every entry defined (-1 where the routings write nothing: seg's unused slots, the aligned perm's unused tail), so
  // that the op's result is a function of the mask alone, equal to the CPU's. The route op is on every decode step:
  // up to kOneBlock rows one launch writes the whole buffer; past it a driver memset and the two-kernel routings.
  at::Tensor buffer = at::empty({shared_routing_size(M)}, m.options().dtype(at::kInt));
  if (const int64_t block = one_block_size(M); block > 0) {  // up to kOneBlock tokens: one launch writes it all
    launch_on_current_stream(
        kernel_args::routing_shared_kernel{.mask_ptr = M > 0 ? m.data_ptr() : buffer.data_ptr(),
                                           .buf_ptr = buffer.data_ptr(), .M = M, .M_pad = aligned_rows(M),
                                           .section = unaligned_section(M)},
        routing_shared_key(block), grid(1), buffer);
    return buffer;
  }
  fill32_on_current_stream(buffer, 0xFFFFFFFFu);
  ensure_routed(route_into(m, /*aligned=*/true, buffer.narrow(0, 0, routing_buffer_size(M))));
  ensure_routed(route_into(m, /*aligned=*/false, buffer.narrow(0, unaligned_section(M), unaligned_routing_size(M))));
  return buffer;
}

Routing route_single(int64_t M, const at::Tensor& like, bool aligned) {
  Routing r;
  r.single = true;
  r.M = M;
  r.aligned = aligned;
  // start_1 = end = roundup(count_0, ALIGN); count_1 = 0 (kernels/routing.py: single_padded_rows)
  r.M_pad = aligned ? std::max(align_up(M), kAlign) : M + kRowTail;
  const auto iopt = like.options().dtype(at::kInt);
  r.perm = at::empty({r.M_pad}, iopt);
  r.seg = at::empty({5}, iopt);
  // One launch writes both (no host sync, capturable in a CUDA graph); five ATen fills cost ~10 us of launches.
  launch_on_current_stream(
      kernel_args::routing_single_kernel{.perm_ptr = r.perm.data_ptr(), .seg_ptr = r.seg.data_ptr(), .M = M,
                                         .M_pad = r.M_pad},
      routing_single_key(r.aligned), grid(cdiv(r.M_pad, kSingleBlock)), r.perm);
  return r;
}

Routing route_identity(int64_t M) {
  Routing r;
  r.single = true;
  r.identity = true;
  r.aligned = false;
  r.M = M;
  r.M_pad = M;
  return r;
}

// ---------------------------------------------------------------------------------------------------------- context
Gemm Gemm::of(at::ScalarType dtype, bool allow_tf32, int cc) {
  const char* dt = variant_dtype(dtype);
  TORCH_CHECK(dt, "routed GEMM: unsupported dtype ", dtype, " on CUDA (float32, float16, bfloat16)");
  Gemm g;
  g.dtype = dtype;
  g.dt = dt;
  g.prec = (dtype == at::kFloat && !allow_tf32) ? "ieee" : "tf32";
  g.cc = cc;
  return g;
}

Gemm Gemm::make(const at::Tensor& like, bool allow_tf32) {
  Gemm g = of(like.scalar_type(), allow_tf32, device_capability(like.get_device()));
  g.device = like.get_device();
  g.sms = std::max(1, device_sm_count(g.device));
  return g;
}

bool Gemm::tma_kernels(bool swiglu) const {
  // sm_90 exactly: the sm_90 cubins use sm_90a-only instructions (wgmma), and their PTX does not run on sm_100+.
  if (cc != 90 || !std::strstr(built_archs(), "sm_90")) return false;
  // The sm_90 table lists the TMA kernels (aot/configs/sm90.json); a build without them has no such entries.
  if (!find_config("routed_linear_tma_kernel", family(*this), cc, 0, -1, -1) ||
      !find_config("routed_grad_weight_tma_kernel", family(*this), cc, 0, -1, -1))
    return false;
  return !swiglu || find_config("routed_swiglu_tma_kernel", family(*this), cc, 0, -1, -1);  // none for fp32-ieee
}

bool Gemm::tma_usable(std::initializer_list<int64_t> dims, bool swiglu) const {
  if (const char* env = std::getenv("FUSED_GEMM_TMA"); env && std::strcmp(env, "0") == 0) return false;
  // TMA itself needs strides of 16 bytes; the TMA kernels are compiled only with the divisibility hints (16
  // elements: aot/manifest.py _both), which the sizes (also the row strides of the buffers made for them) must meet.
  for (int64_t d : dims)
    if (d <= 0 || d % kHint != 0) return false;
  return tma_kernels(swiglu);
}

// ---------------------------------------------------------------------------------------------------------- weights
Experts::Experts(const at::Tensor& text, const at::Tensor& vision, bool single) : single_(single) {
  text_ = unit_inner(text);
  vision_ = single ? text_ : unit_inner(vision);
  TORCH_INTERNAL_ASSERT(text_.dim() == 2 && vision_.sizes() == text_.sizes());
  if (row_stride(text_) != row_stride(vision_)) make_contiguous();
  ld_ = row_stride(text_);
}

void Experts::make_contiguous() {
  text_ = text_.contiguous();
  vision_ = single_ ? text_ : vision_.contiguous();
  ld_ = row_stride(text_);
  stack_ = at::Tensor();
  st_.reset();
}

const Experts::Stacked& Experts::stacked() {
  if (st_) return *st_;
  const int64_t es = text_.element_size(), R = rows(), C = cols();
  const bool rows_ok = ld_ >= C && (ld_ * es) % 16 == 0 && aligned16(text_.data_ptr());
  const intptr_t diff =
      single_ ? 0 : reinterpret_cast<intptr_t>(vision_.data_ptr()) - reinterpret_cast<intptr_t>(text_.data_ptr());
  if (rows_ok && diff == 0) {  // one expert, or both experts are one tensor (tied weights): index 0 serves both
    st_ = Stacked{text_.data_ptr(), 1, R * ld_, ld_, 0};
    return *st_;
  }
  if (rows_ok && !single_ && aligned16(vision_.data_ptr())) {
    // Zero-copy: one rank-3 view from the lower weight, the other |diff| bytes above it (TMA's strides are unsigned
    // multiples of 16 bytes below 2^40), whichever expert that is. CogVLM registers its vision expert first, so a
    // model moved to the GPU often has vision below text; DualLinear / DualExpertSwiGLU stack text first.
    const uintptr_t adiff = static_cast<uintptr_t>(diff < 0 ? -diff : diff);
    if (adiff % 16 == 0 && adiff < (uintptr_t{1} << 40) && static_cast<int64_t>(adiff) / es >= R * ld_) {
      st_ = Stacked{diff > 0 ? text_.data_ptr() : vision_.data_ptr(), 2, static_cast<int64_t>(adiff) / es, ld_,
                    diff > 0 ? 2 : 1};
      return *st_;
    }
  }
  return stack_by_copy();  // [2, R, C] contiguous (2*R*C elements written and read once per call)
}

const Experts::Stacked& Experts::stacked_contiguous() {
  const Stacked& s = stacked();
  const bool canonical = single_ ? s.experts == 1 : (s.experts == 2 && s.map == 2);
  return canonical && s.ld == cols() && s.stride_e == rows() * cols() ? s : stack_by_copy();
}

const Experts::Stacked& Experts::stack_by_copy() {
  if (stack_.defined()) return *st_;
  stack_ = single_ ? text_.clone(at::MemoryFormat::Contiguous) : at::stack({text_, vision_});  // new: 16-byte aligned
  st_ = Stacked{stack_.data_ptr(), single_ ? 1 : 2, rows() * cols(), cols(), single_ ? 0 : 2};
  return *st_;
}

// ---------------------------------------------------------------------------------------------------------- kernels
namespace {
// The A operand of a TMA GEMM, in expert order. A single expert's token order already is that order (perm = arange),
// so x itself serves when TMA can address it (16-byte aligned base and row stride): its rows past M read as zeros
// (the descriptor's out-of-bounds fill), and no copy is made. Otherwise the rows are gathered (into `into`'s storage
// when defined).
at::Tensor tma_rows(const Gemm& g, const Routing& r, const Rows& a, const at::Tensor& into = at::Tensor()) {
  if (a.expert_ordered) return a.t;
  if (r.single && tma_in_place(a.t)) return a.t;
  TORCH_INTERNAL_ASSERT(!r.identity, "routed GEMM: an identity routing needs operands that TMA reads in place");
  return gather_rows(g, r, a.t, into);
}

// perm and seg as kernel arguments. An identity routing has neither, and the kernels it serves read neither: the
// launch's (16-byte aligned) output stands in, so that the aligned variant still serves.
const void* perm_arg(const Routing& r, const at::Tensor& out) {
  return r.identity ? out.data_ptr() : r.perm.data_ptr();
}
const void* seg_arg(const Routing& r, const at::Tensor& out) { return r.identity ? out.data_ptr() : r.seg.data_ptr(); }
// The persistent TMA kernels' one_rows argument (kernels/gemm_tiles.py _walk_tiles): M for an identity routing, else 0.
int32_t one_rows(const Routing& r) { return r.identity ? static_cast<int32_t>(r.M) : 0; }
}  // namespace

bool tma_in_place(const at::Tensor& t) {
  return aligned16(t.data_ptr()) && (t.stride(0) * t.element_size()) % 16 == 0;
}

namespace {

at::Tensor launch_gather(const Gemm& g, const Routing& r, const at::Tensor& src, const at::Tensor& colsum,
                         const at::Tensor& into) {
  check_rows(r, tokens(src), src.size(1), "gather source");
  TORCH_INTERNAL_ASSERT(!r.identity, "routed GEMM: an identity routing has no perm to gather through");
  const int64_t C = src.size(1), rows = r.rows();
  at::Tensor dst;
  if (into.defined()) {
    TORCH_INTERNAL_ASSERT(into.is_contiguous() && into.scalar_type() == src.scalar_type() &&
                          into.device() == src.device() && into.numel() >= rows * C);
    dst = into.view({-1}).narrow(0, 0, rows * C).view({rows, C});
  } else {
    dst = at::empty({rows, C}, src.options());
  }
  if (r.pending.defined() && !r.aligned && !colsum.defined()) {
    // A deferred unaligned routing (the ffn forward's x on sm_90): routed by the gather's own programs, one launch
    // instead of the routing kernel and then the gather (kernels/gather_rows.py route_gather_rows_kernel).
    launch_on_current_stream(
        kernel_args::route_gather_rows_kernel{.mask_ptr = mask_arg(r), .src_ptr = src.data_ptr(),
                                              .dst_ptr = dst.data_ptr(), .perm_ptr = r.perm.data_ptr(),
                                              .seg_ptr = r.seg.data_ptr(), .M = r.M, .M_pad = r.M_pad, .C = C,
                                              .stride_src = src.stride(0), .stride_dst = dst.stride(0)},
        route_gather_rows_key(g, one_block_size(r.M)), grid(cdiv(r.M, kGatherRows), cdiv(C, kGatherCols)), dst);
    r.pending = at::Tensor();
    return dst;
  }
  ensure_routed(r);
  const int64_t cols = colsum.defined() ? kGatherColsColsum : kGatherCols;
  launch_on_current_stream(
      kernel_args::gather_rows_kernel{.src_ptr = src.data_ptr(), .dst_ptr = dst.data_ptr(),
                                      .perm_ptr = r.perm.data_ptr(),
                                      .colsum_ptr = colsum.defined() ? colsum.data_ptr() : r.perm.data_ptr(),
                                      .M_pad = rows, .C = C, .stride_src = src.stride(0), .stride_dst = dst.stride(0)},
      gather_rows_key(g, colsum.defined()), grid(cdiv(rows, kGatherRows), cdiv(C, cols)), dst);
  return dst;
}
}  // namespace

at::Tensor gather_rows(const Gemm& g, const Routing& r, const at::Tensor& src, const at::Tensor& into) {
  return launch_gather(g, r, src, at::Tensor(), into);
}

at::Tensor gather_rows_and_sum(const Gemm& g, const Routing& r, const at::Tensor& src, const at::Tensor& sum0_in,
                               const at::Tensor& sum1_in) {
  const int64_t C = src.size(1), blocks = cdiv(r.M_pad, kGatherRows);
  // One kernel writes both sums: an undefined one (not asked for) gets a scratch vector.
  const auto or_scratch = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({C}, src.options()); };
  const at::Tensor sum0 = or_scratch(sum0_in), sum1 = or_scratch(sum1_in);
  // The column sums of a block of 32 rows belong to one expert only on an aligned routing.
  TORCH_INTERNAL_ASSERT(!r.single && r.aligned && sum0.numel() == C && sum1.numel() == C && sum0.is_contiguous() &&
                        sum1.is_contiguous() && sum0.scalar_type() == src.scalar_type() &&
                        sum1.scalar_type() == src.scalar_type());
  // Per-block fp32 column sums ([M_pad / 32, C], 1/16 of dst's bytes for bf16), added up per expert by a second
  // kernel: deterministic, and no second pass over the rows.
  at::Tensor colsum = at::empty({blocks, C}, src.options().dtype(at::kFloat));
  at::Tensor dst = launch_gather(g, r, src, colsum, at::Tensor());
  launch_on_current_stream(
      kernel_args::expert_colsum_kernel{.colsum_ptr = colsum.data_ptr(), .seg_ptr = r.seg.data_ptr(),
                                        .sum0_ptr = sum0.data_ptr(), .sum1_ptr = sum1.data_ptr(), .num_blocks = blocks,
                                        .C = C},
      expert_colsum_key(g), grid(cdiv(C, 64)), colsum);  // BLOCK_C = 64
  return dst;
}

namespace {
// The persistent grid of a linear TMA GEMM and what its stream-K configs read (kernels/gemm_tiles.py _sk_share): one
// program per SM, an fp32 [R programs, BM, BN] workspace for stream-K over R rounds (the pieces' partial sums, at most
// R per program: _sk_slot) and the stream's zeroed flags (two counts per cut tile: _sk_publish, _sk_leave).
// Without stream-K: programs = min(SMs, the tile bound: persistent, any grid >= 1 covers every tile), and both
// pointers are `unused` (not read).
struct StreamK {
  int64_t programs;
  at::Tensor ws, flags;  // held until the launch is queued (the allocator's stream order keeps them for the kernel)
  const void* ws_ptr;
  const void* flags_ptr;
};
StreamK stream_k(const Gemm& g, const KernelConfig& c, int64_t max_tiles, const at::Tensor& like,
                 const void* unused) {
  if (!c.stream_k) return {std::max<int64_t>(1, std::min<int64_t>(g.sms, max_tiles)), {}, {}, unused, unused};
  const int64_t programs = g.sms;
  at::Tensor ws =
      at::empty({c.stream_k * programs, int64_t{c.block[0]} * c.block[1]}, like.options().dtype(at::kFloat));
  at::Tensor flags = zeroed_flags_for_current_stream(2 * programs, like);
  return {programs, ws, flags, ws.data_ptr(), flags.data_ptr()};
}
}  // namespace

void linear(const Gemm& g, const Routing& r, const Rows& a, Experts& w, const at::Tensor& bias0_in,
            const at::Tensor& bias1_in, const Rows& out, bool w_transposed, bool tma, const at::Tensor& residual_in) {
  const at::Tensor bias0 = tma ? hinted_copy(bias0_in) : bias0_in, bias1 = tma ? hinted_copy(bias1_in) : bias1_in;
  const at::Tensor residual = tma ? hinted_copy(residual_in) : residual_in;
  const int64_t n = w_transposed ? w.cols() : w.rows();  // output columns
  const int64_t k = w_transposed ? w.rows() : w.cols();  // reduction length
  check_rows(r, a, k, "A");
  check_rows(r, out, n, "output");
  // An unaligned routing's tiles straddle the experts: only the TMA kernels that write their own expert's rows
  // (scattered outputs) take it, not the whole-segment expert-ordered outputs nor the pointer kernels.
  TORCH_INTERNAL_ASSERT(r.aligned || (tma && !out.expert_ordered), "routed GEMM: linear needs an aligned routing here");
  TORCH_INTERNAL_ASSERT(!r.identity || (tma && !w_transposed), "routed GEMM: an identity routing serves the forward "
                                                               "TMA kernel only");
  const bool has_bias = bias0.defined();
  TORCH_INTERNAL_ASSERT(has_bias == bias1.defined() && !(has_bias && w_transposed));
  if (has_bias)
    TORCH_INTERNAL_ASSERT(bias0.numel() == n && bias1.numel() == n && (n <= 1 || (bias0.stride(0) == 1 &&
                                                                                   bias1.stride(0) == 1)));
  const bool has_res = residual.defined();
  TORCH_INTERNAL_ASSERT(!has_res || (!out.expert_ordered && same_rows(residual, out.t)),
                        "routed GEMM: a residual is added into token-order rows");
  // Unused pointer arguments get the (16-byte aligned) perm so that they never block the aligned variant.
  const void* b0 = has_bias ? bias0.data_ptr() : perm_arg(r, out.t);
  const void* b1 = has_bias ? bias1.data_ptr() : perm_arg(r, out.t);
  const void* res = has_res ? residual.data_ptr() : perm_arg(r, out.t);
  if (tma && !a.expert_ordered && !r.single && !out.expert_ordered && !w_transposed) {
    // Token-order A into scattered rows (the linear_dual forward): gathering A's rows inside the GEMM saves the
    // [M_pad, K] gather copy where the table says it is faster (aot/configs/sm90.json; docs/perf.md). It also routes
    // a deferred routing itself (ROUTE_BLOCK, in the key as "route"; 0: perm / seg are written already).
    const KernelConfig* c = find_config("routed_linear_gather_tma_kernel", family(g), g.cc, r.M, n, k);
    const RouteHere here = route_here(r);
    if (c && !config_off(*c) && hinted_rows(a.t) && aligned16(here.mask)) {
      const Experts::Stacked& st = w.stacked();
      // W twice: blocks of BLOCK_N columns, and of BLOCK_N / 2 for a split last round (the box comes from the
      // kernel's metadata).
      const StreamK sk = stream_k(g, *c, max_row_tiles(r, c->block[0]) * cdiv(n, c->block[1]), out.t,
                                  r.perm.data_ptr());
      launch_on_current_stream(
          kernel_args::routed_linear_gather_tma_kernel{
              .a_ptr = a.t.data_ptr(), .w_desc = st.desc(w.rows(), w.cols()), .wh_desc = st.desc(w.rows(), w.cols()),
              .bias0_ptr = b0, .bias1_ptr = b1, .out_ptr = out.t.data_ptr(), .res_ptr = res,
              .perm_ptr = r.perm.data_ptr(), .seg_ptr = r.seg.data_ptr(), .mask_ptr = here.mask,
              .ws_ptr = sk.ws_ptr, .flag_ptr = sk.flags_ptr, .M = r.M, .M_pad = r.M_pad, .N = n, .K = k,
              .stride_am = a.t.stride(0), .stride_om = out.t.stride(0), .w_map = st.map, .has_bias = has_bias,
              .has_residual = has_res},
          linear_gather_tma_key(g, *c, here.block, r.aligned), grid(sk.programs), out.t);
      r.pending = at::Tensor();
      return;
    }
  }
  ensure_routed(r);
  if (tma) {
    const at::Tensor ap = tma_rows(g, r, a);
    const KernelConfig& c = config(g, "routed_linear_tma_kernel", r.M, n, k, w_transposed ? 1 : 0);
    const Experts::Stacked& st = w.stacked();
    const StreamK sk = stream_k(g, c, max_row_tiles(r, c.block[0]) * cdiv(n, c.block[1]), out.t, perm_arg(r, out.t));
    // An identity routing's token order is its expert order: its rows are written in place, not scattered.
    const bool scatter = !out.expert_ordered && !r.identity;
    launch_on_current_stream(
        kernel_args::routed_linear_tma_kernel{
            .a_desc = {ap.data_ptr(), {ap.size(0), k}, {ap.stride(0), 1}}, .w_desc = st.desc(w.rows(), w.cols()),
            .wh_desc = st.desc(w.rows(), w.cols()), .bias0_ptr = b0, .bias1_ptr = b1, .out_ptr = out.t.data_ptr(),
            .res_ptr = res, .perm_ptr = perm_arg(r, out.t), .seg_ptr = seg_arg(r, out.t), .ws_ptr = sk.ws_ptr,
            .flag_ptr = sk.flags_ptr, .one_rows = one_rows(r), .N = n, .K = k, .stride_om = out.t.stride(0),
            .w_map = st.map, .has_bias = has_bias, .has_residual = has_res},
        linear_tma_key(g, scatter, w_transposed, c), grid(sk.programs), out.t);
  } else {
    TORCH_INTERNAL_ASSERT(!r.identity);
    const KernelConfig& c = config(g, "routed_linear_kernel", r.M, n, k, w_transposed ? 1 : 0);
    launch_on_current_stream(
        kernel_args::routed_linear_kernel{
            .a_ptr = a.t.data_ptr(), .w0_ptr = w.text().data_ptr(), .w1_ptr = w.vision().data_ptr(), .bias0_ptr = b0,
            .bias1_ptr = b1, .out_ptr = out.t.data_ptr(), .res_ptr = res, .perm_ptr = r.perm.data_ptr(),
            .seg_ptr = r.seg.data_ptr(), .M_pad = r.M_pad, .N = n, .K = k, .stride_am = a.t.stride(0),
            .stride_w = w.ld(), .stride_om = out.t.stride(0), .has_bias = has_bias, .has_residual = has_res},
        linear_key(g, !a.expert_ordered, !out.expert_ordered, w_transposed, c),
        grid((r.M_pad / c.block[0]) * cdiv(n, c.block[1])), out.t);
  }
}

std::pair<int64_t, int64_t> decode_split(int64_t n, int64_t k, int64_t bn, int64_t bk, int64_t sms) {
  const int64_t k_blocks = cdiv(k, bk), tiles_n = cdiv(n, bn);
  const int64_t n_split = 2 * tiles_n >= sms ? 1
                                             : std::max<int64_t>(1, std::min({cdiv(2 * sms, tiles_n), k_blocks / 4,
                                                                              kDecodeMaxSplits}));
  const int64_t k_split = std::max(cdiv(k_blocks, n_split) * bk, bk);
  return {k > 0 ? cdiv(k, k_split) : 1, k_split};
}

bool decode_linear(const Gemm& g, const at::Tensor& x, const at::Tensor& mask, const at::Tensor& w_text,
                   const at::Tensor& w_vision, const at::Tensor& bias0, const at::Tensor& bias1, const at::Tensor& out,
                   const at::Tensor& residual) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const KernelConfig* c = find_config("routed_decode_linear_kernel", family(g), g.cc, M, N, K);
  if (!c || config_off(*c)) return false;
  if (const char* env = std::getenv("FUSED_DECODE_GEMM"); env && std::strcmp(env, "0") == 0) return false;
  // aot/config_table.py checks that a decode bucket's max_m fits its BLOCK_M: one program holds every row
  TORCH_INTERNAL_ASSERT(M <= c->block[0] && mask.is_contiguous() && mask.numel() == M && out.size(0) == M &&
                        (K <= 1 || x.stride(1) == 1) && (N <= 1 || out.stride(1) == 1));
  const at::Tensor w0 = unit_inner(w_text), w1 = unit_inner(w_vision);
  const auto [n_split, k_split] = decode_split(N, K, c->block[1], c->block[2], g.sms);
  const bool has_bias = bias0.defined(), has_res = residual.defined();
  TORCH_INTERNAL_ASSERT(has_bias == bias1.defined());
  TORCH_INTERNAL_ASSERT(!has_res || same_rows(residual, out));
  // More than one split: fp32 partial sums [n_split, M, N], every entry written by the programs of its row's expert.
  const at::Tensor ws = n_split > 1 ? at::empty({n_split, M, N}, out.options().dtype(at::kFloat)) : out;
  // Unused pointer arguments get out's (16-byte aligned) pointer so that they never block the aligned variant.
  const void* b0 = has_bias ? bias0.data_ptr() : out.data_ptr();
  const void* b1 = has_bias ? bias1.data_ptr() : out.data_ptr();
  const void* res = has_res ? residual.data_ptr() : out.data_ptr();
  // grid (column tiles, splits, experts): the programs of an expert with no token exit before reading its weights
  Grid tiles = grid(cdiv(N, c->block[1]), n_split);
  tiles.z = 2;
  launch_on_current_stream(
      kernel_args::routed_decode_linear_kernel{
          .x_ptr = x.data_ptr(), .mask_ptr = mask.data_ptr(), .w0_ptr = w0.data_ptr(), .w1_ptr = w1.data_ptr(),
          .bias0_ptr = b0, .bias1_ptr = b1, .res_ptr = res, .out_ptr = out.data_ptr(), .ws_ptr = ws.data_ptr(),
          .M = M, .N = N, .K = K, .k_split = k_split, .stride_xm = x.stride(0), .stride_w0 = row_stride(w0),
          .stride_w1 = row_stride(w1), .stride_om = out.stride(0), .has_bias = has_bias, .has_residual = has_res},
      decode_linear_key(g, *c), tiles, out);
  if (n_split > 1)
    launch_on_current_stream(
        kernel_args::decode_reduce_kernel{.ws_ptr = ws.data_ptr(), .mask_ptr = mask.data_ptr(), .bias0_ptr = b0,
                                          .bias1_ptr = b1, .res_ptr = res, .out_ptr = out.data_ptr(), .M = M, .N = N,
                                          .n_split = n_split, .stride_om = out.stride(0), .has_bias = has_bias,
                                          .has_residual = has_res},
        decode_reduce_key(g), grid(M, cdiv(N, kDecodeReduceCols)), out);
  return true;
}

namespace {
// The w_map argument of the unpaired gate/up kernels: each projection's expert order (kernels/gemm_tma.py
// _swiglu_step).
int swiglu_map(const Experts::Stacked& gate, const Experts::Stacked& up) { return gate.map | up.map << 2; }

// Gate and up in one MMA of 2 x BLOCK_N columns (routed_swiglu_pair_tma_kernel and its backward twin) where
// `kernel`'s table turns it on for m: one rank-4 descriptor [2, E, I, H] whose first dimension steps from one weight
// tensor to the other (their distance in memory, which TMA takes when it is a multiple of 16 bytes below 2^40; the
// lower address first, up_first says which).
struct Pair {
  const KernelConfig* cfg;
  Experts::Stacked lo;  // the weight tensor at the lower address
  int64_t dist;         // elements from it to the other one
  bool up_first;
  at::Tensor storage;   // both projections copied into one [2, E, I, H] tensor by pair_of, else undefined
  // The box comes from the kernel's metadata: the forward kernel takes two descriptors over the same tensor
  // (BLOCK_N columns, and BLOCK_N / 2 for a split last round).
  DescArg desc(int64_t I, int64_t H) const { return {lo.base, {2, lo.experts, I, H}, {dist, lo.stride_e, lo.ld, 1}}; }
};
// Whether two projections' stacked views share the strides and expert order of one descriptor.
bool same_view(const Experts::Stacked& a, const Experts::Stacked& b) {
  return a.experts == b.experts && a.stride_e == b.stride_e && a.ld == b.ld && a.map == b.map;
}

std::optional<Pair> pair_of(const char* kernel, const Gemm& g, Experts& gate, Experts& up, int64_t m,
                            bool copy_to_pair) {
  const KernelConfig* pc = find_config(kernel, family(g), g.cc, m, gate.rows(), gate.cols());
  if (!pc || config_off(*pc)) return std::nullopt;
  if (copy_to_pair && !same_view(gate.stacked(), up.stacked())) {
    // The descriptor shares one expert stride, row stride and expert order between the two projections, and their
    // views may differ (e.g. separate tensors at different distances: that depends on where the weights lie). Both
    // in the canonical contiguous layout (a copy only where a view is not in it), the pair serves.
    gate.stacked_contiguous();
    up.stacked_contiguous();
  }
  const Experts::Stacked& sg = gate.stacked();
  const Experts::Stacked& su = up.stacked();
  const intptr_t dist = reinterpret_cast<intptr_t>(su.base) - reinterpret_cast<intptr_t>(sg.base);
  const uintptr_t adist = static_cast<uintptr_t>(dist < 0 ? -dist : dist);
  if (!same_view(sg, su) || adist == 0 || adist % 16 != 0 || adist >= (uintptr_t{1} << 40)) {
    if (!copy_to_pair) return std::nullopt;  // the forward's unpaired kernel computes the same bits
    // The backward pairs whatever the weights' addresses (its unpaired path rounds gate and up to the input dtype:
    // the gradients would depend on where the weights lie, e.g. gate and up given as one tensor). Both projections in
    // one new [2, E, I, H] tensor, text first: a copy, only where the weights' own addresses cannot serve.
    const auto experts = [](Experts& w) {
      return w.single() ? w.text().unsqueeze(0) : at::stack({w.text(), w.vision()});
    };
    at::Tensor both = at::stack({experts(gate), experts(up)});  // contiguous, 16-byte aligned
    const int64_t E = both.size(1), I = gate.rows(), H = gate.cols();
    return Pair{pc, Experts::Stacked{both.data_ptr(), E, I * H, H, gate.single() ? 0 : 2}, E * I * H, false, both};
  }
  const bool up_first = dist < 0;
  return Pair{pc, up_first ? su : sg, static_cast<int64_t>(adist) / static_cast<int64_t>(c10::elementSize(g.dtype)),
              up_first};
}
}  // namespace

void swiglu(const Gemm& g, const Routing& r, const Rows& a, Experts& gate, Experts& up, const at::Tensor& h, bool tma,
            const at::Tensor& gather_into, const at::Tensor& gate_up) {
  const int64_t I = gate.rows(), H = gate.cols();
  TORCH_INTERNAL_ASSERT(up.rows() == I && up.cols() == H && gate.single() == up.single());
  TORCH_INTERNAL_ASSERT(r.aligned || tma, "routed GEMM: the pointer swiglu needs an aligned routing");
  check_rows(r, a, H, "x");
  check_rows(r, ordered(h), I, "h");
  // SAVE: gate and up also into gate_up [M, 2I] in token order (kernels/gemm_tiles.py _save_gate_up); otherwise the
  // kernels' gu_ptr / stride_gu are h's pointer and 0, never read.
  const bool save = gate_up.defined();
  TORCH_INTERNAL_ASSERT(!save || (gate_up.dim() == 2 && gate_up.size(0) == r.M && gate_up.size(1) == 2 * I &&
                                  gate_up.stride(1) == 1 && gate_up.scalar_type() == h.scalar_type()));
  const void* gu = save ? gate_up.data_ptr() : h.data_ptr();
  const int64_t stride_gu = save ? gate_up.stride(0) : 0;
  if (tma && !a.expert_ordered && !r.single) {
    // Token-order x: gather its rows inside the GEMM where the table says that beats the gather copy, and route a
    // deferred routing there (as in linear).
    const KernelConfig* c = find_config("routed_swiglu_gather_tma_kernel", family(g), g.cc, r.M, I, H);
    const RouteHere here = route_here(r);
    if (c && !config_off(*c) && hinted_rows(a.t) && aligned16(here.mask)) {
      const Experts::Stacked& sg = gate.stacked();
      const Experts::Stacked& su = up.stacked();
      const int64_t tiles = max_row_tiles(r, c->block[0]) * cdiv(I, c->block[1]);
      launch_on_current_stream(
          kernel_args::routed_swiglu_gather_tma_kernel{
              .a_ptr = a.t.data_ptr(), .w1_desc = sg.desc(I, H), .w3_desc = su.desc(I, H), .h_ptr = h.data_ptr(),
              .gu_ptr = gu, .perm_ptr = r.perm.data_ptr(), .seg_ptr = r.seg.data_ptr(), .mask_ptr = here.mask,
              .M = r.M, .M_pad = r.M_pad, .N = I, .K = H, .stride_am = a.t.stride(0), .stride_hm = h.stride(0),
              .stride_gu = stride_gu, .w_map = swiglu_map(sg, su)},
          swiglu_gather_tma_key(g, save, *c, here.block, r.aligned), grid(std::min<int64_t>(g.sms, tiles)), h);
      r.pending = at::Tensor();
      return;
    }
  }
  if (tma) {
    // The gather (if any) writes a deferred routing itself (launch_gather); the GEMM then reads seg.
    const at::Tensor ap = tma_rows(g, r, a, gather_into);
    ensure_routed(r);
    // The unpaired kernel computes the same bits (two accumulators instead of the halves of one): where the pair
    // does not serve, no weight copy is worth it.
    if (const std::optional<Pair> pair = pair_of("routed_swiglu_pair_tma_kernel", g, gate, up, r.M, false)) {
      const int64_t tiles = max_row_tiles(r, pair->cfg->block[0]) * cdiv(I, pair->cfg->block[1]);
      launch_on_current_stream(
          kernel_args::routed_swiglu_pair_tma_kernel{
              .a_desc = {ap.data_ptr(), {ap.size(0), H}, {ap.stride(0), 1}}, .w13_desc = pair->desc(I, H),
              .w13h_desc = pair->desc(I, H), .h_ptr = h.data_ptr(), .gu_ptr = gu, .perm_ptr = perm_arg(r, h),
              .seg_ptr = seg_arg(r, h), .one_rows = one_rows(r), .N = I, .K = H, .stride_hm = h.stride(0),
              .stride_gu = stride_gu, .up_first = pair->up_first ? 1 : 0, .w_map = pair->lo.map},
          swiglu_pair_key(g, save, *pair->cfg), grid(std::min<int64_t>(g.sms, tiles)), h);
      return;
    }
    const Experts::Stacked& sg = gate.stacked();
    const Experts::Stacked& su = up.stacked();
    const KernelConfig& c = config(g, "routed_swiglu_tma_kernel", r.M, I, H);
    const int64_t tiles = max_row_tiles(r, c.block[0]) * cdiv(I, c.block[1]);
    launch_on_current_stream(
        kernel_args::routed_swiglu_tma_kernel{
            .a_desc = {ap.data_ptr(), {ap.size(0), H}, {ap.stride(0), 1}}, .w1_desc = sg.desc(I, H),
            .w3_desc = su.desc(I, H), .h_ptr = h.data_ptr(), .gu_ptr = gu, .perm_ptr = perm_arg(r, h),
            .seg_ptr = seg_arg(r, h), .one_rows = one_rows(r), .N = I, .K = H, .stride_hm = h.stride(0),
            .stride_gu = stride_gu, .w_map = swiglu_map(sg, su)},
        swiglu_tma_key(g, save, c), grid(std::min<int64_t>(g.sms, tiles)), h);
  } else {
    ensure_routed(r);
    TORCH_INTERNAL_ASSERT(!a.expert_ordered && !r.identity,
                          "routed GEMM: the pointer swiglu is compiled for token-order x and a routing with perm only");
    if (gate.ld() != up.ld()) {  // the kernel takes one row stride for all four weights
      gate.make_contiguous();
      up.make_contiguous();
    }
    const KernelConfig& c = config(g, "routed_swiglu_kernel", r.M, I, H);
    launch_on_current_stream(
        kernel_args::routed_swiglu_kernel{
            .a_ptr = a.t.data_ptr(), .w1_0_ptr = gate.text().data_ptr(), .w1_1_ptr = gate.vision().data_ptr(),
            .w3_0_ptr = up.text().data_ptr(), .w3_1_ptr = up.vision().data_ptr(), .h_ptr = h.data_ptr(),
            .gu_ptr = gu, .perm_ptr = r.perm.data_ptr(), .seg_ptr = r.seg.data_ptr(), .M_pad = r.M_pad, .N = I,
            .K = H, .stride_am = a.t.stride(0), .stride_w = gate.ld(), .stride_hm = h.stride(0),
            .stride_gu = stride_gu},
        swiglu_key(g, save, c), grid((r.M_pad / c.block[0]) * cdiv(I, c.block[1])), h);
  }
}

bool swiglu_backward_pair(const Gemm& g, const Routing& r, const at::Tensor& x, Experts& gate, Experts& up,
                          const at::Tensor& h, const at::Tensor& dup, const at::Tensor& dgate) {
  const int64_t I = gate.rows(), H = gate.cols();
  TORCH_INTERNAL_ASSERT(r.aligned && !r.identity && up.rows() == I && up.cols() == H);
  check_rows(r, ordered(x), H, "x");
  for (const at::Tensor* t : {&h, &dup, &dgate})
    TORCH_INTERNAL_ASSERT(t->dim() == 2 && t->size(0) == r.M_pad && t->size(1) == I && t->stride(1) == 1 &&
                          t->stride(0) == h.stride(0));
  // Always paired where the pair kernel serves m (pair_of copies both weights into one tensor where their addresses do
  // not serve): the unpaired backward stores gate and up in the input dtype before the SwiGLU backward, so a fallback
  // would make the gradients depend on the weights' addresses (test_weight_layout_does_not_change_results).
  const std::optional<Pair> pair = pair_of("routed_swiglu_pair_bwd_tma_kernel", g, gate, up, r.M, true);
  if (!pair) return false;
  ensure_routed(r);
  const int64_t tiles = max_row_tiles(r, pair->cfg->block[0]) * cdiv(I, pair->cfg->block[1]);
  launch_on_current_stream(
      kernel_args::routed_swiglu_pair_bwd_tma_kernel{
          .a_desc = {x.data_ptr(), {x.size(0), H}, {x.stride(0), 1}}, .w13_desc = pair->desc(I, H),
          .h_ptr = h.data_ptr(), .dup_ptr = dup.data_ptr(), .dgate_ptr = dgate.data_ptr(), .seg_ptr = r.seg.data_ptr(),
          .N = I, .K = H, .stride_hm = h.stride(0), .up_first = pair->up_first ? 1 : 0, .w_map = pair->lo.map},
      swiglu_pair_bwd_key(g, *pair->cfg), grid(std::min<int64_t>(g.sms, tiles)), h);
  return true;
}

void swiglu_backward(const Gemm& g, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dh,
                     const at::Tensor& h, const at::Tensor& dup, const at::Tensor& perm) {
  TORCH_INTERNAL_ASSERT(h.is_contiguous() && dup.is_contiguous() && dh.is_contiguous() && dup.sizes() == h.sizes() &&
                        dh.sizes() == h.sizes() && gate.stride(0) == up.stride(0) && gate.stride(1) == 1 &&
                        up.stride(1) == 1);
  const int64_t rows = h.size(0), cols = h.size(1);
  // BLOCK_R = 16, BLOCK_C = 256 (aot/manifest.py)
  launch_on_current_stream(
      kernel_args::swiglu_backward_kernel{.gate_ptr = gate.data_ptr(), .up_ptr = up.data_ptr(), .dh_ptr = dh.data_ptr(),
                                          .h_ptr = h.data_ptr(), .dup_ptr = dup.data_ptr(),
                                          .perm_ptr = perm.defined() ? perm.data_ptr() : h.data_ptr(), .n_rows = rows,
                                          .n_cols = cols, .stride_in = gate.stride(0), .stride = cols},
      swiglu_backward_key(g, perm.defined()), grid(cdiv(rows, 16), cdiv(cols, 256)), h);
}

void grad_weight(const Gemm& g, const Routing& r, const Rows& dy, const Rows& x, const at::Tensor& dw0_in,
                 const at::Tensor& dw1_in, const at::Tensor& db0_in, const at::Tensor& db1_in, bool tma) {
  TORCH_INTERNAL_ASSERT(dy.expert_ordered == x.expert_ordered && r.aligned && !r.identity);
  const int64_t N = dy.t.size(1), K = x.t.size(1);
  TORCH_INTERNAL_ASSERT(N > 0 && K > 0, "routed GEMM: grad_weight needs N, K > 0 (bias gradients come from K tiles)");
  check_rows(r, dy, N, "dy");
  check_rows(r, x, K, "x");
  // An expert is computed when one of its outputs is asked for (a single routing has expert 0 only). A computed
  // expert's output not asked for gets a scratch buffer; an expert not computed gets the other's tensors, which
  // nothing writes (the pointer kernel launches no programs for it, the TMA kernel's `experts` leaves its bit off).
  const at::Tensor* dw_in[2] = {&dw0_in, &dw1_in};
  const at::Tensor* db_in[2] = {&db0_in, &db1_in};
  const bool dbias = db0_in.defined() || (!r.single && db1_in.defined());
  bool run[2];
  at::Tensor dw[2], db[2];
  for (int e = 0; e < 2; ++e) {
    run[e] = (e == 0 || !r.single) && (dw_in[e]->defined() || (dbias && db_in[e]->defined()));
    dw[e] = dw_in[e]->defined() ? *dw_in[e] : run[e] ? at::empty({N, K}, dy.t.options()) : at::Tensor();
    if (dbias) db[e] = db_in[e]->defined() ? *db_in[e] : run[e] ? at::empty({N}, dy.t.options()) : at::Tensor();
  }
  TORCH_INTERNAL_ASSERT(run[0] || run[1], "routed GEMM: grad_weight of no expert");
  for (int e = 0; e < 2; ++e) {
    if (!dw[e].defined()) dw[e] = dw[1 - e];
    if (dbias && !db[e].defined()) db[e] = db[1 - e];
  }
  ensure_routed(r);
  const at::Tensor &dw0 = dw[0], &dw1 = dw[1], &db0 = db[0], &db1 = db[1];
  TORCH_INTERNAL_ASSERT(dw0.size(0) == N && dw0.size(1) == K && dw0.is_contiguous() && dw1.sizes() == dw0.sizes() &&
                        dw1.strides() == dw0.strides());
  if (dbias) TORCH_INTERNAL_ASSERT(db0.numel() == N && db1.numel() == N && db0.is_contiguous() && db1.is_contiguous());
  if (tma) {
    // Persistent, at most one program per SM: each computes its [BN, BK] tiles for every expert in `experts` (bit e:
    // expert e), all in one loop over their rows; a frozen expert's dW is not touched.
    TORCH_INTERNAL_ASSERT(dy.expert_ordered, "routed GEMM: the TMA grad-weight takes expert-ordered buffers");
    TORCH_INTERNAL_ASSERT(!dbias, "routed GEMM: the TMA grad-weight sums no bias (gather_rows_and_sum does)");
    const KernelConfig& c = config(g, "routed_grad_weight_tma_kernel", r.M, N, K);  // block: BN x BK x BR
    launch_on_current_stream(
        kernel_args::routed_grad_weight_tma_kernel{
            .dy_desc = {dy.t.data_ptr(), {r.M_pad, N}, {dy.t.stride(0), 1}},
            .x_desc = {x.t.data_ptr(), {r.M_pad, K}, {x.t.stride(0), 1}}, .seg_ptr = r.seg.data_ptr(),
            .dw0_desc = {dw0.data_ptr(), {N, K}, {dw0.stride(0), 1}},
            .dw1_desc = {dw1.data_ptr(), {N, K}, {dw1.stride(0), 1}}, .N = N, .K = K,
            .experts = (run[0] ? 1 : 0) | (run[1] ? 2 : 0)},
        grad_weight_tma_key(g, c), grid(std::min<int64_t>(g.sms, cdiv(N, c.block[0]) * cdiv(K, c.block[1]))), dw0);
    return;
  }
  // Pointer kernel: a launch of one expert (either, or the only one of a single routing) has per_e programs, all
  // expert first_expert; a launch of both has 2 per_e, the first per_e for the expert with more rows (read from seg
  // on the device: kernels/grad_weight.py _grad_weight_expert).
  const int32_t first_expert = run[0] ? 0 : 1;
  const int64_t n_experts = (run[0] && run[1]) ? 2 : 1;
  const KernelConfig& c = config(g, "routed_grad_weight_kernel", r.M, N, K);  // block: BN x BK x BR
  const int64_t per_e = cdiv(N, c.block[0]) * cdiv(K, c.block[1]);
  launch_on_current_stream(
      kernel_args::routed_grad_weight_kernel{
          .dy_ptr = dy.t.data_ptr(), .x_ptr = x.t.data_ptr(), .perm_ptr = r.perm.data_ptr(),
          .seg_ptr = r.seg.data_ptr(), .dw0_ptr = dw0.data_ptr(), .dw1_ptr = dw1.data_ptr(),
          .db0_ptr = dbias ? db0.data_ptr() : r.perm.data_ptr(), .db1_ptr = dbias ? db1.data_ptr() : r.perm.data_ptr(),
          .N = N, .K = K, .stride_dym = dy.t.stride(0), .stride_xm = x.t.stride(0), .stride_dwn = dw0.stride(0),
          .first_expert = first_expert},
      grad_weight_key(g, !dy.expert_ordered, dbias, c), grid(n_experts * per_e), dw0);
}

// ------------------------------------------------------------------------------------ every variant asked for
std::vector<VariantRequest> requestable_variants(int cc) {
  std::set<VariantRequest> out;
  // The token counts at which a key can change: each config bucket's bound and the one-block routing sizes, and the
  // next count up; keys are constant between them.
  std::set<int64_t> ms = {0, 1};
  for (int64_t b : {kOneBlockSmall, kOneBlockMid, kOneBlock}) ms.insert({b, b + 1});
  // The same for the shape classes' bounds on n and k (-1: a lookup that does not know the shape).
  std::set<int64_t> ns = {-1, 1}, ks = {-1, 1};
  for (size_t i = 0; i < kNumConfigs; ++i) {
    if (kConfigs[i].max_m >= 0) ms.insert({kConfigs[i].max_m, kConfigs[i].max_m + 1});
    if (kConfigs[i].max_n >= 0) ns.insert({kConfigs[i].max_n, kConfigs[i].max_n + 1});
    if (kConfigs[i].max_k >= 0) ks.insert({kConfigs[i].max_k, kConfigs[i].max_k + 1});
  }
  std::vector<std::array<int64_t, 4>> shapes;  // (m, n, k, orientation: -1 unknown, 0 forward, 1 grad-input)
  for (int64_t m : ms)
    for (int64_t n : ns)
      for (int64_t k : ks)
        for (int64_t wt : {-1, 0, 1}) shapes.push_back({m, n, k, wt});
  for (bool aligned : {true, false}) {  // routing: no dtype
    for (int64_t m : ms)
      if (one_block_size(m) > 0) {
        out.insert({"routing_one_block_kernel", routing_one_block_key(aligned, one_block_size(m))});
        out.insert({"routing_shared_kernel", routing_shared_key(one_block_size(m))});
      }
    out.insert({"routing_count_kernel", routing_count_key()});
    out.insert({"routing_scatter_kernel", routing_scatter_key(aligned)});
    out.insert({"routing_single_kernel", routing_single_key(aligned)});
  }
  // Every (dtype, precision) a call can make: 16-bit inputs ignore allow_tf32, fp32 gives tf32 or ieee.
  const std::pair<at::ScalarType, bool> units[] = {
      {at::kBFloat16, false}, {at::kHalf, false}, {at::kFloat, true}, {at::kFloat, false}};
  for (const auto& [dtype, allow_tf32] : units) {
    const Gemm g = Gemm::of(dtype, allow_tf32, cc);
    const bool tma = g.tma_kernels(false), tma_swiglu = g.tma_kernels(true);
    for (bool f : {false, true}) {
      out.insert({"gather_rows_kernel", gather_rows_key(g, f)});
      out.insert({"swiglu_backward_kernel", swiglu_backward_key(g, f)});
    }
    out.insert({"expert_colsum_kernel", expert_colsum_key(g)});
    for (const auto& shape : shapes) {
      const int64_t m = shape[0], n = shape[1], k = shape[2];
      const int wt = static_cast<int>(shape[3]);
      // A bucket a launcher looks up; a missing one is reported as such (kernel_config would throw at run time).
      const auto cfg = [&](const char* kernel) -> const KernelConfig* {
        const KernelConfig* c = find_config(kernel, family(g), cc, m, n, k, wt);
        if (!c)
          out.insert({kernel, "no config for m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" +
                                  std::to_string(k) + " wt=" + std::to_string(wt) + " (" + family(g) + ")"});
        return c;
      };
      // Alternative designs: looked up with find_config, used where the bucket is not "off".
      const auto optional_cfg = [&](const char* kernel) -> const KernelConfig* {
        const KernelConfig* c = find_config(kernel, family(g), cc, m, n, k, wt);
        return c && !config_off(*c) ? c : nullptr;
      };
      const int64_t routes[] = {0, one_block_size(m)};  // the token-order GEMMs' ROUTE_BLOCK (0: routed already)
      // every listed flag combination of the flagged kernels, each flag taken from its bit (flag_bit)
      const auto each_combo = [&](const char* kernel, auto&& key) {
        const FlagSet& s = flag_set(kernel);
        for (int i = 0; i < s.num_combos; ++i)
          out.insert({kernel, key([&](int f) { return flag_bit(s.combos[i], s.num_flags, f); })});
      };
      if (const KernelConfig* c = cfg("routed_linear_kernel"))
        each_combo("routed_linear_kernel", [&](auto b) { return linear_key(g, b(0), b(1), b(2), *c); });
      if (const KernelConfig* c = cfg("routed_swiglu_kernel"))
        for (bool save : {false, true}) out.insert({"routed_swiglu_kernel", swiglu_key(g, save, *c)});
      if (const KernelConfig* c = cfg("routed_grad_weight_kernel"))
        each_combo("routed_grad_weight_kernel", [&](auto b) { return grad_weight_key(g, b(0), b(1), *c); });
      if (const KernelConfig* c = optional_cfg("routed_decode_linear_kernel")) {
        out.insert({"routed_decode_linear_kernel", decode_linear_key(g, *c)});
        out.insert({"decode_reduce_kernel", decode_reduce_key(g)});
      }
      if (!tma) continue;
      if (const KernelConfig* c = cfg("routed_linear_tma_kernel"))
        each_combo("routed_linear_tma_kernel", [&](auto b) { return linear_tma_key(g, b(0), b(1), *c); });
      if (const KernelConfig* c = cfg("routed_grad_weight_tma_kernel"))
        out.insert({"routed_grad_weight_tma_kernel", grad_weight_tma_key(g, *c)});
      if (const KernelConfig* c = optional_cfg("routed_linear_gather_tma_kernel"))
        for (int64_t route : routes)
          out.insert({"routed_linear_gather_tma_kernel", linear_gather_tma_key(g, *c, route, true)});
      if (!tma_swiglu) continue;
      // the ffn forward's x gather on its unaligned routing, which it routes itself
      if (one_block_size(m) > 0) out.insert({"route_gather_rows_kernel", route_gather_rows_key(g, one_block_size(m))});
      if (const KernelConfig* c = cfg("routed_swiglu_tma_kernel"))
        for (bool save : {false, true}) out.insert({"routed_swiglu_tma_kernel", swiglu_tma_key(g, save, *c)});
      if (const KernelConfig* c = optional_cfg("routed_swiglu_gather_tma_kernel"))
        for (bool save : {false, true})
          for (int64_t route : routes)
            out.insert({"routed_swiglu_gather_tma_kernel", swiglu_gather_tma_key(g, save, *c, route, false)});
      if (const KernelConfig* c = optional_cfg("routed_swiglu_pair_tma_kernel"))
        for (bool save : {false, true}) out.insert({"routed_swiglu_pair_tma_kernel", swiglu_pair_key(g, save, *c)});
      if (const KernelConfig* c = optional_cfg("routed_swiglu_pair_bwd_tma_kernel"))
        out.insert({"routed_swiglu_pair_bwd_tma_kernel", swiglu_pair_bwd_key(g, *c)});
    }
  }
  return {out.begin(), out.end()};
}

}  // namespace routed
}  // namespace fused
