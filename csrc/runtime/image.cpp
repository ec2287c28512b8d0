#include "runtime/image.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "runtime/cuda_driver.h"

namespace fused {
namespace {

// zlib's uncompress(dest, &dest_len, source, source_len), loaded at run time like the CUDA driver: the library needs
// no zlib headers or link-time library, and libz.so.1 is on every system that runs Python.
using Uncompress = int (*)(unsigned char*, unsigned long*, const unsigned char*, unsigned long);

Uncompress uncompress_fn() {
  static Uncompress fn = nullptr;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libz.so", RTLD_NOW | RTLD_LOCAL);
    if (lib) fn = reinterpret_cast<Uncompress>(dlsym(lib, "uncompress"));
    if (!fn) {
      const char* why = dlerror();
      error = std::string("fused: cannot load zlib (libz.so.1), which inflates the embedded kernel images: ") +
              (why ? why : "no uncompress symbol");
    }
  });
  if (!fn) throw CudaError(error);
  return fn;
}

}  // namespace

std::vector<unsigned char> inflate_image(const KernelImage& im) {
  std::vector<unsigned char> out(im.size);
  unsigned long len = im.size;
  const int rc = uncompress_fn()(out.data(), &len, im.data, im.stored_size);
  if (rc != 0 || len != im.size)
    throw CudaError("fused: the embedded image of " + std::string(im.entry) + " (sm_" + std::to_string(im.arch) +
                    (im.is_ptx ? " PTX" : "") + ") does not inflate (zlib error " + std::to_string(rc) + ", " +
                    std::to_string(len) + " of " + std::to_string(im.size) + " bytes): the library is damaged");
  return out;
}

}  // namespace fused
