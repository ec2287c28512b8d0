#include "runtime/launcher.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "runtime/image.h"
#include "runtime/kernel_table.h"

namespace fused {

KernelArgs& KernelArgs::i32(int64_t v) {
  if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("fused: kernel argument " + std::to_string(items_.size()) + " = " +
                                std::to_string(v) + " does not fit in int32 (tensor too large for this kernel)");
  return push('i', static_cast<uint32_t>(static_cast<int32_t>(v)));
}

KernelArgs& KernelArgs::f32(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return push('f', bits);
}

KernelArgs& KernelArgs::tensor(const void* base, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  if (shape.empty() || shape.size() > 5 || shape.size() != strides.size())
    throw std::invalid_argument("fused: a tensor descriptor needs 1 to 5 dimensions with one stride each");
  descs_.push_back({base, std::move(shape), std::move(strides)});
  return push('t', descs_.size() - 1);
}

namespace {

struct Device {
  int major = -1, minor = -1;
  int max_shared_optin = 0;
  int sm_count = 0;
  std::string name;
  CUcontext primary = nullptr;  // retained on first need, never released (torch keeps it alive as well)
};

struct LoadedFunction {
  CUfunction fn;
  const KernelImage* image;
};

struct PairHash {
  size_t operator()(const std::pair<const void*, const void*>& p) const {
    return std::hash<const void*>()(p.first) * 31 + std::hash<const void*>()(p.second);
  }
};

std::atomic<bool> g_pdl{[] {
  const char* v = std::getenv("FUSED_PDL");
  return !(v && std::strcmp(v, "0") == 0);
}()};
thread_local bool t_no_pdl = false;  // set by NoProgrammaticLaunch on this thread

std::mutex g_mutex;  // guards the caches below; module loading happens under it (first use only)
std::unordered_map<int, Device> g_devices;
std::unordered_map<std::pair<const void*, const void*>, LoadedFunction, PairHash> g_functions;

const std::unordered_map<std::string, std::vector<const KernelVariant*>>& variant_index() {
  static const auto* index = [] {
    auto* m = new std::unordered_map<std::string, std::vector<const KernelVariant*>>();
    for (size_t i = 0; i < kNumVariants; ++i)
      (*m)[std::string(kVariants[i].kernel) + "|" + kVariants[i].key].push_back(&kVariants[i]);
    return m;
  }();
  return *index;
}

Device& device_info(const DriverApi& api, int ordinal) {  // g_mutex held
  auto it = g_devices.find(ordinal);
  if (it != g_devices.end()) return it->second;
  CUdevice dev;
  check(api.DeviceGet(&dev, ordinal), "cuDeviceGet");
  Device d;
  check(api.DeviceGetAttribute(&d.major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
  check(api.DeviceGetAttribute(&d.minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
  check(api.DeviceGetAttribute(&d.max_shared_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
        "cuDeviceGetAttribute");
  check(api.DeviceGetAttribute(&d.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute");
  char name[256] = {0};
  check(api.DeviceGetName(name, sizeof name - 1, dev), "cuDeviceGetName");
  d.name = name;
  return g_devices.emplace(ordinal, d).first->second;
}

// The cubin built for this exact architecture, else one of the same major version and a lower minor (binary
// compatible), else PTX of an architecture not above the device's (the driver compiles it), else nothing.
const KernelImage* choose_image(const KernelVariant& v, const Device& d) {
  const int cc = d.major * 10 + d.minor;
  const KernelImage* best = nullptr;
  for (int i = 0; i < v.num_images; ++i) {
    const KernelImage& im = v.images[i];
    if (!im.is_ptx && im.arch / 10 == d.major && im.arch <= cc && (!best || im.arch > best->arch)) best = &im;
  }
  if (best) return best;
  for (int i = 0; i < v.num_images; ++i)
    if (v.images[i].is_ptx && v.images[i].arch <= cc) return &v.images[i];
  return nullptr;
}

// The context a launch on `device` runs in, current on this thread for the launch's scope: the thread's current
// context when it is on `device` (torch's device guard made it so), else the device's primary context (the one the
// CUDA runtime, and so torch, uses), pushed for the scope and popped again. A launch never changes the calling
// thread's current context: the runtime reads the thread's current device from it, so leaving another one current
// (cuCtxSetCurrent, as this did before) moved a caller without a device guard to another device behind torch's back.
class LaunchContext {
 public:
  LaunchContext(const DriverApi& api, int device) : api_(api) {
    check(api.CtxGetCurrent(&ctx_), "cuCtxGetCurrent");
    if (ctx_) {
      CUdevice cur, want;
      check(api.CtxGetDevice(&cur), "cuCtxGetDevice");
      check(api.DeviceGet(&want, device), "cuDeviceGet");
      if (cur == want) return;
    }
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      Device& d = device_info(api, device);
      if (!d.primary) {
        CUdevice dev;
        check(api.DeviceGet(&dev, device), "cuDeviceGet");
        check(api.DevicePrimaryCtxRetain(&d.primary, dev), "cuDevicePrimaryCtxRetain");
      }
      ctx_ = d.primary;
    }
    check(api.CtxPushCurrent(ctx_), "cuCtxPushCurrent");
    pushed_ = true;
  }
  ~LaunchContext() {
    CUcontext popped;
    if (pushed_) api_.CtxPopCurrent(&popped);  // pops what the constructor pushed; a destructor does not throw
  }
  LaunchContext(const LaunchContext&) = delete;
  LaunchContext& operator=(const LaunchContext&) = delete;
  CUcontext get() const { return ctx_; }

 private:
  const DriverApi& api_;
  CUcontext ctx_ = nullptr;
  bool pushed_ = false;
};

LoadedFunction get_function(const DriverApi& api, const KernelVariant& v, int device, CUcontext ctx) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto key = std::make_pair(static_cast<const void*>(&v), static_cast<const void*>(ctx));
  auto it = g_functions.find(key);
  if (it != g_functions.end()) return it->second;
  const Device& d = device_info(api, device);
  const KernelImage* im = choose_image(v, d);
  if (!im)
    throw CudaError("fused: kernel " + std::string(v.kernel) + " has no image for device " + std::to_string(device) +
                    " (" + d.name + ", sm_" + std::to_string(d.major) + std::to_string(d.minor) +
                    "); this build holds " + kBuiltArchs + ". Rebuild with FUSED_ARCHS including this GPU.");
  if (im->shared_bytes > d.max_shared_optin)
    throw CudaError("fused: kernel " + std::string(v.kernel) + " needs " + std::to_string(im->shared_bytes) +
                    " bytes of shared memory; device " + std::to_string(device) + " allows " +
                    std::to_string(d.max_shared_optin));
  CUmodule mod;
  const std::vector<unsigned char> image = inflate_image(*im);  // the driver keeps its own copy once loaded
  check(api.ModuleLoadData(&mod, image.data()), im->is_ptx ? "cuModuleLoadData (PTX JIT)" : "cuModuleLoadData");
  CUfunction fn;
  check(api.ModuleGetFunction(&fn, mod, im->entry), "cuModuleGetFunction");
  if (im->shared_bytes > 48 * 1024)
    check(api.FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, im->shared_bytes),
          "cuFuncSetAttribute");
  LoadedFunction lf{fn, im};
  g_functions.emplace(key, lf);  // modules live as long as their context: never unloaded
  return lf;
}

// Whether `args` satisfy v's assumptions. Throws if the types disagree (a launcher bug, not a user error).
bool accepts(const KernelVariant& v, const KernelArgs& args) {
  const auto& items = args.items();
  if (static_cast<int>(items.size()) != v.num_args)
    throw std::logic_error("fused: launcher of " + std::string(v.kernel) + " passes " + std::to_string(items.size()) +
                           " arguments, the kernel takes " + std::to_string(v.num_args));
  for (int i = 0; i < v.num_args; ++i) {
    const ArgSpec& a = v.args[i];
    if (items[i].type != a.type)
      throw std::logic_error("fused: launcher of " + std::string(v.kernel) + " passes argument " + a.name +
                             " as '" + items[i].type + "', the kernel expects '" + a.type + "'");
    if (a.type == 't') continue;  // checked when the descriptor is encoded
    int64_t value = a.type == 'i' ? static_cast<int32_t>(items[i].bits) : static_cast<int64_t>(items[i].bits);
    if (a.is_constant && value != a.value) return false;
    if (a.divisibility > 1 && value % a.divisibility != 0) return false;
  }
  return true;
}

// Encodes desc as the CUtensorMap the kernel expects (what Triton's launcher does for a host TensorDescriptor).
void encode_tensor_map(const DriverApi& api, CUtensorMap* map, const KernelArgs::Desc& d, const TmaMeta& m,
                       const char* kernel) {
  const int rank = static_cast<int>(d.shape.size());
  if (rank != m.rank)
    throw std::logic_error("fused: " + std::string(kernel) + ": tensor descriptor of rank " + std::to_string(rank) +
                           " for a kernel argument of rank " + std::to_string(m.rank));
  if (d.strides[rank - 1] != 1)
    throw std::invalid_argument("fused: " + std::string(kernel) + ": a TMA operand needs a contiguous last dimension");
  if (reinterpret_cast<uintptr_t>(d.base) % 16 != 0)
    throw std::invalid_argument("fused: " + std::string(kernel) + ": a TMA operand must be 16-byte aligned");
  cuuint64_t dims[5], strides[5];
  cuuint32_t box[5], elem_strides[5];
  for (int i = 0; i < rank; ++i) {  // the driver wants the innermost dimension first
    dims[i] = static_cast<cuuint64_t>(d.shape[rank - 1 - i]);
    box[i] = m.box[rank - 1 - i];
    elem_strides[i] = 1;
  }
  for (int i = 0; i + 1 < rank; ++i) {
    strides[i] = static_cast<cuuint64_t>(d.strides[rank - 2 - i]) * m.elem_bytes;
    if (strides[i] % 16 != 0)
      throw std::invalid_argument("fused: " + std::string(kernel) + ": TMA operand strides must be multiples of 16 bytes");
  }
  check(api.TensorMapEncodeTiled(map, static_cast<CUtensorMapDataType>(m.elem_type), rank, const_cast<void*>(d.base),
                                 dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 static_cast<CUtensorMapSwizzle>(m.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled");
}

}  // namespace

bool has_variant(const char* kernel, const std::string& key, int cc) {
  const auto it = variant_index().find(std::string(kernel) + "|" + key);
  if (it == variant_index().end()) return false;
  if (cc < 0) return true;
  Device d;
  d.major = cc / 10;
  d.minor = cc % 10;
  for (const KernelVariant* v : it->second)
    if (choose_image(*v, d)) return true;
  return false;
}

const char* built_archs() { return kBuiltArchs; }

int device_capability(int device) {
  const DriverApi& api = driver();
  std::lock_guard<std::mutex> lock(g_mutex);
  const Device& d = device_info(api, device);
  return d.major * 10 + d.minor;
}

int device_sm_count(int device) {
  const DriverApi& api = driver();
  std::lock_guard<std::mutex> lock(g_mutex);
  return device_info(api, device).sm_count;
}

bool set_programmatic_launch(bool enabled) { return g_pdl.exchange(enabled); }

NoProgrammaticLaunch::NoProgrammaticLaunch() : prev_(t_no_pdl) { t_no_pdl = true; }
NoProgrammaticLaunch::~NoProgrammaticLaunch() { t_no_pdl = prev_; }

void memset32(void* ptr, uint32_t value, size_t count, CUstream stream, int device) {
  if (count == 0) return;
  const DriverApi& api = driver();
  const LaunchContext ctx(api, device);
  check(api.MemsetD32Async(reinterpret_cast<CUdeviceptr>(ptr), value, count, stream), "cuMemsetD32Async");
}

bool stream_is_capturing(CUstream stream, int device) {
  const DriverApi& api = driver();
  const LaunchContext ctx(api, device);  // the NULL handle resolves in the current context: the device's
  CUstreamCaptureStatus status;
  check(api.StreamIsCapturing(stream, &status), "cuStreamIsCapturing");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void launch(const char* kernel, const std::string& key, const KernelArgs& args, Grid grid, CUstream stream,
            int device, const ScratchAllocator& scratch) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  auto it = variant_index().find(std::string(kernel) + "|" + key);
  if (it == variant_index().end())
    throw std::invalid_argument("fused: no compiled variant of " + std::string(kernel) + " for " + key);
  const KernelVariant* chosen = nullptr;
  for (const KernelVariant* v : it->second)
    if (accepts(*v, args)) {
      chosen = v;
      break;
    }
  if (!chosen)
    throw std::invalid_argument("fused: no compiled variant of " + std::string(kernel) + " for " + key +
                                " accepts these arguments (alignment or strides)");
  if (grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu)
    throw std::invalid_argument("fused: grid too large for " + std::string(kernel));

  const DriverApi& api = driver();
  const LaunchContext ctx(api, device);  // current until the launch below has been issued
  LoadedFunction lf = get_function(api, *chosen, device, ctx.get());

  // Pack the runtime parameters: the non-constant arguments in order (a tensor descriptor expands to its
  // CUtensorMap, then its shape as int32s and its strides as int64s), then Triton's two scratch pointers.
  constexpr int kMaxParams = 96, kMaxMaps = 4;
  const auto& items = args.items();
  uint64_t slots[kMaxParams];
  void* params[kMaxParams + 2];
  alignas(64) CUtensorMap maps[kMaxMaps];
  int n = 0, n_maps = 0;
  auto push = [&](uint64_t bits) {
    if (n >= kMaxParams) throw std::logic_error("fused: too many kernel parameters for " + std::string(kernel));
    slots[n] = bits;
    params[n] = &slots[n];
    ++n;
  };
  for (int i = 0; i < chosen->num_args; ++i) {
    if (chosen->args[i].is_constant) continue;
    if (items[i].type != 't') {
      push(items[i].bits);
      continue;
    }
    if (n_maps >= kMaxMaps || n_maps >= lf.image->num_tma)
      throw std::logic_error("fused: " + std::string(kernel) + ": more tensor descriptors than the kernel takes");
    const KernelArgs::Desc& d = args.descs()[items[i].bits];
    encode_tensor_map(api, &maps[n_maps], d, lf.image->tma[n_maps], kernel);
    if (n >= kMaxParams) throw std::logic_error("fused: too many kernel parameters");
    params[n++] = &maps[n_maps++];
    for (int64_t s : d.shape) push(static_cast<uint32_t>(static_cast<int32_t>(s)));
    for (int64_t s : d.strides) push(static_cast<uint64_t>(s));
  }
  CUdeviceptr global_scratch = 0, profile_scratch = 0;
  if (lf.image->global_scratch_size > 0) {
    if (!scratch) throw std::logic_error("fused: kernel " + std::string(kernel) + " needs global scratch");
    size_t programs = size_t(grid.x) * grid.y * grid.z * lf.image->num_ctas;
    global_scratch = reinterpret_cast<CUdeviceptr>(scratch(programs * lf.image->global_scratch_size));
  }
  params[n++] = &global_scratch;
  params[n++] = &profile_scratch;

  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  CUlaunchAttribute attrs[2];
  std::memset(attrs, 0, sizeof attrs);
  cfg.attrs = attrs;
  cfg.gridDimX = grid.x * lf.image->num_ctas;
  cfg.gridDimY = grid.y;
  cfg.gridDimZ = grid.z;
  cfg.blockDimX = 32 * lf.image->num_warps;
  cfg.blockDimY = 1;
  cfg.blockDimZ = 1;
  cfg.sharedMemBytes = lf.image->shared_bytes;
  cfg.hStream = stream;
  if (lf.image->num_ctas > 1) {
    CUlaunchAttribute& a = attrs[cfg.numAttrs++];
    a.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    a.value.clusterDim.x = lf.image->num_ctas;
    a.value.clusterDim.y = 1;
    a.value.clusterDim.z = 1;
  }
  // The kernel waits for its predecessor before any memory access (kernels/pdl.py), so it may be launched early.
  if (lf.image->pdl && g_pdl.load(std::memory_order_relaxed) && !t_no_pdl) {
    CUlaunchAttribute& a = attrs[cfg.numAttrs++];
    a.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    a.value.programmaticStreamSerializationAllowed = 1;
  }
  check(api.LaunchKernelEx(&cfg, lf.fn, params, nullptr), (std::string("launching ") + kernel).c_str());
}

}  // namespace fused
