// Every op schema of the library, one `def` each: grep an op name here to find its contract.
// Implementations register per dispatch key in csrc/ops/*_{cpu,cuda,meta,autograd}.cpp.
#include <torch/library.h>

#include "ops/decode_attention.h"
#include "ops/rope.h"
#include "ops/routed_gemm.h"
#include "runtime/kernel_configs.h"
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
  // Decode attention against a KV cache, the new tokens' keys and values written into it in the same launch.
  // q [B, T, Hq, D] (T = 1..16 new tokens per sequence); k_new, v_new [B, T, Hkv, D] (after RoPE), Hq a multiple of
  // Hkv (grouped-query attention: query head h reads KV head h / (Hq / Hkv)); k_cache, v_cache [B, Hkv, S, D] (any
  // strides with the last dimension contiguous, also for q / k_new / v_new: views of a fused QKV output need no copy);
  // cache_lens int32 [B] on q's device: the positions already in the cache of each sequence (ragged). Writes k_new /
  // v_new at positions [cache_lens[b], cache_lens[b] + T) of the caches and returns out [B, T, Hq, D] (contiguous, q's
  // dtype): query t of sequence b attends positions 0 .. cache_lens[b] + t (causal among the new tokens), with
  // softmax scale `scale` (default 1/sqrt(D)). cache_lens is not advanced (the caller adds T). CUDA: bf16 / fp16, D
  // 64, 128 or 256, caches 16-byte aligned with strides that are multiples of 16 elements (any torch allocation; a
  // view off 16 bytes raises ValueError; such a q / k_new / v_new is copied); no host sync and nothing that depends
  // on cache_lens' values on the host (CUDA-graph capturable,
  // one graph for every length); a sequence with cache_lens[b] < 0 or cache_lens[b] + T > S gets NaN outputs and no
  // cache write (checking would sync the host: the caller validates lengths up front). CPU: also float32 / float64,
  // any D; such a length raises ValueError naming cache_lens.
  m.def("decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, "
        "Tensor cache_lens, float? scale=None) -> Tensor");
  // RMSNorm over x's last dimension: x * rsqrt(mean(x^2, -1) + eps) * weight, in float32 (float64 for float64) and
  // rounded once to x's dtype, as torch's F.rms_norm computes it; weight [x.size(-1)] of x's dtype. CUDA: float32,
  // float16, bfloat16, any strides; one program per row with programmatic dependent launch (a decode step's norms).
  // Differentiable: with a gradient asked for, torch's at::rms_norm computes it (csrc/ops/rms_norm_autograd.cpp).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // The routing of a bool mask (any shape; M = its number of elements), int32 [shared_routing_size(M)]
  // (csrc/ops/routed_gemm.h): computed once, it serves as the `routing` argument of every routed op (linear_dual, ffn
  // and their backward) on the same mask, which then route nothing. Its contents are trusted on CUDA and checked
  // against the mask on the CPU.
  m.def("route(Tensor mask) -> Tensor");
  // Modality-routed linear (docs/design.md): out[i] = x[i]·weight_vᵀ + bias_v if mask[i] else x[i]·weight_tᵀ + bias_t.
  // x [..., K]; mask bool [...] (x's leading shape); weights [N, K] (nn.Linear layout), or both experts stacked in
  // weight_v [2, N, K] (text [0], vision [1]) with weight_t None; biases [N]; out [..., N].
  // routing: route(mask) (or linear_dual_forward's routing of mask), or None (the op routes mask itself). residual: a
  // tensor of the output's shape added to it in the GEMM's epilogue (a transformer block's `h + dense(attn)` in one
  // kernel; its gradient is the output's).
  m.def("linear_dual(Tensor x, Tensor mask, Tensor weight_v, Tensor? weight_t, Tensor? bias_v=None, "
        "Tensor? bias_t=None, bool allow_tf32=False, Tensor? routing=None, Tensor? residual=None) -> Tensor");
  // linear_dual and the routing of mask it used (int32 [M + 264]; layout: csrc/ops/routed_gemm.h), for
  // linear_dual_backward: what autograd's forward calls and saves (given a routing, it calls linear_dual and saves
  // that).
  m.def("linear_dual_forward(Tensor x, Tensor mask, Tensor weight_v, Tensor? weight_t, Tensor? bias_v=None, "
        "Tensor? bias_t=None, bool allow_tf32=False, Tensor? residual=None) -> (Tensor, Tensor)");
  // Gradients of linear_dual: (grad_x, grad_weight_v, grad_weight_t, grad_bias_v, grad_bias_t); stacked weights:
  // grad_weight_v [2, N, K] and grad_weight_t None. output_mask says which to compute, in that order; the others are
  // returned undefined (None), and their work is skipped. routing:
  // linear_dual_forward's or route()'s routing of the same mask (then nothing is routed again), or None. A routing's
  // dtype, device and size (which pins M) are checked, its contents only on the CPU: on a GPU that would sync the
  // host, so there it is trusted to be the mask's, as flash-attention trusts its forward's saved tensors.
  m.def("linear_dual_backward(Tensor grad_out, Tensor x, Tensor mask, Tensor weight_v, Tensor? weight_t, "
        "bool allow_tf32=False, bool[5] output_mask=[True, True, True, True, True], Tensor? routing=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // SwiGLU MLP w2(silu(x·w1ᵀ) ⊙ x·w3ᵀ). x [..., H]; w1 (gate), w3 (up) [I, H]; w2 (down) [H, I]; out [..., H].
  // Dual expert (mask, u*): token i uses w* if mask[i] (vision) else u* (text), u* of w*'s shapes. Stacked (mask
  // given, u* None): w1, w3 [2, I, H] and w2 [2, H, I] hold both experts, [0] text and [1] vision.
  // routing (dual expert only): route(mask), or None (the op routes mask itself). recompute (autograd only): False
  // saves the gate and up pre-activations for the backward (ffn_forward: 2 * I elements per token), True saves only
  // the inputs and the backward computes gate and up again (two more GEMMs); the output is the same. residual: a
  // tensor of x's shape added to the output in the down projection's epilogue (a transformer block's residual add,
  // `residual + mlp(norm(residual))` in one kernel; its gradient is the output's).
  m.def("ffn(Tensor x, Tensor w1, Tensor w3, Tensor w2, Tensor? mask=None, Tensor? u1=None, Tensor? u3=None, "
        "Tensor? u2=None, bool allow_tf32=False, Tensor? routing=None, bool recompute=False, Tensor? residual=None) "
        "-> Tensor");
  // ffn's output and gate_up, x.shape[:-1] + [2 * I]: the gate and up pre-activations x·w1ᵀ, x·w3ᵀ of each token's
  // own expert, in token order, what ffn_backward reads instead of recomputing them (ffn's autograd calls this).
  m.def("ffn_forward(Tensor x, Tensor w1, Tensor w3, Tensor w2, Tensor? mask=None, Tensor? u1=None, Tensor? u3=None, "
        "Tensor? u2=None, bool allow_tf32=False, Tensor? routing=None, Tensor? residual=None) -> (Tensor, Tensor)");
  // Gradients of ffn: (grad_x, grad_w1, grad_w3, grad_w2, grad_u1, grad_u3, grad_u2) (slots named in csrc/ops/ffn.h
  // FfnGradSlot), the u gradients None for the single and the stacked expert (whose grad_w* are stacked too).
  // output_mask says which to compute, in that order; the others are returned undefined (None), and their work is
  // skipped (dh and the SwiGLU gradients run whatever is asked). routing: as for ffn. gate_up: ffn_forward's, or None
  // (gate and up recomputed from x).
  m.def("ffn_backward(Tensor grad_out, Tensor x, Tensor w1, Tensor w3, Tensor w2, Tensor? mask=None, Tensor? u1=None, "
        "Tensor? u3=None, Tensor? u2=None, bool allow_tf32=False, "
        "bool[7] output_mask=[True, True, True, True, True, True, True], Tensor? routing=None, "
        "Tensor? gate_up=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Turns the input checks that read device memory (cu_seqlens, start_positions: a host sync) on or off;
  // returns the previous setting. They are always skipped during CUDA graph capture.
  m.def("set_sync_checks(bool enabled) -> bool", [](bool enabled) { return fused::set_sync_checks(enabled); });
  // Programmatic dependent launch of the routed ops' kernels on sm_90 (csrc/runtime/launcher.h) on or off; returns the
  // previous setting. Results do not change, only how early a kernel may be launched.
  m.def("set_programmatic_launch(bool enabled) -> bool",
        [](bool enabled) { return fused::set_programmatic_launch(enabled); });
  // The GPU architectures this build holds kernels for, e.g. "sm_80, sm_89, sm_90 (+PTX sm_80)".
  m.def("built_archs() -> str", []() { return std::string(fused::built_archs()); });
  // The block config ("128x256x64_g8_w8_s3") the launchers pick for `kernel` (e.g. "routed_linear_tma_kernel"),
  // family ("half" = bf16/fp16, "tf32", "ieee"; "all" for rope_kernel) and m rows of a GEMM with n output columns and
  // reduction k (-1: unknown, the general class), wt the linear GEMMs' orientation (1: the grad-input, W transposed;
  // 0: the forward; -1: unknown) on a device of compute capability cc (e.g. 90), from the tables of aot/configs/
  // compiled into this build. Needs no GPU.
  m.def("kernel_config(str kernel, str family, int cc, int m, int n=-1, int k=-1, int wt=-1) -> str",
        [](const std::string& kernel, const std::string& family, int64_t cc, int64_t m, int64_t n, int64_t k,
           int64_t wt) {
          return std::string(fused::kernel_config(kernel.c_str(), family.c_str(), static_cast<int>(cc), m, n, k,
                                                  static_cast<int>(wt)).cfg);
        });
  // Diagnostic for benchmarks/bench_config_lookup.py: mean nanoseconds of one launcher-side lookup (find_config, as
  // the launchers call it: a hash lookup and a bucket scan), over `iters` lookups cycling through m = 1 .. 2^16.
  m.def("_config_lookup_ns(int iters) -> float", [](int64_t iters) { return fused::time_config_lookups(iters); });
  // The build's variant check (csrc/ops/variant_check.cpp), as "sm_<arch> <kernel>: <key>": every variant the
  // launchers can ask for on a built architecture, and those of them this build did not compile. Needs no GPU.
  // The launchers' sizing rules (csrc/ops/routed_gemm.h), for the test that they equal the Python launchers'.
  m.def("_one_block_size(int m) -> int", [](int64_t m) { return fused::routed::one_block_size(m); });
  m.def("_decode_split(int n, int k, int bn, int bk, int sms) -> int[]",
        [](int64_t n, int64_t k, int64_t bn, int64_t bk, int64_t sms) {
          const auto [n_split, k_split] = fused::routed::decode_split(n, k, bn, bk, sms);
          return std::vector<int64_t>{n_split, k_split};
        });
  m.def("_decode_attention_split(int programs, int S, int block_n, int sms) -> int",
        [](int64_t programs, int64_t S, int64_t block_n, int64_t sms) {
          return fused::decode_attention_split(programs, S, block_n, sms);
        });
  m.def("_requestable_variants() -> str[]");
  m.def("_missing_variants() -> str[]");
}
