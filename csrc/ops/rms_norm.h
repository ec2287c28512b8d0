// RMSNorm over the last dimension (the contract: csrc/torch_bindings.cpp `rms_norm`; the kernel: kernels/rms_norm.py):
// the shared argument checks and the per-backend entry points.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

#include "ops/torch_launch.h"

namespace fused {

// The checks every backend runs first, on symbolic sizes (the Meta kernel's too): ValueError (TORCH_CHECK_VALUE) for
// an x with no dimension, a weight that is not [x.size(-1)], a weight dtype other than x's, or an eps that is negative
// or not finite; RuntimeError for tensors on different devices.
void check_rms_norm_inputs(const at::Tensor& x, const at::Tensor& weight, double eps);

// Backends: out, x's shape and dtype, contiguous.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps);

// Every variant the CUDA launcher can ask for on a device of compute capability cc (variant_check.cpp).
std::vector<VariantRequest> rms_norm_requestable_variants(int cc);

}  // namespace fused
