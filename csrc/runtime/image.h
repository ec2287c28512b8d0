// The embedded kernel images are zlib-compressed (aot/compile.py): cubins compress about 4x, and the library is what
// every install, wheel and container layer carries. An image is inflated once, when a device first loads its variant.
#pragma once
#include <vector>

#include "runtime/kernel_table.h"

namespace fused {

// The image's bytes as the driver loads them (a PTX image NUL-terminated). Throws fused::CudaError when zlib
// (libz.so.1, loaded on first use) cannot be loaded or the embedded data does not inflate to the recorded size.
std::vector<unsigned char> inflate_image(const KernelImage& im);

}  // namespace fused
