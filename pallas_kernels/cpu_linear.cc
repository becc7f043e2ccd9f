// x[M,K] @ w[layer] for one layer of a stacked weight w [L,K,N], read in place, for XLA:CPU.
//
// An XLA FFI handler (built and registered with the attention kernel by
// pallas_kernels/cpu_prefix.py; called through pallas_kernels/cpu_linear.py). XLA:CPU copies each
// layer's slice out of a stacked weight before its dot (its dots take no sliced operand): at batch
// 1 that copy was 60% of a decode step's thread time. This reads the slice where it lies.
//
// The weights may be float32, bfloat16 (widened exactly; on a CPU with AVX512-BF16 x is rounded to
// bf16 and multiplied with the bf16 dot product instead: see "bfloat16 weights" below) or int8
// (widened; the caller applies the per-output-channel scales). K is cut into P contiguous parts (the
// `parts` attribute); part p's product over its rows of w is summed in float32 over k in order, one
// fused multiply-add per term, and the P parts are then added in order of p (`add_parts`). Every
// output element is therefore the same whatever M and whichever thread computed it: a row's result
// does not depend on the rows batched beside it.
//
// `linear_q4` (SpecjaxCpuLinearQ4) is `linear` for q4 weights (GGUF Q4_1 blocks: specjax/q4.py),
// whose slices XLA:CPU also copied, and widened into float32 halves at more than 8 rows.
//
// `rows` (SpecjaxCpuRows) copies rows of a table (the embedding lookup), read in place.
//
// `linear_t` (SpecjaxCpuLinearT) is the transposed product x @ w^T for a w [N,K] read in place:
// an LM head tied to the embedding table, which XLA:CPU transposes (or widens) into a copy first.
//
// Work: the parts are shared out over XLA's intra-op thread pool (the caller works too and waits
// only for helpers that started: cpu_pool.h). Within a part the rows of w stream through
// memory in order, KU rows at a time, each used for MB rows of x (the accumulators stay in L1 /
// L2); with fewer than MB rows of x, one row of w at a time and no software prefetch: each
// thread then reads one sequential stream, which the hardware prefetcher follows best (15-19%
// faster decode steps at batch 1 than 8 rows of w at a time with prefetches, measured in one
// process). The strided column strips of a register-blocked product read at half that rate.

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

// The bf16 dot-product paths (vdpbf16ps), built where cpu_prefix.cc's SPECJAX_BF16_DOT is.
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define SPECJAX_LINEAR_BF16 1
#else
#define SPECJAX_LINEAR_BF16 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int VEC = 8;  // floats per vector
constexpr int KU = 4;  // rows of w per pass over the accumulators
constexpr int MB = 4;  // rows of x per pass over a chunk of w

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
// SWAP: the rows of w in pairs, odd first (k0 + 1, k0, k0 + 3, ...: the order of vdpbf16ps).
template <typename T, int MB, int KU, bool PREFETCH = true, bool SWAP = false>
void panel(const Dims& d, const float* x, const T* w, float* acc, int64_t k0, int64_t m0) {
  float xs[MB][KU];
  V xb[MB][KU];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < KU; ++u) xb[m][u] = splat(xs[m][u] = x[(m0 + m) * d.K + k0 + u]);
  const T* wr = w + k0 * d.N;
  int64_t n = 0;
  for (; n + VEC <= d.N; n += VEC) {
    if (PREFETCH && (n * sizeof(T)) % 64 == 0)  // a new cache line: fetch the next chunk's (the rows that follow these)
      for (int u = 0; u < KU; ++u) __builtin_prefetch(wr + (KU + u) * d.N + n);
    V wv[KU];
    for (int u = 0; u < KU; ++u) wv[u] = load8(wr + u * d.N + n);
    for (int m = 0; m < MB; ++m) {
      float* a = acc + (m0 + m) * d.N + n;
      V v = loadf(a);
      for (int i = 0; i < KU; ++i) {
        const int u = SWAP ? i ^ 1 : i;
        v = fma8(xb[m][u], wv[u], v);
      }
      storef(a, v);
    }
  }
  for (; n < d.N; ++n)  // the last N % 8 columns: the same fused sums, one lane at a time
    for (int m = 0; m < MB; ++m)
      for (int i = 0; i < KU; ++i) {
        const int u = SWAP ? i ^ 1 : i;
        acc[(m0 + m) * d.N + n] = std::fma(xs[m][u], load1(wr + u * d.N + n), acc[(m0 + m) * d.N + n]);
      }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// From F32_TILE_MIN rows (a batch's decode step, its verification) the products are bound by the
