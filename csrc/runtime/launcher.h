// Launching AOT-compiled Triton kernels: variant choice, per-context module cache, typed arguments.
// Framework-free: raw pointers, sizes and a CUstream. Every failure throws fused::CudaError.
#pragma once
#include <cuda.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/cuda_driver.h"

namespace fused {

// A kernel's call arguments in the manifest's order (aot/manifest.py). Types are checked against the variant
// table at launch, so a launcher that drifts from its kernel gets an error, not a corrupt launch.
class KernelArgs {
 public:
  KernelArgs() { items_.reserve(48); }
  KernelArgs& ptr(const void* p) { return push('p', reinterpret_cast<uint64_t>(p)); }
  KernelArgs& i32(int64_t v);  // throws if v does not fit in int32
  KernelArgs& i64(int64_t v) { return push('l', static_cast<uint64_t>(v)); }
  KernelArgs& f32(float v);
  // A tensor-descriptor argument (TMA): base pointer, shape and strides in elements, outermost first; the last
  // stride must be 1. The launcher encodes the CUtensorMap with the box and swizzle the compiler chose.
  KernelArgs& tensor(const void* base, std::vector<int64_t> shape, std::vector<int64_t> strides);

  struct Desc {
    const void* base;
    std::vector<int64_t> shape, strides;
  };
  const std::vector<Desc>& descs() const { return descs_; }

  struct Item {
    char type;
    uint64_t bits;  // the value's bytes, little-endian, in the low bytes ('t': index into descs())
  };
  const std::vector<Item>& items() const { return items_; }

 private:
  KernelArgs& push(char t, uint64_t bits) {
    items_.push_back({t, bits});
    return *this;
  }
  std::vector<Item> items_;
  std::vector<Desc> descs_;
};

// The fields of the argument structs that aot/cpp_decls.py generates for every kernel (build/aot/kernel_decls.h,
// namespace fused::kernel_args), filled by name with designated initializers. None has a default constructor, so a
// launcher that leaves an argument out does not compile; a pointer does not convert to an integer nor the reverse.
struct PtrArg {
  const void* p;
  PtrArg(const void* ptr) : p(ptr) {}  // NOLINT(google-explicit-constructor): filled as `.x_ptr = t.data_ptr()`
};
struct I32Arg {
  int64_t v;  // checked to fit in int32 when packed
  I32Arg(int64_t value) : v(value) {}  // NOLINT(google-explicit-constructor)
};
struct I64Arg {
  int64_t v;
  I64Arg(int64_t value) : v(value) {}  // NOLINT(google-explicit-constructor)
};
struct F32Arg {
  float v;
  F32Arg(float value) : v(value) {}  // NOLINT(google-explicit-constructor)
};
struct DescArg {  // a tensor descriptor: base, shape and strides in elements, outermost first (KernelArgs::tensor)
  const void* base;
  std::vector<int64_t> shape, strides;
  DescArg(const void* b, std::vector<int64_t> sh, std::vector<int64_t> st)
      : base(b), shape(std::move(sh)), strides(std::move(st)) {}
};

// Allocates `bytes` of device memory that stays valid until the kernel has run on the stream (torch's caching
// allocator in the torch layer). Only kernels that need global scratch call it.
using ScratchAllocator = std::function<void*(size_t bytes)>;

struct Grid {
  uint32_t x = 1, y = 1, z = 1;
};

// ceil(a / b) for a >= 0, b > 0: the programs of a grid over a blocks of b.
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Launches kernel `kernel` (the @triton.jit name) with variant key `key` ("dtype=bf16,thd=0,..."): takes the
// first compiled variant whose assumptions (alignment, constant arguments) the arguments satisfy, loads its image
// for `device` (a CUDA ordinal) in the current context if not loaded yet, and launches it on `stream`.
// An empty grid launches nothing.
void launch(const char* kernel, const std::string& key, const KernelArgs& args, Grid grid, CUstream stream,
            int device, const ScratchAllocator& scratch = nullptr);

// Sets `count` 32-bit words at `ptr` (device memory of `device`) to `value`, in stream order on `stream`: one driver
// memset, cheaper on the host than a fill kernel (and capturable in a CUDA graph).
void memset32(void* ptr, uint32_t value, size_t count, CUstream stream, int device);

// Whether any variant was compiled for (kernel, key): lets ops give a clear error for unsupported combinations.
// With cc >= 0: one that a device of compute capability cc can run (a cubin of its major version not above it, or
// PTX not above it), as the launcher chooses images.
bool has_variant(const char* kernel, const std::string& key, int cc = -1);

// Compute capability (e.g. 90) and multiprocessor count of a CUDA device (cached after the first call).
int device_capability(int device);
int device_sm_count(int device);

// Programmatic dependent launch (kernels/pdl.py): kernels compiled with it (the routed ops' kernels on sm_90) start
// while the previous kernel in the stream finishes, and wait for it before touching memory. On by default unless the
// environment sets FUSED_PDL=0; returns the previous setting. For A/B measurements and as a switch-off if a driver
// misbehaves: results are the same either way.
bool set_programmatic_launch(bool enabled);

// While one lives, this thread's launches go without programmatic dependent launch whatever the switch above says:
// for a sequence of kernels measured slower with it. Nests; results do not change.
class NoProgrammaticLaunch {
 public:
  NoProgrammaticLaunch();
  ~NoProgrammaticLaunch();
  NoProgrammaticLaunch(const NoProgrammaticLaunch&) = delete;
  NoProgrammaticLaunch& operator=(const NoProgrammaticLaunch&) = delete;

 private:
  bool prev_;
};

// Whether `stream` (of device `device`; the NULL handle is its default stream) is capturing a CUDA graph. Asked in the
// device's context, whatever the calling thread's current one (none, in a fresh thread).
bool stream_is_capturing(CUstream stream, int device);

// "sm_80, sm_89, sm_90 (+PTX sm_80)": the architectures this build holds.
const char* built_archs();

}  // namespace fused
