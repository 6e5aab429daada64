// Compiling a loop for several CPU levels at once. An extension's at::vec is built for one
// level (the baseline), while ATen's own kernels pick AVX2/AVX-512 at run time; loops marked
// TORCHSTRATEGY_CLONES are compiled for x86-64-v4 (AVX-512), v3 (AVX2, FMA, F16C) and the
// baseline, and the loader picks the best for the machine (GCC's target_clones, an ifunc).
// Elsewhere (other compilers, other architectures) the mark is empty: one plain build.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define TORCHSTRATEGY_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define TORCHSTRATEGY_HAS_FLOAT16 1  // _Float16, converted by F16C where it exists
#else
#define TORCHSTRATEGY_CLONES
#define TORCHSTRATEGY_HAS_FLOAT16 0
#endif