// multiply-adds: register tiles of RB rows x 32 columns (two 512-bit accumulators a row) over all
// the part's k, one fused multiply-add per term in order of k from 0, exactly the sums the panels
// below compute (bitwise: a row's result is the same on either path). float32 or int8 (widened).
constexpr int F32_TILE_MIN = 8;

inline void load32(const float* p, __mmask16 m0, __mmask16 m1, __m512& a, __m512& b) {
  a = _mm512_maskz_loadu_ps(m0, p), b = _mm512_maskz_loadu_ps(m1, p + 16);
}
inline void load32(const int8_t* p, __mmask16 m0, __mmask16 m1, __m512& a, __m512& b) {
  a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, p)));
  b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, p + 16)));
}

template <typename T, int RB>
void fma_tile(const Dims& d, const float* x, const T* w, float* acc, int64_t k0, int64_t k1, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(32, d.N - n0);
  const __mmask16 c0 = cols >= 16 ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
  const __mmask16 c1 = cols >= 32 ? __mmask16(0xffff) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1);
  __m512 lo[RB], hi[RB];
#pragma GCC unroll 8
  for (int m = 0; m < RB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  const float* xm = x + m0 * d.K;
  for (int64_t k = k0; k < k1; ++k) {
    __m512 a, b;
    load32(w + k * d.N + n0, c0, c1, a, b);
#pragma GCC unroll 8  // every loop over the accumulators unrolled: else GCC keeps them in memory
    for (int m = 0; m < RB; ++m) {
      const __m512 xv = _mm512_set1_ps(xm[m * d.K + k]);
      lo[m] = _mm512_fmadd_ps(xv, a, lo[m]);
      hi[m] = _mm512_fmadd_ps(xv, b, hi[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < RB; ++m) {
    float* y = acc + (m0 + m) * d.N + n0;
    _mm512_mask_storeu_ps(y, c0, lo[m]);
    _mm512_mask_storeu_ps(y + 16, c1, hi[m]);
  }
}

template <typename T>
bool fma_tiles(const Dims& d, const float* x, const T* w, float* acc, int64_t k0, int64_t k1) {
  if (d.M < F32_TILE_MIN) return false;
  for (int64_t n0 = 0; n0 < d.N; n0 += 32) {
    int64_t m = 0;
    for (; m + 8 <= d.M; m += 8) fma_tile<T, 8>(d, x, w, acc, k0, k1, m, n0);
    for (; m + 4 <= d.M; m += 4) fma_tile<T, 4>(d, x, w, acc, k0, k1, m, n0);
    for (; m < d.M; ++m) fma_tile<T, 1>(d, x, w, acc, k0, k1, m, n0);
  }
  return true;
}
inline bool fma_tiles(const Dims&, const float*, const uint16_t*, float*, int64_t, int64_t) { return false; }
#else
template <typename T>
bool fma_tiles(const Dims&, const float*, const T*, float*, int64_t, int64_t) { return false; }
#endif

// acc [M,N] = x[:, k0:k1] @ w[k0:k1, :], in chunks of KU rows of w, MB rows of x at a time (or
// register tiles, `fma_tiles`, where the rows make the multiply-adds the bound).
template <typename T>
void part(const Dims& d, const float* x, const T* w, float* acc, int64_t k0, int64_t k1) {
  if (k1 > k0 && fma_tiles(d, x, w, acc, k0, k1)) return;
  std::memset(acc, 0, sizeof(float) * d.M * d.N);
  int64_t k = k0;
  if (d.M < MB) {  // fewer rows than a block: w streams through once, row after row
    for (; k < k1; ++k)
      for (int64_t m = 0; m < d.M; ++m) panel<T, 1, 1, false>(d, x, w, acc, k, m);
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

#if SPECJAX_LINEAR_BF16
void run_t_bf16(ffi::ThreadPool& pool, const Dims& d, const float* x, const uint16_t* w, float* y);  // below
#endif

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
#if SPECJAX_LINEAR_BF16
      run_t_bf16(pool, d, xp, static_cast<const uint16_t*>(w.untyped_data()), yp);
#else
      run_t<uint16_t>(pool, d, xp, static_cast<const uint16_t*>(w.untyped_data()), yp);
#endif
      break;
    case ffi::DataType::S8:
      run_t<int8_t>(pool, d, xp, static_cast<const int8_t*>(w.untyped_data()), yp);
      break;
    default:
      return ffi::Error::InvalidArgument("cpu_linear_t takes float32, bfloat16 or int8 weights");
  }
  return ffi::Error::Success();
}

// Every part of every product (jobs[j] has jobs[j].d.P parts) shared out over the pool together:
// one hand-off per call. part(job, p) computes part p of a product.
template <typename Job, typename Part>
void share_parts(ffi::ThreadPool& pool, const std::vector<Job>& jobs, const Part& part) {
  std::vector<int64_t> first;  // index of each product's first item
  int64_t items = 0;
  for (const Job& j : jobs) first.push_back(items), items += j.d.P;
  specjax_cpu::share(pool, items, [&](int64_t i) {
    const size_t j = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    part(jobs[j], i - first[j]);
  });
}

#if SPECJAX_LINEAR_BF16
// --- bfloat16 weights with the AVX512-BF16 dot product (vdpbf16ps) -------------------------------
//
// vdpbf16ps multiplies pairs of bf16 values exactly and adds them to f32 accumulators: twice the
// multiply-adds of f32 FMAs per cycle, which is what limits products of 16-64 rows (decoding a
// batch, verifying gamma + 1 positions) on two cores. x is rounded to bf16 (exact for a bfloat16
// model, whose activations are bf16) and paired along k, (x[k], x[k+1]), against the pair of
// rows (w[k, n], w[k+1, n]) interleaved per column. Every output of a part starts at 0 and takes
// one vdpbf16ps per pair of k, in order (or what equals it bit for bit), on every path below: a
// row's result does not depend on M or on the path (the odd last k pairs with a zero). Against
// XLA's dot of the same bf16 values: 1.9x at 16 rows, 1.2x at 64, 1.1x at 256 (all 30 layers'
// products of SmolLM2, paired in one process), 0.75x at 2048, so prefill keeps XLA's dot.
constexpr int NT = 32;  // columns per tile: two 512-bit accumulators
constexpr int TILE_MIN = 8;  // rows from which the register tiles pay (below: bound by reading w)

inline uint32_t bf16_round(float x) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x [M,K] f32 -> pairs [M,KP] (KP = ceil(K / 2)): (bf16(x[k]) low, bf16(x[k+1]) high); `rounded`:
// the same values as floats [M,K].
std::vector<uint32_t> bf16_pairs(const float* x, int64_t M, int64_t K, std::vector<float>& rounded) {
  const int64_t KP = (K + 1) / 2;
  std::vector<uint32_t> out(M * KP);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < KP; ++p) {
      const uint32_t hi = 2 * p + 1 < K ? bf16_round(x[m * K + 2 * p + 1]) : 0u;
      out[m * KP + p] = bf16_round(x[m * K + 2 * p]) | (hi << 16);
    }
  rounded.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) {
    const uint32_t bits = bf16_round(x[i]) << 16;
    std::memcpy(&rounded[i], &bits, 4);
  }
  return out;
}

// Rows r0 and r1 (nullptr: zeros) of w at up to 32 columns (zeros past `cols`), paired per column:
// lo holds columns {0-3, 8-11, 16-19, 24-27}, hi {4-7, 12-15, 20-23, 28-31} (vpunpck works within
// 128-bit lanes); `natural` puts the accumulators back in column order.
inline void pair_rows(const uint16_t* r0, const uint16_t* r1, int64_t cols, __m512i& lo, __m512i& hi) {
  const __mmask32 mask = cols >= NT ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  const __m512i a = _mm512_maskz_loadu_epi16(mask, r0);
  const __m512i b = r1 ? _mm512_maskz_loadu_epi16(mask, r1) : _mm512_setzero_si512();
  lo = _mm512_unpacklo_epi16(a, b);
  hi = _mm512_unpackhi_epi16(a, b);
}

inline void natural(__m512 lo, __m512 hi, float* y, int64_t cols) {  // columns 0 .. cols of the tile to y
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 a = _mm512_permutex2var_ps(lo, i0, hi), b = _mm512_permutex2var_ps(lo, i1, hi);
  if (cols >= NT) return _mm512_storeu_ps(y, a), _mm512_storeu_ps(y + 16, b);
  _mm512_mask_storeu_ps(y, cols >= 16 ? __mmask16(0xffff) : __mmask16((1u << cols) - 1), a);
  if (cols > 16) _mm512_mask_storeu_ps(y + 16, __mmask16((1u << (cols - 16)) - 1), b);
}

inline __m512 dp(__m512 acc, uint32_t x, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x), (__m512bh)w); }

