#include "ops/torch_launch.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace fused {

void launch_on_current_stream(const char* kernel, const std::string& key, const KernelArgs& args, Grid grid,
                              const at::Tensor& like) {
  const int device = like.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  at::Tensor scratch_holder;  // stream-ordered: freed memory is reused only by later work on this stream
  ScratchAllocator scratch = [&](size_t bytes) -> void* {
    scratch_holder = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
    return scratch_holder.data_ptr();
  };
  launch(kernel, key, args, grid, reinterpret_cast<CUstream>(stream), device, scratch);
}

void fill32_on_current_stream(const at::Tensor& t, uint32_t value) {
  TORCH_INTERNAL_ASSERT(t.is_cuda() && t.is_contiguous() && t.element_size() == 4);
  const int device = t.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  memset32(t.data_ptr(), value, static_cast<size_t>(t.numel()), reinterpret_cast<CUstream>(stream), device);
}

at::Tensor zeroed_flags_for_current_stream(int64_t n, const at::Tensor& like) {
  const auto make = [&] {
    at::Tensor f = at::empty({std::max<int64_t>(n, 1)}, like.options().dtype(at::kInt));
    fill32_on_current_stream(f, 0);
    return f;
  };
  if (current_stream_is_capturing(like)) return make();  // the graph's own memory, its memset captured with it
  // Leaked on purpose: tensors must not be freed after the CUDA context is torn down at exit.
  static std::mutex mu;
  static auto* buffers = new std::map<std::pair<int, c10::StreamId>, at::Tensor>();
  const int device = like.get_device();
  const std::pair<int, c10::StreamId> key{device, c10::cuda::getCurrentCUDAStream(device).id()};
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& f = (*buffers)[key];
  if (!f.defined() || f.numel() < n) f = make();  // a smaller one is freed stream-ordered, after its last kernel
  return f;
}

at::Tensor zeros_for_reading(int64_t n, const at::Tensor& like) {
  const auto make = [&](int64_t size) { return at::zeros({size}, like.options()); };
  static std::mutex mu;
  static auto* buffers = new std::map<std::pair<int, at::ScalarType>, at::Tensor>();  // leaked: see above
  const std::pair<int, at::ScalarType> key{like.get_device(), like.scalar_type()};
  const bool capturing = current_stream_is_capturing(like);
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& z = (*buffers)[key];
  if (z.defined() && z.numel() >= n) return z.narrow(0, 0, n);
  if (capturing) return make(n);
  // A larger one replaces it outside a capture only; the old one is kept alive too, as graphs may read it.
  static auto* retired = new std::vector<at::Tensor>();
  if (z.defined()) retired->push_back(z);
  z = make(std::max<int64_t>(n, 4096));
  return z.narrow(0, 0, n);
}

const char* variant_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "fp32";
    case at::kHalf: return "fp16";
    case at::kBFloat16: return "bf16";
    default: return nullptr;
  }
}

bool current_stream_is_capturing(const at::Tensor& like) {
  // Ops call this before their own device guard (an input check). torch's default stream is the NULL handle, which
  // the driver resolves in the current context: stream_is_capturing asks in like's device's context, also from a
  // thread whose current device is another one (a fresh Python thread is on device 0) or that has none yet.
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.get_device()).stream();
  return stream_is_capturing(reinterpret_cast<CUstream>(stream), like.get_device());
}

}  // namespace fused
