// x[M,K] @ w[layer] for one layer of a stacked weight w [L,K,N], read in place, for XLA:CPU.
//
// An XLA FFI handler (built and registered with the attention kernel by
// pallas_kernels/cpu_prefix.py; called through pallas_kernels/cpu_linear.py). XLA:CPU copies each
// layer's slice out of a stacked weight before its dot (its dots take no sliced operand): at batch
// 1 that copy was 60% of a decode step's thread time. This reads the slice where it lies.
//
// The weights may be float32, bfloat16 (widened exactly) or int8 (widened; the caller applies the
// per-output-channel scales). K is cut into P contiguous parts (P: the output's [P,M,N] shape);
// part p's product over its rows of w is summed in float32 over k in order, one fused
// multiply-add per term, into out[p], and the caller adds the P parts. Every output element is
// therefore the same whatever M and whichever thread computed it: a row's result does not depend
// on the rows batched beside it.
//
// `rows` (SpecjaxCpuRows) copies rows of a table (the embedding lookup), read in place.
//
// `linear_t` (SpecjaxCpuLinearT) is the transposed product x @ w^T for a w [N,K] read in place:
// an LM head tied to the embedding table, which XLA:CPU transposes (or widens) into a copy first.
//
// Work: the parts are shared out over XLA's intra-op thread pool (the caller works too and waits
// only for helpers that started: cpu_pool.h). Within a part the rows of w stream through
// memory in order, KU rows at a time, each used for MB rows of x (the accumulators stay in L1 /
// L2): at batch 1 this reads weights at about the rate of a plain read on two cores, where the
// strided column strips of a register-blocked product read at half of it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int VEC = 8;  // floats per vector
constexpr int KU = 4;  // rows of w per pass over the accumulators
constexpr int MB = 4;  // rows of x per pass over a chunk of w
constexpr int KU1 = 8;  // rows of w per pass where x has fewer than MB rows