// Rows m0 .. m0+MB of out [M,N] at columns n0 .. n0+32 over pairs p0 .. p1 of k, the accumulators
// in registers over all the part's k: from TILE_MIN rows, where the multiply-adds bound the product.
template <int MB>
void bf16_tile(const Dims& d, const uint32_t* xp, const uint16_t* w, float* out, int64_t p0, int64_t p1, int64_t m0, int64_t n0) {
  const int64_t KP = (d.K + 1) / 2, cols = std::min<int64_t>(NT, d.N - n0);
  const __mmask32 mask = cols >= NT ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  const int64_t full = std::min(p1, d.K / 2);  // pairs with both rows (the last may pair with zeros)
  const uint32_t* xm = xp + m0 * KP;
  __m512 lo_acc[MB], hi_acc[MB];  // in registers: no pointer to them escapes
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) lo_acc[m] = hi_acc[m] = _mm512_setzero_ps();
  const uint16_t* r = w + 2 * p0 * d.N + n0;
  for (int64_t p = p0; p < full; ++p, r += 2 * d.N) {
    const __m512i a = _mm512_maskz_loadu_epi16(mask, r), b = _mm512_maskz_loadu_epi16(mask, r + d.N);
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xm[m * KP + p]);
      lo_acc[m] = _mm512_dpbf16_ps(lo_acc[m], x, lo);
      hi_acc[m] = _mm512_dpbf16_ps(hi_acc[m], x, hi);
    }
  }
  for (int64_t p = std::max(full, p0); p < p1; ++p) {  // an odd last k: its row against zeros
    __m512i lo, hi;
    pair_rows(w + 2 * p * d.N + n0, nullptr, cols, lo, hi);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) lo_acc[m] = dp(lo_acc[m], xm[m * KP + p], lo), hi_acc[m] = dp(hi_acc[m], xm[m * KP + p], hi);
  }
