#include "runtime/cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace fused {
namespace {

DriverApi g_api;
std::string g_load_error;

// STR(X) after macro expansion: cuda.h maps some names to versioned symbols (e.g. *_v2).
#define FUSED_STR2(x) #x
#define FUSED_STR(x) FUSED_STR2(x)

void load() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    g_load_error = std::string("fused: cannot load the CUDA driver (libcuda.so.1): ") + (why ? why : "unknown") +
                   ". The CUDA kernels need an NVIDIA GPU and driver; the CPU ops work without them.";
    return;
  }
#define FUSED_LOAD(field, fn)                                                                 \
  g_api.field = reinterpret_cast<decltype(g_api.field)>(dlsym(lib, FUSED_STR(fn)));         \
  if (!g_api.field) {                                                                         \
    g_load_error = std::string("fused: the CUDA driver lacks ") + FUSED_STR(fn) +             \
                   " (driver too old: CUDA 12.0 or newer is required)";                       \
    return;                                                                                   \
  }
  FUSED_LOAD(GetErrorString, cuGetErrorString)
  FUSED_LOAD(GetErrorName, cuGetErrorName)
  FUSED_LOAD(Init, cuInit)
  FUSED_LOAD(CtxGetCurrent, cuCtxGetCurrent)
  FUSED_LOAD(CtxPushCurrent, cuCtxPushCurrent)
  FUSED_LOAD(CtxPopCurrent, cuCtxPopCurrent)
  FUSED_LOAD(CtxGetDevice, cuCtxGetDevice)
  FUSED_LOAD(DeviceGet, cuDeviceGet)
  FUSED_LOAD(DeviceGetAttribute, cuDeviceGetAttribute)
  FUSED_LOAD(DeviceGetName, cuDeviceGetName)
  FUSED_LOAD(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain)
  FUSED_LOAD(ModuleLoadData, cuModuleLoadData)
  FUSED_LOAD(ModuleGetFunction, cuModuleGetFunction)
  FUSED_LOAD(FuncSetAttribute, cuFuncSetAttribute)
  FUSED_LOAD(LaunchKernelEx, cuLaunchKernelEx)
  FUSED_LOAD(MemsetD32Async, cuMemsetD32Async)
  FUSED_LOAD(TensorMapEncodeTiled, cuTensorMapEncodeTiled)
  FUSED_LOAD(StreamIsCapturing, cuStreamIsCapturing)
#undef FUSED_LOAD
  CUresult r = g_api.Init(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    g_api.GetErrorName(r, &name);
    g_load_error = std::string("fused: cuInit failed: ") + (name ? name : "unknown error");
  }
}

}  // namespace

const DriverApi& driver() {
  static std::once_flag once;
  std::call_once(once, load);
  if (!g_load_error.empty()) throw CudaError(g_load_error);
  return g_api;
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const DriverApi& api = driver();
  const char* name = nullptr;
  const char* desc = nullptr;
  api.GetErrorName(r, &name);
  api.GetErrorString(r, &desc);
  throw CudaError(std::string("fused: ") + what + " failed: " + (name ? name : "CUDA error " + std::to_string(r)) +
                  (desc ? std::string(": ") + desc : std::string()));
}

}  // namespace fused
