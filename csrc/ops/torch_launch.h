// The torch side of a launch: the tensor's device, torch's current stream on it, scratch from torch's allocator.
#pragma once
#include <ATen/ATen.h>

#include "runtime/launcher.h"

namespace fused {

// Launches on the current CUDA stream of `like`'s device (the caller holds a device guard for it).
void launch_on_current_stream(const char* kernel, const std::string& key, const KernelArgs& args, Grid grid,
                              const at::Tensor& like);

// Whether torch's current stream on `like`'s device is capturing a CUDA graph (no host syncs allowed then).
bool current_stream_is_capturing(const at::Tensor& like);

}  // namespace fused