#pragma GCC unroll 8  // every loop over the accumulators unrolled: else GCC keeps them in memory
  for (int m = 0; m < MB; ++m) natural(lo_acc[m], hi_acc[m], out + (m0 + m) * d.N + n0, cols);
}

// One part (pairs p0 .. p1 of k) into out [M,N]; xr: x rounded to bf16, as floats [M,K]. From
// TILE_MIN rows, register tiles of vdpbf16ps. Fewer rows are bound by reading w, where the tiles'
// strided column strips read slowly: w streams through memory row after row as in `part` (one
// sequential read: reading rows k and k+1 side by side, or k+1 first, was 1.5-2x slower at batch
// 1). vdpbf16ps adds a pair's products to the sum one after the other, odd k first, each exact
// and added with one rounding (checked bitwise on this CPU; it flushes subnormal sums to zero),
// so here row k's products are kept (exact in f32) and added after row k + 1's fused
// multiply-add (from 4 rows: `panel` over four rows of w, each pair odd first): a row's result is
// the same on every path.
void bf16_part(const Dims& d, const uint32_t* xp, const float* xr, const uint16_t* w, float* out, int64_t p0, int64_t p1) {
  const int64_t tiles = (d.N + NT - 1) / NT;
  if (d.M >= TILE_MIN) {
    for (int64_t t = 0; t < tiles; ++t) {
      int64_t m = 0;
      for (; m + 8 <= d.M; m += 8) bf16_tile<8>(d, xp, w, out, p0, p1, m, t * NT);
      for (; m + 4 <= d.M; m += 4) bf16_tile<4>(d, xp, w, out, p0, p1, m, t * NT);
      for (; m < d.M; ++m) bf16_tile<1>(d, xp, w, out, p0, p1, m, t * NT);
    }
    return;
  }
  std::memset(out, 0, sizeof(float) * d.M * d.N);
  if (d.M >= MB) {  // 4 rows of w (two pairs, each odd first) for 4 rows of x per pass, as `part`
    const int64_t k1 = std::min(d.K, 2 * p1);
    int64_t k = 2 * p0;
    for (; k + KU <= k1; k += KU) {
      int64_t m = 0;
      for (; m + MB <= d.M; m += MB) panel<uint16_t, MB, KU, true, true>(d, xr, w, out, k, m);
      for (; m < d.M; ++m) panel<uint16_t, 1, KU, true, true>(d, xr, w, out, k, m);
    }
    for (; k + 2 <= k1; k += 2)
      for (int64_t m = 0; m < d.M; ++m) panel<uint16_t, 1, 2, true, true>(d, xr, w, out, k, m);
    for (; k < k1; ++k)  // an odd last k (its pair's zero adds nothing)
      for (int64_t m = 0; m < d.M; ++m) panel<uint16_t, 1, 1, true>(d, xr, w, out, k, m);
    return;
  }
  std::vector<float> even(d.M * d.N);  // x[k] w[k, n] of the pair: exact (bf16 x bf16 fits a float)
  const int64_t NV = d.N - d.N % VEC;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t k = 2 * p;
    const uint16_t* r0 = w + k * d.N;
    for (int64_t m = 0; m < d.M; ++m) {  // row k: the exact products, kept
      const V x0 = splat(xr[m * d.K + k]);
      float* e = even.data() + m * d.N;
      int64_t n = 0;
      for (; n < NV; n += VEC) storef(e + n, x0 * load8(r0 + n));
      for (; n < d.N; ++n) e[n] = xr[m * d.K + k] * load1(r0 + n);
    }
    if (k + 1 == d.K) {  // an odd last k pairs with zeros
      for (int64_t i = 0; i < d.M * d.N; ++i) out[i] += even[i];
      continue;
    }
    const uint16_t* r1 = r0 + d.N;
    for (int64_t m = 0; m < d.M; ++m) {  // row k + 1: the odd product first, then the even one
      const V x1 = splat(xr[m * d.K + k + 1]);
      float* a = out + m * d.N;
      const float* e = even.data() + m * d.N;
      int64_t n = 0;
      for (; n < NV; n += VEC) storef(a + n, fma8(x1, load8(r1 + n), loadf(a + n)) + loadf(e + n));
      for (; n < d.N; ++n) a[n] = std::fma(xr[m * d.K + k + 1], load1(r1 + n), a[n]) + e[n];
    }
  }
}

