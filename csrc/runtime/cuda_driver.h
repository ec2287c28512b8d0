// The CUDA driver API, loaded lazily with dlopen so the library imports on machines with no GPU or libcuda.
#pragma once
#include <cuda.h>

#include <stdexcept>
#include <string>

namespace fused {

// Every driver failure becomes this exception (torch turns it into a Python RuntimeError).
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct DriverApi {
  decltype(&::cuGetErrorString) GetErrorString;
  decltype(&::cuGetErrorName) GetErrorName;
  decltype(&::cuInit) Init;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent;
  decltype(&::cuCtxPushCurrent) CtxPushCurrent;
  decltype(&::cuCtxPopCurrent) CtxPopCurrent;
  decltype(&::cuCtxGetDevice) CtxGetDevice;
  decltype(&::cuDeviceGet) DeviceGet;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute;
  decltype(&::cuDeviceGetName) DeviceGetName;
  decltype(&::cuDevicePrimaryCtxRetain) DevicePrimaryCtxRetain;
  decltype(&::cuModuleLoadData) ModuleLoadData;
  decltype(&::cuModuleGetFunction) ModuleGetFunction;
  decltype(&::cuFuncSetAttribute) FuncSetAttribute;
  decltype(&::cuLaunchKernelEx) LaunchKernelEx;
  decltype(&::cuMemsetD32Async) MemsetD32Async;
  decltype(&::cuTensorMapEncodeTiled) TensorMapEncodeTiled;
  decltype(&::cuStreamIsCapturing) StreamIsCapturing;
};

// Loads libcuda.so.1 on first use (thread-safe); throws CudaError if it cannot.
const DriverApi& driver();

// Throws CudaError("<what>: <CUDA error name>: <description>") unless r == CUDA_SUCCESS.
void check(CUresult r, const char* what);

}  // namespace fused
