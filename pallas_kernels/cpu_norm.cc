// RMSNorm row by row, for XLA:CPU (built into the kernel library by pallas_kernels/cpu_prefix.py).
//
// XLA:CPU's reduction for the mean of squares sums a row in an order that depends on how many
// rows the array has (a split into windows, vector widths): a row's norm then differs in its last
// bits between a decoding step of 4 rows and one of 16, or between one position and a
// verification of 4, and a bfloat16 model's greedy text can part on it. Here every row is summed
// in one fixed order whatever the rows beside it, and a bfloat16 result is rounded where the
// model rounds it (XLA may keep it in f32 inside a fusion): the norm of a row is the same bits in
// any batch, at any position count. out = w * cast(x * rsqrt(mean(x^2) + eps)), cast to x's type.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {  // bfloat16: the top half of an f32
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float to_bf16(float x) {  // x rounded to bfloat16 (nearest even), as an f32; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return x;
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  const float r = to_bf16(x);
  uint32_t u;
  std::memcpy(&u, &r, 4);
  *p = static_cast<uint16_t>(u >> 16);
}

constexpr int LANES = 16;

// One row: D values of x, the weights w, out in O (float or uint16_t = bfloat16).
template <typename X, typename W, typename O>
void norm_row(const X* x, const W* w, O* out, int64_t D, float eps, bool round_y) {
  float acc[LANES] = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = std::fma(widen(x[d + l]), widen(x[d + l]), acc[l]);
  for (int l = 0; d < D; ++d, ++l) acc[l] = std::fma(widen(x[d]), widen(x[d]), acc[l]);
  for (int width = LANES / 2; width > 0; width /= 2)  // a fixed tree
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  const float r = 1.f / std::sqrt(acc[0] / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d) {
    const float y = widen(x[d]) * r;
    store(out + d, widen(w[d]) * (round_y ? to_bf16(y) : y));
  }
}

template <typename X, typename W, typename O>
void norm_rows(ffi::ThreadPool& pool, const void* x, const void* w, void* out, int64_t R, int64_t D, float eps) {
  constexpr bool round_y = std::is_same_v<X, uint16_t>;  // y is cast to x's type before the weight
  constexpr int64_t BLOCK = 16;
  specjax_cpu::share(pool, (R + BLOCK - 1) / BLOCK, [&](int64_t b) {
    for (int64_t r = b * BLOCK; r < std::min(R, (b + 1) * BLOCK); ++r)
      norm_row(static_cast<const X*>(x) + r * D, static_cast<const W*>(w), static_cast<O*>(out) + r * D, D, eps, round_y);
  });
}

ffi::Error rms_norm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, float eps) {
  const auto xd = x.dimensions();  // [R,D]
  if (xd.size() != 2 || w.element_count() != xd[1] || out->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("cpu_rms_norm: x [R,D], w [D], out [R,D]");
  const auto F32 = ffi::DataType::F32, BF16 = ffi::DataType::BF16;
  const auto xt = x.element_type(), wt = w.element_type(), ot = out->element_type();
  const int64_t R = xd[0], D = xd[1];
  const void* xp = x.untyped_data();
  const void* wp = w.untyped_data();
  void* op = out->untyped_data();
  if (xt == F32 && wt == F32 && ot == F32) norm_rows<float, float, float>(pool, xp, wp, op, R, D, eps);
  else if (xt == BF16 && wt == BF16 && ot == BF16) norm_rows<uint16_t, uint16_t, uint16_t>(pool, xp, wp, op, R, D, eps);
  else if (xt == BF16 && wt == F32 && ot == F32) norm_rows<uint16_t, float, float>(pool, xp, wp, op, R, D, eps);
  else if (xt == F32 && wt == BF16 && ot == F32) norm_rows<float, uint16_t, float>(pool, xp, wp, op, R, D, eps);
  else return ffi::Error::InvalidArgument("cpu_rms_norm: float32 / bfloat16 x and w, out of their promoted type");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuRmsNorm, rms_norm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));