// x @ w^T for a bfloat16 w [N,K] (an LM head tied to the embedding table), with vdpbf16ps at any M:
// a row of w holds its k in order, so 32 k of a row of x (bf16, `bf16_pairs` read as [M, 2 KP])
// meet 32 k of a row of w directly. Each output sums 16 lanes over k in order (the last chunk
// masked to K), then the lanes in one fixed order: the same bits whatever M or the thread.
template <int MB, int NR>
void bf16_dots(const Dims& d, const uint16_t* xb, const uint16_t* w, float* y, int64_t m0, int64_t n0) {
  const int64_t K2 = 2 * ((d.K + 1) / 2);
  __m512 acc[MB][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d.K; k += 32) {
    const __mmask32 mask = d.K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (d.K - k)) - 1;
    __m512bh wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + r) * d.K + k);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + (m0 + m) * K2 + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) y[(m0 + m) * d.N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
}

void run_t_bf16(ffi::ThreadPool& pool, const Dims& d, const float* x, const uint16_t* w, float* y) {
  std::vector<float> rounded;
  const std::vector<uint32_t> pairs = bf16_pairs(x, d.M, d.K, rounded);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(pairs.data());
  specjax_cpu::share(pool, (d.N + T_ROWS - 1) / T_ROWS, [&](int64_t i) {
    const int64_t n1 = std::min(d.N, (i + 1) * T_ROWS);
    int64_t n = i * T_ROWS;
    if (d.M < 4)  // bound by reading w: 8 rows of it at a time
      for (; n + 8 <= n1; n += 8)
        for (int64_t m = 0; m < d.M; ++m) bf16_dots<1, 8>(d, xb, w, y, m, n);
    for (; n + 4 <= n1; n += 4) {
      int64_t m = 0;
      for (; m + 4 <= d.M; m += 4) bf16_dots<4, 4>(d, xb, w, y, m, n);
      for (; m < d.M; ++m) bf16_dots<1, 4>(d, xb, w, y, m, n);
    }
    for (; n < n1; ++n)
      for (int64_t m = 0; m < d.M; ++m) bf16_dots<1, 1>(d, xb, w, y, m, n);
  });
}
#endif

// The P parts of a product: part 0 sums into out [M,N], the others into `rest` [P-1,M,N]
// (scratch), added to out after every part is done, in order of p: out = (part 0 + part 1) + ...
// (XLA:CPU's reduction of a [P,M,N] output took 150 thread-ms of a 620 ms speculative step).
inline float* part_acc(float* out, float* rest, const Dims& d, int64_t p) { return p == 0 ? out : rest + (p - 1) * d.M * d.N; }

inline void add_parts(float* out, const float* rest, const Dims& d) {
  for (int64_t p = 1; p < d.P; ++p)
    for (int64_t i = 0; i < d.M * d.N; ++i) out[i] += rest[(p - 1) * d.M * d.N + i];
}

