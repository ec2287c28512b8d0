// CPU implementation of decode_attention from ATen ops, written from the contract (csrc/torch_bindings.cpp), not
// from the kernel: float32 math for float32 / float16 / bfloat16 (float64 for float64), rounded once to q's dtype.
// So code and tests run without a GPU. Not tuned for speed (a loop over the sequences).
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <torch/library.h>

#include <limits>
#include <string>

#include "ops/decode_attention.h"

namespace fused {

at::Tensor decode_attention_cpu(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& cache_lens,
                                std::optional<double> scale) {
  const DecodeAttentionGeometry g = check_decode_attention_inputs(q, k_cache, v_cache, k_new, v_new, cache_lens);
  // Every length first (free on the CPU), so that a bad one leaves both caches untouched.
  const at::Tensor lens = cache_lens.contiguous();
  const int32_t* len = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < g.B; ++b) {
    TORCH_CHECK_VALUE(len[b] >= 0, "decode_attention: cache_lens[", b, "] = ", len[b], " is negative");
    TORCH_CHECK_VALUE(len[b] + g.T <= g.S, "decode_attention: cache_lens[", b, "] = ", len[b], " leaves no room for ",
                      g.T, " new token(s): they need positions up to ", len[b] + g.T, ", the cache holds ", g.S);
  }
  const auto compute = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t G = g.Hq / g.Hkv;
  const double sc = decode_attention_scale(scale, g.D);
  at::Tensor out = at::empty({g.B, g.T, g.Hq, g.D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  for (int64_t b = 0; b < g.B; ++b) {
    const int64_t L = len[b], n = L + g.T;
    // Keys and values of the sequence: cache rows 0 .. L-1, then the T new rows ([Hkv, L + T, D]).
    at::Tensor keys = at::cat({k_cache[b].narrow(1, 0, L), k_new[b].transpose(0, 1)}, 1).to(compute);
    at::Tensor vals = at::cat({v_cache[b].narrow(1, 0, L), v_new[b].transpose(0, 1)}, 1).to(compute);
    // Query rows of KV head j: its G heads x T tokens, [Hkv, G * T, D], row g * T + t.
    at::Tensor qb = q[b].to(compute).permute({1, 0, 2}).reshape({g.Hkv, G * g.T, g.D});
    at::Tensor scores = at::bmm(qb, keys.transpose(1, 2)) * sc;  // [Hkv, G * T, L + T]
    // Causal among the new tokens: token t sees positions 0 .. L + t.
    at::Tensor t = at::arange(g.T, at::kLong).repeat({G});                 // [G * T]: each row's token
    at::Tensor allowed = at::arange(n, at::kLong).unsqueeze(0) <= (t + L).unsqueeze(1);  // [G * T, L + T]
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    at::Tensor o = at::bmm(at::softmax(scores, -1), vals);  // [Hkv, G * T, D]
    out[b].copy_(o.view({g.Hkv, G, g.T, g.D}).permute({2, 0, 1, 3}).reshape({g.T, g.Hq, g.D}));
  }
  for (int64_t b = 0; b < g.B; ++b) {  // the cache write: positions L .. L+T-1 of every KV head
    k_cache[b].narrow(1, len[b], g.T).copy_(k_new[b].transpose(0, 1));
    v_cache[b].narrow(1, len[b], g.T).copy_(v_new[b].transpose(0, 1));
  }
  return out;
}

}  // namespace fused

// The op's kernel on this backend, registered here (the schema: csrc/torch_bindings.cpp).
TORCH_LIBRARY_IMPL(fused, CPU, m) { m.impl("decode_attention", fused::decode_attention_cpu); }
