// The table of AOT-compiled kernels that aot/compile.py generates (build/aot/kernels_gen.cpp).
// Framework-free: no torch here.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fused {

// One call argument of a kernel, as the manifest declares it.
struct ArgSpec {
  const char* name;
  char type;         // 'p' device pointer, 'i' int32, 'l' int64, 'f' float32, 't' tensor descriptor
  int is_constant;   // compiled in as `value`: not passed, but the caller must supply exactly `value`
  int divisibility;  // 16: the value (a pointer: its address in bytes) must be divisible by 16
  int64_t value;
};

// How the compiler lowered one tensor-descriptor argument (Triton's tensordesc_meta): the launcher encodes the
// CUtensorMap from this at launch time, since the swizzle and box size are the compiler's choice.
struct TmaMeta {
  int swizzle;      // CUtensorMapSwizzle (3 = 128 bytes)
  int elem_bytes;
  int elem_type;    // CUtensorMapDataType (host enum)
  int rank;
  uint32_t box[5];  // block size, outermost first
};

// One compiled image of a variant: a cubin for one architecture, or PTX that the driver compiles.
struct KernelImage {
  int arch;  // 90 means sm_90(a)
  int is_ptx;
  const unsigned char* data;  // zlib-compressed (runtime/image.h)
  size_t size;                 // the image's bytes inflated (a PTX image: with its terminating NUL)
  size_t stored_size;          // the bytes at `data`
  const char* entry;
  int shared_bytes;
  int num_warps;
  int num_ctas;
  int global_scratch_size;  // bytes per program; the launcher allocates it when non-zero
  int global_scratch_align;
  const TmaMeta* tma;  // one per tensor-descriptor argument, in argument order
  int num_tma;
  int pdl;  // compiled with PDL (kernels/pdl.py): launched with programmatic stream serialization
};

struct KernelVariant {
  const char* kernel;  // the @triton.jit function's name
  const char* key;     // "dtype=bf16,thd=0,..." (keys sorted)
  const ArgSpec* args;
  int num_args;
  const KernelImage* images;
  int num_images;
};

extern const KernelVariant kVariants[];
extern const size_t kNumVariants;
extern const char* const kBuiltArchs;

// One bucket of a kernel's config table (aot/configs/sm<arch>.json, aot/config_table.py), for each architecture
// this build holds: its m range and shape class. The launchers look configs up through runtime/kernel_configs.h.
struct KernelConfig {
  const char* kernel;  // "routed_linear_tma_kernel"
  const char* family;  // "half" (bf16, fp16) | "tf32" | "ieee" | "all"
  int arch;            // 90
  int64_t max_m;       // the bucket serves m <= max_m; -1: every larger m (the last bucket of its class)
  int64_t max_n;       // its shape class: GEMMs of n <= max_n output columns; -1: any n
  int64_t max_k;       // and of reduction k <= max_k; -1: any k
  int w_transposed;    // and of this orientation: 1 the grad-input GEMM (W transposed), 0 the forward; -1: either
  int block[3];        // the kernel's tile (its meaning per kernel: aot/config_table.py KERNELS)
  int group;           // GROUP_M / GROUP_N
  int warps, stages;
  int stream_k;        // R > 0: the last R rounds' K steps shared out over one program per SM ("stream_k" in the table)
  const char* cfg;     // the "cfg=" value in the keys of the variants compiled from it
};
extern const KernelConfig kConfigs[];  // per (kernel, family, arch): classes, each's buckets in increasing max_m
extern const size_t kNumConfigs;
extern const int kArchs[];  // the built architectures, increasing
extern const size_t kNumArchs;

// The flag combinations a flagged kernel is compiled for, which are the ones its launcher may ask for
// (aot/manifest.py FLAG_SETS, the one list of them): each an int whose bits are the kernel's flags in the manifest's
// order, the first the highest.
struct FlagSet {
  const char* kernel;
  int num_flags;
  const int* combos;
  int num_combos;
};
extern const FlagSet kFlagSets[];
extern const size_t kNumFlagSets;

}  // namespace fused