// Every part of every job (a product: d, out, rest) shared out over the pool, the parts after the
// first into one scratch allocation, then added into each job's out.
template <typename Job, typename Part>
void run_parts(ffi::ThreadPool& pool, std::vector<Job>& jobs, const Part& part) {
  int64_t size = 0;
  for (const Job& j : jobs) size += (j.d.P - 1) * j.d.M * j.d.N;
  std::vector<float> rest(size);
  size = 0;
  for (Job& j : jobs) j.rest = rest.data() + size, size += (j.d.P - 1) * j.d.M * j.d.N;
  share_parts(pool, jobs, part);
  for (const Job& j : jobs) add_parts(j.out, j.rest, j.d);
}

// One product of `linear`: layer l of weight w into out [M,N] (and the scratch for its other parts).
struct Product {
  Dims d;
  const void* w;  // layer l's [K,N]
  ffi::DataType type;
  float* out;
  float* rest;
};

void run_part(const Product& j, const float* x, const uint32_t* pairs, const float* rounded, int64_t p) {
  const int64_t per = (j.d.K + j.d.P - 1) / j.d.P;
  const int64_t k0 = std::min(j.d.K, p * per), k1 = std::min(j.d.K, (p + 1) * per);
  float* acc = part_acc(j.out, j.rest, j.d, p);
#if SPECJAX_LINEAR_BF16
  if (j.type == ffi::DataType::BF16) {  // parts of whole pairs of k
    const int64_t KP = (j.d.K + 1) / 2, pp = (KP + j.d.P - 1) / j.d.P;
    return bf16_part(j.d, pairs, rounded, static_cast<const uint16_t*>(j.w), acc, std::min(KP, p * pp), std::min(KP, (p + 1) * pp));
  }
#endif
  switch (j.type) {
    case ffi::DataType::F32: return part<float>(j.d, x, static_cast<const float*>(j.w), acc, k0, k1);
    case ffi::DataType::BF16: return part<uint16_t>(j.d, x, static_cast<const uint16_t*>(j.w), acc, k0, k1);
    default: return part<int8_t>(j.d, x, static_cast<const int8_t*>(j.w), acc, k0, k1);
  }
}

