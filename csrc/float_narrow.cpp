// See float_narrow.h.
#include "float_narrow.h"

#include "cpu_levels.h"

#include <cstring>

namespace torchstrategy {
namespace {

TORCHSTRATEGY_CLONES
void bf16_loop(const float* in, uint16_t* out, int64_t n, float scale) {
  for (int64_t k = 0; k < n; ++k) {
    const float v = in[k] * scale;
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    // Round to nearest even on the 16 dropped bits; a NaN keeps c10's canonical quiet NaN
    // (adding the bias could carry a NaN's payload into an infinity).
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    out[k] = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
}

#if TORCHSTRATEGY_HAS_FLOAT16
TORCHSTRATEGY_CLONES
void fp16_loop(const float* in, _Float16* out, int64_t n, float scale) {
  // IEEE round to nearest even: F16C's vcvtps2ph on x86-64-v3/v4, libgcc's routine on the
  // baseline; the same bits as c10::Half(float) for every non-NaN value.
  for (int64_t k = 0; k < n; ++k) out[k] = static_cast<_Float16>(in[k] * scale);
}
#endif

}  // namespace

void narrow_to_bf16(const float* in, c10::BFloat16* out, int64_t n, float scale) {
  static_assert(sizeof(c10::BFloat16) == sizeof(uint16_t));
  bf16_loop(in, reinterpret_cast<uint16_t*>(out), n, scale);
}

void narrow_to_fp16(const float* in, c10::Half* out, int64_t n, float scale) {
#if TORCHSTRATEGY_HAS_FLOAT16
  static_assert(sizeof(c10::Half) == sizeof(_Float16));
  fp16_loop(in, reinterpret_cast<_Float16*>(out), n, scale);
#else
  for (int64_t k = 0; k < n; ++k) out[k] = c10::Half(in[k] * scale);
#endif
}

}  // namespace torchstrategy