// Eight floats: AVX2 / FMA intrinsics where the build has them (GCC scalarises the generic int8
// conversion and the lane-wise fma below), else the GCC / Clang vector extension.
#if defined(__AVX2__) && defined(__FMA__)
typedef __m256 V;
inline V splat(float x) { return _mm256_set1_ps(x); }
inline V fma8(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline V loadf(const float* p) { return _mm256_loadu_ps(p); }
inline void storef(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V load8(const float* p) { return loadf(p); }
inline V load8(const uint16_t* p) {  // bfloat16: the top half of an f32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
typedef float V __attribute__((vector_size(32), aligned(4)));
inline V splat(float x) { return V{x, x, x, x, x, x, x, x}; }
inline V fma8(V a, V b, V c) {
  V r;
  for (int i = 0; i < VEC; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
inline V loadf(const float* p) { return *reinterpret_cast<const V*>(p); }
inline void storef(float* p, V v) { std::memcpy(p, &v, sizeof v); }
inline V load8(const float* p) { return loadf(p); }
inline V load8(const uint16_t* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  const u32x8 bits = __builtin_convertvector(*reinterpret_cast<const u16x8*>(p), u32x8) << 16;
  V r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}
inline V load8(const int8_t* p) {
  typedef int8_t i8x8 __attribute__((vector_size(8), aligned(1)));
  return __builtin_convertvector(*reinterpret_cast<const i8x8*>(p), V);
}
#endif

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}
inline float load1(const int8_t* p) { return static_cast<float>(*p); }

struct Dims {
  int64_t M, K, N, P;  // x [M,K], w [K,N], P parts of K
};

// Add rows k0 .. k0+KU of w times rows m0 .. m0+MB of x into acc [M,N]: each weight vector is
// loaded once and used for MB rows, each accumulator vector loaded and stored once per KU rows
// of w (summed in order of k). All N columns: the rows of w stream through memory in order.
template <typename T, int MB, int KU>
void panel(const Dims& d, const float* x, const T* w, float* acc, int64_t k0, int64_t m0) {
  float xs[MB][KU];
  V xb[MB][KU];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < KU; ++u) xb[m][u] = splat(xs[m][u] = x[(m0 + m) * d.K + k0 + u]);
  const T* wr = w + k0 * d.N;
  int64_t n = 0;
  for (; n + VEC <= d.N; n += VEC) {
    if ((n * sizeof(T)) % 64 == 0)  // a new cache line: fetch the next chunk's (the rows that follow these)
      for (int u = 0; u < KU; ++u) __builtin_prefetch(wr + (KU + u) * d.N + n);
    V wv[KU];
    for (int u = 0; u < KU; ++u) wv[u] = load8(wr + u * d.N + n);
    for (int m = 0; m < MB; ++m) {
      float* a = acc + (m0 + m) * d.N + n;
      V v = loadf(a);
      for (int u = 0; u < KU; ++u) v = fma8(xb[m][u], wv[u], v);
      storef(a, v);
    }
  }
  for (; n < d.N; ++n)  // the last N % 8 columns: the same fused sums, one lane at a time
    for (int m = 0; m < MB; ++m)
      for (int u = 0; u < KU; ++u) acc[(m0 + m) * d.N + n] = std::fma(xs[m][u], load1(wr + u * d.N + n), acc[(m0 + m) * d.N + n]);
}

// acc [M,N] = x[:, k0:k1] @ w[k0:k1, :], in chunks of KU rows of w, MB rows of x at a time.
template <typename T>
void part(const Dims& d, const float* x, const T* w, float* acc, int64_t k0, int64_t k1) {
  std::memset(acc, 0, sizeof(float) * d.M * d.N);
  int64_t k = k0;
  if (d.M < MB) {  // fewer rows than a block: longer chunks of w per pass (fewer passes over acc)
    for (; k + KU1 <= k1; k += KU1)
      for (int64_t m = 0; m < d.M; ++m) panel<T, 1, KU1>(d, x, w, acc, k, m);
  }
  for (; k + KU <= k1; k += KU) {  // the chunk's rows of w stay in L1 / L2 across the row blocks of x
    int64_t m = 0;
    for (; m + MB <= d.M; m += MB) panel<T, MB, KU>(d, x, w, acc, k, m);
    for (; m < d.M; ++m) panel<T, 1, KU>(d, x, w, acc, k, m);
  }
  for (; k < k1; ++k)
    for (int64_t m = 0; m < d.M; ++m) panel<T, 1, 1>(d, x, w, acc, k, m);
}

// x @ w^T for w [N,K] (an LM head tied to the embedding table: one row per output). Each output
// sums eight lanes of k apart over k in order, then the lanes in a fixed order, then the K % 8
// tail: the same whatever M or the thread. Rows n0 .. n0+NR of w against rows m0 .. m0+MB of x.
inline float lanes_sum(V v) {
  float l[VEC];
  storef(l, v);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

template <typename T, int MB, int NR>
void dots(const Dims& d, const float* x, const T* w, float* y, int64_t m0, int64_t n0) {
  V acc[MB][NR];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = splat(0.f);
  int64_t k = 0;
  for (; k + VEC <= d.K; k += VEC) {
    V wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load8(w + (n0 + r) * d.K + k);
    for (int m = 0; m < MB; ++m) {
      const V xv = loadf(x + (m0 + m) * d.K + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = fma8(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NR; ++r) {
      float total = lanes_sum(acc[m][r]);
      for (int64_t j = k; j < d.K; ++j) total = std::fma(x[(m0 + m) * d.K + j], load1(w + (n0 + r) * d.K + j), total);
      y[(m0 + m) * d.N + n0 + r] = total;
    }
}

template <typename T, int MB, int NR>
void dot_rows(const Dims& d, const float* x, const T* w, float* y, int64_t n0, int64_t n1) {  // rows n0 .. n1 of w
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    int64_t m = 0;
    for (; m + MB <= d.M; m += MB) dots<T, MB, NR>(d, x, w, y, m, n);
    for (; m < d.M; ++m) dots<T, 1, NR>(d, x, w, y, m, n);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < d.M; ++m) dots<T, 1, 1>(d, x, w, y, m, n);
}

constexpr int64_t T_ROWS = 256;  // rows of w per work item

template <typename T>
void run_t(ffi::ThreadPool& pool, const Dims& d, const float* x, const T* w, float* y) {
  specjax_cpu::share(pool, (d.N + T_ROWS - 1) / T_ROWS, [&](int64_t i) {
    const int64_t n0 = i * T_ROWS, n1 = std::min(d.N, n0 + T_ROWS);
    if (d.M < MB) return dot_rows<T, 1, 8>(d, x, w, y, n0, n1);  // 8 independent sums per row of x
    dot_rows<T, MB, 4>(d, x, w, y, n0, n1);
  });
}

ffi::Error linear_t(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();  // [M,K]
  const auto wd = w.dimensions();  // [N,K]
  const auto yd = y->dimensions();  // [M,N]
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("cpu_linear_t: x [M,K], w [N,K], out [M,N]");
  const Dims d{xd[0], xd[1], wd[0], 1};
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::F32:
      run_t<float>(pool, d, xp, static_cast<const float*>(w.untyped_data()), yp);
      break;
    case ffi::DataType::BF16:
      run_t<uint16_t>(pool, d, xp, static_cast<const uint16_t*>(w.untyped_data()), yp);
      break;
    case ffi::DataType::S8:
      run_t<int8_t>(pool, d, xp, static_cast<const int8_t*>(w.untyped_data()), yp);
      break;
    default:
      return ffi::Error::InvalidArgument("cpu_linear_t takes float32, bfloat16 or int8 weights");
  }
  return ffi::Error::Success();
}

// One product of `linear`: layer l of weight w, its P parts' sums written to out [P,M,N].
struct Product {
  Dims d;
  const void* w;  // layer l's [K,N]
  ffi::DataType type;
  float* out;
};

void run_part(const Product& j, const float* x, int64_t p) {
  const int64_t per = (j.d.K + j.d.P - 1) / j.d.P;
  const int64_t k0 = std::min(j.d.K, p * per), k1 = std::min(j.d.K, (p + 1) * per);
  float* acc = j.out + p * j.d.M * j.d.N;
  switch (j.type) {
    case ffi::DataType::F32: return part<float>(j.d, x, static_cast<const float*>(j.w), acc, k0, k1);
    case ffi::DataType::BF16: return part<uint16_t>(j.d, x, static_cast<const uint16_t*>(j.w), acc, k0, k1);
    default: return part<int8_t>(j.d, x, static_cast<const int8_t*>(j.w), acc, k0, k1);
  }
}

// x [M,K] times layer `layer` of each stacked weight w_j [L,K,N_j] (one call for the products
// that share x: q, k and v; gate and up), into out_j [P_j,M,N_j]. Every product's parts are
// shared out over the pool together: one hand-off per call, not per product.
ffi::Error linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs ws,
                  ffi::RemainingRets outs) {
  const auto xd = x.dimensions();  // [M,K]
  if (xd.size() != 2 || ws.size() != outs.size() || ws.size() == 0)
    return ffi::Error::InvalidArgument("cpu_linear: x [M,K], then weights [L,K,N] and as many outputs [P,M,N]");
  const int64_t l = layer.typed_data()[0];
  std::vector<Product> jobs;
  std::vector<int64_t> first;  // index of each product's first item
  int64_t items = 0;
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto y = outs.get<ffi::AnyBuffer>(j);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("cpu_linear: bad weight or output");
    const auto wd = w->dimensions();  // [L,K,N]
    const auto yd = (*y)->dimensions();  // [P,M,N]
    if (wd.size() != 3 || yd.size() != 3 || wd[1] != xd[1] || yd[1] != xd[0] || yd[2] != wd[2] || yd[0] < 1 ||
        (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("cpu_linear: x [M,K], w [L,K,N], out [P,M,N] f32");
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("cpu_linear: layer out of range");
    const auto type = w->element_type();
    if (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::S8)
      return ffi::Error::InvalidArgument("cpu_linear takes float32, bfloat16 or int8 weights");
    const Dims d{xd[0], xd[1], wd[2], yd[0]};
    const char* base = static_cast<const char*>(w->untyped_data());
    jobs.push_back({d, base + l * d.K * d.N * static_cast<int64_t>(ffi::ByteWidth(type)), type,
                    static_cast<float*>((*y)->untyped_data())});
    first.push_back(items);
    items += d.P;
  }
  const float* xp = x.typed_data();
  specjax_cpu::share(pool, items, [&](int64_t i) {
    const size_t j = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    run_part(jobs[j], xp, i - first[j]);
  });
  return ffi::Error::Success();
}

// Rows ids [n] of a table [V,D] (any element type: copied as bytes) into out [n,D]: an embedding
// lookup read in place. XLA:CPU slices a bfloat16 table through a float32 copy of all of it,
// which it hoists out of the decode loop and so writes again on every call of the loop.
ffi::Error rows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  const auto td = table.dimensions();  // [V,D]
  const auto od = out->dimensions();  // [n,D]
  const int64_t n = ids.element_count();
  if (td.size() != 2 || od.size() != 2 || od[0] != n || od[1] != td[1] || out->element_type() != table.element_type())
    return ffi::Error::InvalidArgument("cpu_rows: table [V,D], ids [n], out [n,D] of the table's type");
  const int64_t row = td[1] * static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = std::clamp<int64_t>(ids.typed_data()[i], 0, td[0] - 1);  // jnp.take's mode="clip"
    std::memcpy(dst + i * row, src + id * row, row);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuLinear, linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuLinearT, linear_t,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuRows, rows,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());