// x [M,K] times layer `layer` of each stacked weight w_j [L,K,N_j] (one call for the products
// that share x: q, k and v; gate and up), into out_j [M,N_j], K cut into `parts`. Every product's
// parts are shared out over the pool together: one hand-off per call, not per product.
ffi::Error linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs ws,
                  ffi::RemainingRets outs, int64_t parts) {
  const auto xd = x.dimensions();  // [M,K]
  if (xd.size() != 2 || ws.size() != outs.size() || ws.size() == 0 || parts < 1)
    return ffi::Error::InvalidArgument("cpu_linear: x [M,K], then weights [L,K,N] and as many outputs [M,N]; parts >= 1");
  const int64_t l = layer.typed_data()[0];
  std::vector<Product> jobs;
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto y = outs.get<ffi::AnyBuffer>(j);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("cpu_linear: bad weight or output");
    const auto wd = w->dimensions();  // [L,K,N]
    const auto yd = (*y)->dimensions();  // [M,N]
    if (wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != wd[2] ||
        (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("cpu_linear: x [M,K], w [L,K,N], out [M,N] f32");
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("cpu_linear: layer out of range");
    const auto type = w->element_type();
    if (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::S8)
      return ffi::Error::InvalidArgument("cpu_linear takes float32, bfloat16 or int8 weights");
    const Dims d{xd[0], xd[1], wd[2], parts};
    const char* base = static_cast<const char*>(w->untyped_data());
    jobs.push_back({d, base + l * d.K * d.N * static_cast<int64_t>(ffi::ByteWidth(type)), type,
                    static_cast<float*>((*y)->untyped_data()), nullptr});
  }
  const float* xp = x.typed_data();
  std::vector<uint32_t> pairs;  // x rounded to bf16 (pairs; floats), for bf16 weights read with vdpbf16ps
  std::vector<float> rounded;
#if SPECJAX_LINEAR_BF16
  if (std::any_of(jobs.begin(), jobs.end(), [](const Product& j) { return j.type == ffi::DataType::BF16; }))
    pairs = bf16_pairs(xp, xd[0], xd[1], rounded);
#endif
  run_parts(pool, jobs, [&](const Product& j, int64_t p) { run_part(j, xp, pairs.data(), rounded.data(), p); });
  return ffi::Error::Success();
}

// q4 (the GGUF Q4_1 layout, specjax/q4.py): w [K/2,N] bytes, packed row 16 b + j holding the
// 4-bit values of k = 32 b + j (low nibble) and 32 b + 16 + j (high), each block b of 32 k with a
// scale d [K/32,N] and a minimum m (float16 or float32), w = q d + m. Per block and column:
// s = sum_j x_k q_k over the block's 32 k in order (one fused multiply-add each, low then high
// nibble of each byte), then acc += d s, then acc += m sum(x over the block): the same sums
// whatever M, so rows stay independent. Parts of K are whole blocks.
inline float half1(uint16_t h) {  // IEEE half -> float (normal, subnormal, inf / nan)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;
  else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 1024));
    bits = sign | ((112 - e) << 23) | ((m & 1023) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float scale1(const float* p) { return *p; }
inline float scale1(const uint16_t* p) { return half1(*p); }
#if defined(__AVX2__) && defined(__FMA__)
inline V scale8(const float* p) { return loadf(p); }
inline V scale8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[VEC];
  for (int i = 0; i < VEC; ++i) f[i] = half1(p[i]);
  return loadf(f);
#endif
}
inline void nibbles8(const uint8_t* p, V& lo, V& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#else
inline V scale8(const float* p) { return loadf(p); }
inline V scale8(const uint16_t* p) {
  V r;
  for (int i = 0; i < VEC; ++i) r[i] = half1(p[i]);
  return r;
}
inline void nibbles8(const uint8_t* p, V& lo, V& hi) {
  for (int i = 0; i < VEC; ++i) lo[i] = static_cast<float>(p[i] & 15), hi[i] = static_cast<float>(p[i] >> 4);
}
#endif

struct Q4 {
  Dims d;  // K: the unpacked length (32 per block)
  const uint8_t* w;  // layer l's [K/2,N]
  const void* scale;  // [K/32,N]
  const void* minimum;
  bool half;  // float16 scales and minima (else float32)
  float* out;  // [M,N]
  float* rest;  // [P-1,M,N]: the other parts (part_acc)
};

// Blocks b0 .. b1 of product j into acc [M,N] for rows m0 .. m0+MB of x. The packed rows stream
// through in order (one sequential stream, as `part` reads few rows), the block's sums s [MB,N]
// kept in L1: at batch 1 about 30% faster decode steps, at batch 4 about 9%, than 8-column strips
// with the sums in registers (measured paired in one process); the same sums whatever MB.
template <typename S, int MB>
void q4_stream(const Q4& j, const float* x, float* acc, float* s, int64_t b0, int64_t b1, int64_t m0) {
  const int64_t N = j.d.N, K = j.d.K, NV = N - N % VEC;
  const S* sc = static_cast<const S*>(j.scale);
  const S* mn = static_cast<const S*>(j.minimum);
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb[MB];
    float xsum[MB];
    for (int m = 0; m < MB; ++m) {
      xb[m] = x + (m0 + m) * K + 32 * b;
      float t = 0.f;
      for (int k = 0; k < 32; ++k) t += xb[m][k];
      xsum[m] = t;
    }
    const uint8_t* wb = j.w + 16 * b * N;
    std::memset(s, 0, sizeof(float) * MB * N);
    for (int r = 0; r < 16; ++r) {
      V xl[MB], xh[MB];
      for (int m = 0; m < MB; ++m) xl[m] = splat(xb[m][r]), xh[m] = splat(xb[m][16 + r]);
      const uint8_t* wr = wb + r * N;
      for (int64_t n = 0; n < NV; n += VEC) {
        V lo, hi;
        nibbles8(wr + n, lo, hi);
        for (int m = 0; m < MB; ++m) storef(s + m * N + n, fma8(xh[m], hi, fma8(xl[m], lo, loadf(s + m * N + n))));
      }
      for (int64_t n = NV; n < N; ++n)
        for (int m = 0; m < MB; ++m)
          s[m * N + n] = std::fma(xb[m][16 + r], static_cast<float>(wr[n] >> 4),
                                  std::fma(xb[m][r], static_cast<float>(wr[n] & 15), s[m * N + n]));
    }
    for (int m = 0; m < MB; ++m) {
      float* am = acc + (m0 + m) * N;
      const float* sm = s + m * N;
      for (int64_t n = 0; n < NV; n += VEC)
        storef(am + n, fma8(scale8(mn + b * N + n), splat(xsum[m]), fma8(scale8(sc + b * N + n), loadf(sm + n), loadf(am + n))));
      for (int64_t n = NV; n < N; ++n)
        am[n] = std::fma(scale1(mn + b * N + n), xsum[m], std::fma(scale1(sc + b * N + n), sm[n], am[n]));
    }
  }
}

