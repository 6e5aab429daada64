// Narrowing float32 to the 16-bit wire dtypes, scaled: out[k] = round(in[k] * scale),
// rounded to nearest even once, after the (float) multiplication -- bit for bit what
// c10::BFloat16(float) / c10::Half(float) give for in[k] * scale (a NaN becomes a quiet NaN).
//
// The reducer narrows every bucket onto the wire when compression="bf16"/"fp16". ATen's
// at::vec is compiled for one CPU capability in an extension (the baseline: scalar
// conversions, measured 25 ms for 25.6M floats against 6 ms for ATen's own copy_); these
// loops are compiled for AVX-512, AVX2 and the baseline, and the best is picked when the
// library loads (GCC's target_clones), so the narrowing runs at memory speed.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace torchstrategy {

void narrow_to_bf16(const float* in, c10::BFloat16* out, int64_t n, float scale);
void narrow_to_fp16(const float* in, c10::Half* out, int64_t n, float scale);

}  // namespace torchstrategy