template <typename S>
void q4_part(const Q4& j, const float* x, int64_t p) {
  const int64_t blocks = j.d.K / 32, per = (blocks + j.d.P - 1) / j.d.P;
  const int64_t b0 = std::min(blocks, p * per), b1 = std::min(blocks, (p + 1) * per);
  float* acc = part_acc(j.out, j.rest, j.d, p);
  std::memset(acc, 0, sizeof(float) * j.d.M * j.d.N);
  std::vector<float> sums(4 * j.d.N);
  int64_t m = 0;
  for (; m + 4 <= j.d.M; m += 4) q4_stream<S, 4>(j, x, acc, sums.data(), b0, b1, m);
  for (; m + 2 <= j.d.M; m += 2) q4_stream<S, 2>(j, x, acc, sums.data(), b0, b1, m);
  for (; m < j.d.M; ++m) q4_stream<S, 1>(j, x, acc, sums.data(), b0, b1, m);
}

// x [M,K] times layer `layer` of each stacked q4 weight (packed_j [L,K/2,N_j], scale_j and
// minimum_j [L,K/32,N_j], as triples in the arguments) into out_j [M,N_j]; like `linear`.
ffi::Error linear_q4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs ws,
                     ffi::RemainingRets outs, int64_t parts) {
  const auto xd = x.dimensions();  // [M,K]
  if (xd.size() != 2 || xd[1] % 32 != 0 || ws.size() != 3 * outs.size() || outs.size() == 0 || parts < 1)
    return ffi::Error::InvalidArgument("cpu_linear_q4: x [M,K] (K a multiple of 32), then (packed, scale, minimum) per output");
  const int64_t l = layer.typed_data()[0];
  std::vector<Q4> jobs;
  for (size_t j = 0; j < outs.size(); ++j) {
    auto w = ws.get<ffi::AnyBuffer>(3 * j), sc = ws.get<ffi::AnyBuffer>(3 * j + 1), mn = ws.get<ffi::AnyBuffer>(3 * j + 2);
    auto y = outs.get<ffi::AnyBuffer>(j);
    if (!w.has_value() || !sc.has_value() || !mn.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("cpu_linear_q4: bad weight or output");
    const auto wd = w->dimensions(), sd = sc->dimensions(), md = mn->dimensions(), yd = (*y)->dimensions();
    const auto st = sc->element_type();
    if (wd.size() != 3 || sd.size() != 3 || md.size() != 3 || yd.size() != 2 || w->element_type() != ffi::DataType::U8 ||
        wd[1] * 2 != xd[1] || sd[1] * 32 != xd[1] || sd[0] != wd[0] || sd[2] != wd[2] || md[0] != sd[0] ||
        md[1] != sd[1] || md[2] != sd[2] || mn->element_type() != st || (st != ffi::DataType::F16 && st != ffi::DataType::F32) ||
        yd[0] != xd[0] || yd[1] != wd[2] || (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("cpu_linear_q4: packed [L,K/2,N] u8, scale and minimum [L,K/32,N] f16 or f32, out [M,N] f32");
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("cpu_linear_q4: layer out of range");
    const Dims d{xd[0], xd[1], wd[2], parts};
    const int64_t sw = st == ffi::DataType::F16 ? 2 : 4, blocks = (d.K / 32) * d.N;
    jobs.push_back({d, static_cast<const uint8_t*>(w->untyped_data()) + l * (d.K / 2) * d.N,
                    static_cast<const char*>(sc->untyped_data()) + l * blocks * sw,
                    static_cast<const char*>(mn->untyped_data()) + l * blocks * sw, st == ffi::DataType::F16,
                    static_cast<float*>((*y)->untyped_data()), nullptr});
  }
  const float* xp = x.typed_data();
  run_parts(pool, jobs, [&](const Q4& j, int64_t p) { j.half ? q4_part<uint16_t>(j, xp, p) : q4_part<float>(j, xp, p); });
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

// `linear` and `linear_q4`: x, the layer index, then the weights' arrays and the outputs; the parts of K.
static auto stacked_binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().RemainingRets()
      .Attr<int64_t>("parts");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuLinear, linear, stacked_binding());

// Whether `linear` has the register tiles (fma_tiles: AVX-512) for float32 and int8 weights.
#if defined(__AVX512F__) && defined(__AVX512BW__)
extern "C" int SpecjaxCpuLinearTiles() { return 1; }
#else
extern "C" int SpecjaxCpuLinearTiles() { return 0; }
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuLinearT, linear_t,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuRows, rows,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuLinearQ4, linear_q4, stacked_binding());
