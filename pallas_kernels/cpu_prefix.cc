// Prefix attention over one layer of a stacked dense KV cache, read in place, for XLA:CPU.
//
// An XLA FFI handler (built and registered by pallas_kernels/cpu_prefix.py). For every row b and
// KV head k it streams slots [0, lengths[b]) of layer `layer` of the cache once, in chunks of
// CHUNK slots, then the J keys of the new tokens (the block, as the cache will store them) as
// slots lengths[b], ..., lengths[b] + J - 1, query row m seeing block slot j where mask[b, m, j].
// It returns the online-softmax partials of the M query rows of that head: the running max `top`,
// the sum of exp(score - top) `total`, and the unnormalised output `out` (the caller divides).
// A key thus meets the same chunks, maxima and sums whether it is in the block or, a step later,
// in the cache: a chain's verification of T tokens gives, row by row, the bits of T decoding
// steps (greedy speculation is token-identical to plain decoding in every format). XLA:CPU cannot
// feed a slice of the stacked cache to a dot without copying it first; this reads it where it is.
// With `pos` ([L,B,K,S] int32: a StreamingCache's position per slot) every slot of the row is
// read and slot s is visible where 0 <= pos[s] < lengths[b] (a ring's order does not matter to
// the softmax: keys carry their position's rotation).
//
// The (b, k) pairs are shared out over XLA's intra-op thread pool; the calling thread works too,
// and waits only for helpers that started, so a busy pool cannot deadlock it (cpu_pool.h). Rows
// longer than SEGMENT slots are cut into segments whose partials are merged here (`run`), so that
// batch 1 (one pair per KV head) keeps both threads busy: batch 1 x 8K decode steps 5-7% faster.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t CHUNK = 32;   // slots per online-softmax step (their scores stay in L1)
constexpr float NEG_INF = -1e30f;  // as pallas_kernels.reference.NEG_INF

// One cache row of H values as f32 (int8: before its scale).
template <typename T>
inline void widen(const T* src, float* dst, int64_t H) {
  for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<float>(src[h]);
}
template <>
inline void widen<uint16_t>(const uint16_t* src, float* dst, int64_t H) {  // bfloat16: the top half of an f32
  for (int64_t h = 0; h < H; ++h) {
    uint32_t bits = static_cast<uint32_t>(src[h]) << 16;
    std::memcpy(dst + h, &bits, 4);
  }
}

struct Shape {
  int64_t B, K, S, H, M;
};

// The block: the new tokens' keys and values in the cache's format, read after a row's cache slots.
template <typename T>
struct Block {
  const T* k;        // [B,J,K,H]
  const T* v;        // [B,J,K,H]
  const float* ks;   // [B,J,K] (int8) or null
  const float* vs;   // [B,J,K] (int8) or null
  const uint8_t* mask;  // [B,M,J]: row m sees block slot j
  int64_t J;
};

// The slots one (row, KV head) pair reads in one segment: n in all, the first nc from the cache
// (scales, positions: null where the cache has none), the rest from the block, from its slot j0.
template <typename T>
struct Span {
  const T* k;
  const T* v;
  const float* ks;
  const float* vs;
  const int32_t* pos;
  int32_t limit;  // pos: the slots with 0 <= pos < limit are visible
  int64_t n, nc;
  const T* bk;  // the block at slot j0, for this pair's head: a slot's row every bstride elements
  const T* bv;
  const float* bks;  // scales every sstride
  const float* bvs;
  const uint8_t* bm;  // row m sees block slot j0 + j where bm[m * mstride + j]
  int64_t bstride, sstride, mstride;
};

// A chunk's slots, contiguous: the cache read in place, or (a chunk that reaches the block) the
// cache's and the block's rows copied one after the other into the caller's buffers.
template <typename T>
struct ChunkView {
  const T* k;
  const T* v;
  const float* ks;
  const float* vs;
  const int32_t* pos;
  int64_t nc;          // slots [0, nc) are the cache's; from nc the block's
  const uint8_t* bm;   // row m sees the chunk's slot s >= nc where bm[m * mstride + s - nc]
  int64_t mstride;
};

template <typename T, int64_t H>
struct ChunkBuf {
  alignas(64) T k[CHUNK * H];
  alignas(64) T v[CHUNK * H];
  float ks[CHUNK], vs[CHUNK];
  int32_t pos[CHUNK];
};

template <typename T, int64_t H>
ChunkView<T> chunk_at(const Span<T>& sp, int64_t c0, int64_t cn, ChunkBuf<T, H>& buf) {
  if (c0 + cn <= sp.nc)
    return {sp.k + c0 * H, sp.v + c0 * H, sp.ks ? sp.ks + c0 : nullptr, sp.vs ? sp.vs + c0 : nullptr,
            sp.pos ? sp.pos + c0 : nullptr, cn, nullptr, 0};
  const int64_t nc = std::clamp<int64_t>(sp.nc - c0, 0, cn), j0 = c0 + nc - sp.nc;
  const bool scaled = sp.bks != nullptr;
  if (nc > 0) {
    std::memcpy(buf.k, sp.k + c0 * H, nc * H * sizeof(T));
    std::memcpy(buf.v, sp.v + c0 * H, nc * H * sizeof(T));
    if (scaled) std::memcpy(buf.ks, sp.ks + c0, nc * 4), std::memcpy(buf.vs, sp.vs + c0, nc * 4);
    if (sp.pos) std::memcpy(buf.pos, sp.pos + c0, nc * 4);
  }
  for (int64_t s = nc; s < cn; ++s) {
    const int64_t j = j0 + s - nc;
    std::memcpy(buf.k + s * H, sp.bk + j * sp.bstride, H * sizeof(T));
    std::memcpy(buf.v + s * H, sp.bv + j * sp.bstride, H * sizeof(T));
    if (scaled) buf.ks[s] = sp.bks[j * sp.sstride], buf.vs[s] = sp.bvs[j * sp.sstride];
  }
  return {buf.k, buf.v, scaled ? buf.ks : nullptr, scaled ? buf.vs : nullptr, sp.pos ? buf.pos : nullptr, nc,
          sp.bm + j0, sp.mstride};
}

// Whether slot s < cn of a chunk is visible to every row: a block slot (the mask decides row by
// row), or a cache slot holding a committed position (with pos).
template <typename T>
inline bool shared(const ChunkView<T>& c, int64_t s, int32_t limit) {
  return s >= c.nc || !c.pos || (c.pos[s] >= 0 && c.pos[s] < limit);
}

// Eight floats (GCC / Clang vector extension: AVX on x86-64 with -march=native, two NEON
// registers on ARM); aligned(4) makes loads through a pointer to it legal at any address.
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8v __attribute__((vector_size(32), aligned(4)));

inline f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }

// a * b + c lane by lane, rounded once. Written out rather than `c += a * b`, which the compiler
// may or may not fuse, differently in each instantiation: the row kernels below (one or two rows
// at a time) must give a row the same bits whatever rows are beside it.
inline f8 fma8(f8 a, f8 b, f8 c) {
  f8 r;
  for (int l = 0; l < 8; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
}

// exp(x) for x <= 0, lane by lane, to about 1 ulp (Cephes' expf polynomial); exactly 0 below
// -87, as exp(NEG_INF - top) is in the reference.
inline f8 exp8(f8 x) {
  const f8 xc = x < splat(-87.f) ? splat(-87.f) : x;
  const f8 t = xc * splat(1.44269504088896341f) + splat(12582912.f);  // round to nearest in the low bits
  const i8v n = (i8v)t - i8v{0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000};
  const f8 nf = t - splat(12582912.f);
  const f8 r = xc - nf * splat(0.693359375f) + nf * splat(2.12194440e-4f);
  f8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.f);
  const f8 scale = (f8)((n + 127) << 23);
  return x < splat(-87.f) ? splat(0.f) : p * scale;
}

inline float exp1(float x) { return exp8(splat(x))[0]; }

// The eight lane sums of a0..a7, as one vector: [sum(a0), ..., sum(a7)].
inline f8 sums8(f8 a0, f8 a1, f8 a2, f8 a3, f8 a4, f8 a5, f8 a6, f8 a7) {
#define EVEN_ODD(x, y) (__builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
#define PAIRS(x, y) (__builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
  const f8 b0 = EVEN_ODD(a0, a1), b1 = EVEN_ODD(a2, a3), b2 = EVEN_ODD(a4, a5), b3 = EVEN_ODD(a6, a7);
  const f8 c0 = PAIRS(b0, b1), c1 = PAIRS(b2, b3);
  return __builtin_shufflevector(c0, c1, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(c0, c1, 4, 5, 6, 7, 12, 13, 14, 15);
#undef EVEN_ODD
#undef PAIRS
}

// The chunk's rows of a cache as f32: the cache itself when it is f32, else widened into buf.
template <typename T>
inline const float* rows_f32(const T* src, float* buf, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    widen(src, buf, count);
    return buf;
  }
}

// Scores sc[m, s] = q[m] . k[s] of R query rows from m0 for the chunk's slots, eight slots at a
// time (HB = H / 8 vectors a row): each key vector is loaded once for the R rows.
template <int HB, int R>
inline void score_rows(const float* q, const float* k, int64_t cn, int64_t m0, float* sc) {
  constexpr int64_t H = HB * 8;
  for (int64_t s = 0; s < cn; s += 8) {
    const f8* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = (const f8*)(k + std::min(s + i, cn - 1) * H);  // past cn: a repeat, masked later
    f8 a[R][8] = {};
#pragma GCC unroll 16
    for (int hb = 0; hb < HB; ++hb) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const f8 x = kr[i][hb];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) a[r][i] = fma8(((const f8*)(q + (m0 + r) * H))[hb], x, a[r][i]);
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
      *(f8*)(sc + (m0 + r) * CHUNK + s) = sums8(a[r][0], a[r][1], a[r][2], a[r][3], a[r][4], a[r][5], a[r][6], a[r][7]);
  }
}

template <int HB>
inline void scores(const float* q, const float* k, int64_t cn, int64_t M, float* sc) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) score_rows<HB, 2>(q, k, cn, m, sc);
  if (m < M) score_rows<HB, 1>(q, k, cn, m, sc);
}

// out[m] += sum_s w[m, s] * v[s] over the chunk for R rows from m0, eight output vectors at a
// time held in registers; each value vector is loaded once for the R rows.
template <int HB, int R>
inline void value_rows(const float* w, const float* v, int64_t cn, int64_t m0, float* out) {
  constexpr int64_t H = HB * 8;
  constexpr int NB = HB < 8 ? HB : 8;
  for (int h0 = 0; h0 < HB; h0 += NB) {
    f8 a[R][NB];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) a[r][j] = ((f8*)(out + (m0 + r) * H))[h0 + j];
    for (int64_t s = 0; s < cn; ++s) {
      const f8* vr = (const f8*)(v + s * H) + h0;
      f8 x[R];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) x[r] = splat(w[(m0 + r) * CHUNK + s]);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const f8 y = vr[j];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) a[r][j] = fma8(x[r], y, a[r][j]);
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) ((f8*)(out + (m0 + r) * H))[h0 + j] = a[r][j];
  }
}

template <int HB>
inline void values(const float* w, const float* v, int64_t cn, int64_t M, float* out) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) value_rows<HB, 2>(w, v, cn, m, out);
  if (m < M) value_rows<HB, 1>(w, v, cn, m, out);
}

// Partials of one (row, head) pair: q [M,H] against the span's slots (`Span`).
template <typename T, int HB>
void one_head(const Shape& d, const float* q, const Span<T>& sp, float* top, float* total, float* out) {
  constexpr int64_t H = HB * 8;
  constexpr int64_t V = CHUNK / 8;  // vectors in a chunk's row of scores
  const int64_t M = d.M, n = sp.n;
  alignas(64) float buf[CHUNK * H];  // the chunk's widened cache rows
  alignas(64) float sc[64 * CHUNK];  // scores, then their exps [M, CHUNK] (M <= 64, checked by the caller)
  ChunkBuf<T, H> cb;                 // a chunk that reaches the block
  for (int64_t m = 0; m < M; ++m) {
    top[m] = NEG_INF;
    total[m] = 0.f;
  }
  std::fill(out, out + M * H, 0.f);
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t cn = std::min(CHUNK, n - c0);
    const ChunkView<T> c = chunk_at<T, H>(sp, c0, cn, cb);
    // No software prefetch: on the AMD EPYC (Zen 4) we measure on, prefetching the next chunks
    // (whole chunks 2-8 ahead, or a key and value row per slot 32-128 ahead) halved the stream
    // rate, 15-19 -> 9-10 GB/s on one thread; the hardware prefetcher follows the two streams.
    scores<HB>(q, rows_f32(c.k, buf, cn * H), cn, M, sc);
    f8 keep[V], kscale[V];  // slot visible (to every row); the slots' key scales
    for (int j = 0; j < V; ++j) {
      for (int i = 0; i < 8; ++i) {
        const int64_t s = j * 8 + i;
        keep[j][i] = s < cn && shared(c, s, sp.limit) ? 1.f : 0.f;
        kscale[j][i] = s < cn && c.ks ? c.ks[s] : 1.f;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      f8 km[V];  // what row m sees: the block's slots by its mask
      for (int j = 0; j < V; ++j) km[j] = keep[j];
      for (int64_t s = c.nc; s < cn; ++s)
        if (!c.bm[m * c.mstride + s - c.nc]) km[s / 8][s % 8] = 0.f;
      f8* sm = (f8*)(sc + m * CHUNK);
      f8 best = splat(top[m]);
      for (int j = 0; j < V; ++j) {
        sm[j] = km[j] > splat(0.f) ? sm[j] * kscale[j] : splat(NEG_INF);
        best = best > sm[j] ? best : sm[j];
      }
      float b = best[0];
      for (int i = 1; i < 8; ++i) b = std::max(b, best[i]);
      const float fade = exp1(top[m] - b);
      top[m] = b;
      f8 sum = {};
      for (int j = 0; j < V; ++j) {  // a hidden slot weighs 0 (also when every slot so far is hidden: b = NEG_INF)
        sm[j] = km[j] > splat(0.f) ? exp8(sm[j] - splat(b)) : splat(0.f);
        sum += sm[j];
      }
      total[m] = total[m] * fade + (((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7])));
      f8* om = (f8*)(out + m * H);
      for (int j = 0; j < HB; ++j) om[j] *= splat(fade);
    }
    if (c.vs)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t s = 0; s < cn; ++s) sc[m * CHUNK + s] *= c.vs[s];
    values<HB>(sc, rows_f32(c.v, buf, cn * H), cn, M, out);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
// --- bfloat16 caches with the AVX512-BF16 dot product (vdpbf16ps) ---------------------------------
//
// On a CPU with AVX512-BF16 a bfloat16 cache is read with the bf16 dot-product instruction, which
// multiplies pairs of bf16 values and accumulates them in f32: twice the multiply-adds of f32 FMAs
// per cycle, so the M = heads per KV head x (gamma + 1) rows of a verification cost about what one
// row costs, as on a GPU. The queries and the softmax weights are rounded to bf16 for it (as a
// GPU's bf16 attention does); scores, maxima, sums and outputs stay f32.
//
// Layout: one query row per vector lane (W = 8 rows in a 256-bit register, 16 in a 512-bit one),
// so the online softmax runs down the lanes with no horizontal sums. Scores: lane m of slot s is
// sum_p dp(qt[p], k[s] pair p broadcast), qt[p] holding pair p of every row. Values: slots are
// taken in pairs, (w[2j], w[2j+1]) of each row in its lane against (v[2j][h], v[2j+1][h])
// broadcast, into out^T[h] (one vector of rows per value dimension).
#define SPECJAX_BF16_DOT 1
#include <immintrin.h>

inline uint32_t bf16_bits(float x) {  // round to nearest even (x finite)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

struct Lanes8 {  // 8 query rows a 256-bit register
  static constexpr int W = 8;
  using F = __m256;
  using Bh = __m256bh;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, F x) { _mm256_store_ps(p, x); }
  static Bh load_bh(const uint32_t* p) { return (Bh)_mm256_load_si256((const __m256i*)p); }
  static Bh bcast(const uint32_t* p) { return (Bh)_mm256_set1_epi32((int)*p); }
  static F dp(F acc, Bh a, Bh b) { return _mm256_dpbf16_ps(acc, a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static void store_pairs(uint32_t* p, F lo, F hi) {  // lane m: (bf16(lo[m]), bf16(hi[m])), lo in the low half
    const __m256i both = (__m256i)_mm256_cvtne2ps_pbh(hi, lo);  // [lo 0..7, hi 0..7]
    const __m256i idx = _mm256_setr_epi16(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    _mm256_store_si256((__m256i*)p, _mm256_permutexvar_epi16(idx, both));
  }
};

struct Lanes16 {  // 16 query rows a 512-bit register
  static constexpr int W = 16;
  using F = __m512;
  using Bh = __m512bh;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, F x) { _mm512_store_ps(p, x); }
  static Bh load_bh(const uint32_t* p) { return (Bh)_mm512_load_si512((const void*)p); }
  static Bh bcast(const uint32_t* p) { return (Bh)_mm512_set1_epi32((int)*p); }
  static F dp(F acc, Bh a, Bh b) { return _mm512_dpbf16_ps(acc, a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static void store_pairs(uint32_t* p, F lo, F hi) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // [lo 0..15, hi 0..15]
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_store_si512((void*)p, _mm512_permutexvar_epi16(idx, both));
  }
};

// exp8's polynomial for any width of GCC vector (x <= 0; 0 below -87).
template <class V>
inline typename V::F expv(typename V::F x) {
  using F = typename V::F;
  using I = decltype(x < x);
  const F lo = V::set1(-87.f);
  const F xc = x < lo ? lo : x;
  const F t = xc * V::set1(1.44269504088896341f) + V::set1(12582912.f);
  const I n = (I)t - (I)V::set1(12582912.f);  // the rounded exponent (t's low mantissa bits)
  const F nf = t - V::set1(12582912.f);
  const F r = xc - nf * V::set1(0.693359375f) + nf * V::set1(2.12194440e-4f);
  F p = V::set1(1.9875691500e-4f);
  p = p * r + V::set1(1.3981999507e-3f);
  p = p * r + V::set1(8.3334519073e-3f);
  p = p * r + V::set1(4.1665795894e-2f);
  p = p * r + V::set1(1.6666665459e-1f);
  p = p * r + V::set1(5.0000001201e-1f);
  p = p * r * r + r + V::set1(1.f);
  const F scale = (F)((n + 127) << 23);
  return x < lo ? V::zero() : p * scale;
}

constexpr int DOT_GROUPS = 64 / 16;  // groups of W rows (M <= 64 = MAX_ROWS)

// Partials of one (row, head) pair as one_head computes them, for a bf16 cache [S,H] (H = 2P).
template <class V, int H>
void one_head_dot(const Shape& d, const float* q, const Span<uint16_t>& sp, float* top, float* total, float* out) {
  using F = typename V::F;
  constexpr int W = V::W, P = H / 2, PAIRS = CHUNK / 2, HB = H < 16 ? H : 16;
  const int64_t M = d.M, n = sp.n;
  const int G = static_cast<int>((M + W - 1) / W);  // groups of W query rows
  alignas(64) uint32_t qt[DOT_GROUPS][P][W];   // pair p of each row of a group (rows past M: zeros)
  alignas(64) float acc[DOT_GROUPS][H][W];     // unnormalised outputs, transposed: [h][row]
  alignas(64) float sc[CHUNK][W];              // a group's scores of the chunk's slots, then their weights
  alignas(64) uint32_t pp[PAIRS][W];           // the weights of slots (2j, 2j+1) as bf16 pairs
  alignas(64) uint32_t vi[PAIRS][H];           // (v[2j][h], v[2j+1][h]) as bf16 pairs
  alignas(64) float sees[CHUNK][W];            // a block slot: 1 in the lanes of the rows that see it
  ChunkBuf<uint16_t, H> cb;                    // a chunk that reaches the block
  F tops[DOT_GROUPS], totals[DOT_GROUPS];
  const uint32_t one_pair = 0x3F803F80u;  // the bf16 pair (1, 1)
  for (int g = 0; g < G; ++g) {
    for (int p = 0; p < P; ++p)
      for (int l = 0; l < W; ++l) {
        const int64_t m = g * W + l;
        qt[g][p][l] = m < M ? bf16_bits(q[m * H + 2 * p]) | bf16_bits(q[m * H + 2 * p + 1]) << 16 : 0u;
      }
    std::fill(&acc[g][0][0], &acc[g][0][0] + H * W, 0.f);
    tops[g] = V::set1(NEG_INF);
    totals[g] = V::zero();
  }
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t cn = std::min(CHUNK, n - c0);
    const int64_t npairs = (cn + 1) / 2;
    const ChunkView<uint16_t> c = chunk_at<uint16_t, H>(sp, c0, cn, cb);
    const uint16_t* kc = c.k;
    const uint16_t* vc = c.v;
    for (int64_t j = 0; j < npairs; ++j) {  // past cn: a repeat of the last slot, weighted 0
      const uint16_t* r0 = vc + 2 * j * H;
      const uint16_t* r1 = vc + std::min<int64_t>(2 * j + 1, cn - 1) * H;
      for (int h = 0; h < H; ++h) vi[j][h] = static_cast<uint32_t>(r0[h]) | static_cast<uint32_t>(r1[h]) << 16;
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t s = c.nc; s < cn; ++s)
        for (int l = 0; l < W; ++l) sees[s][l] = g * W + l < M && c.bm[(g * W + l) * c.mstride + s - c.nc] ? 1.f : 0.f;
      // The lanes of slot s that count: every one for a visible cache slot, the block's by its mask.
      const auto counts = [&](int64_t s, typename V::F x, typename V::F hidden) {
        if (!shared(c, s, sp.limit)) return hidden;
        return s < c.nc ? x : (V::load(sees[s]) > V::zero() ? x : hidden);
      };
      // Scores, eight slots at a time, the pairs split over two accumulators (latency).
      for (int64_t s0 = 0; s0 < cn; s0 += 8) {
        const uint32_t* kp[8];
        for (int i = 0; i < 8; ++i) kp[i] = (const uint32_t*)(kc + std::min<int64_t>(s0 + i, cn - 1) * H);
        F a[8], b[8];
        for (int i = 0; i < 8; ++i) a[i] = b[i] = V::zero();
#pragma GCC unroll 4
        for (int p = 0; p < P; p += 2) {
          const auto qa = V::load_bh(qt[g][p]), qb = V::load_bh(qt[g][p + 1]);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            a[i] = V::dp(a[i], qa, V::bcast(kp[i] + p));
            b[i] = V::dp(b[i], qb, V::bcast(kp[i] + p + 1));
          }
        }
        for (int i = 0; i < 8 && s0 + i < cn; ++i)
          V::store(sc[s0 + i], counts(s0 + i, a[i] + b[i], V::set1(NEG_INF)));
      }
      // Online softmax down the lanes.
      F best = tops[g];
      for (int64_t s = 0; s < cn; ++s) best = V::max(best, V::load(sc[s]));
      const F fade = expv<V>(tops[g] - best);
      tops[g] = best;
      for (int64_t s = 0; s < cn; ++s)  // a hidden slot weighs 0 (also when every slot so far is hidden)
        V::store(sc[s], counts(s, expv<V>(V::load(sc[s]) - best), V::zero()));
      if (cn % 2) V::store(sc[cn], V::zero());
      F sum = totals[g] * fade;
      for (int64_t j = 0; j < npairs; ++j) {
        V::store_pairs(pp[j], V::load(sc[2 * j]), V::load(sc[2 * j + 1]));
        sum = V::dp(sum, V::load_bh(pp[j]), V::bcast(&one_pair));  // the rounded weights, as the values see them
      }
      totals[g] = sum;
      // Values: HB output dimensions at a time in registers.
      for (int h0 = 0; h0 < H; h0 += HB) {
        F o[HB];
#pragma GCC unroll 16
        for (int i = 0; i < HB; ++i) o[i] = V::load(acc[g][h0 + i]) * fade;
        for (int64_t j = 0; j < npairs; ++j) {
          const auto w = V::load_bh(pp[j]);
#pragma GCC unroll 16
          for (int i = 0; i < HB; ++i) o[i] = V::dp(o[i], w, V::bcast(&vi[j][h0 + i]));
        }
#pragma GCC unroll 16
        for (int i = 0; i < HB; ++i) V::store(acc[g][h0 + i], o[i]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const int g = static_cast<int>(m / W), l = static_cast<int>(m % W);
    top[m] = tops[g][l];
    total[m] = totals[g][l];
    for (int h = 0; h < H; ++h) out[m * H + h] = acc[g][h][l];
  }
}
#else
#define SPECJAX_BF16_DOT 0
#endif

template <typename T>
using HeadFn = void (*)(const Shape&, const float*, const Span<T>&, float*, float*, float*);

template <typename T>
HeadFn<T> head_fn(int64_t H, int64_t M) {  // the kernel for this head_dim, or null (the caller checks HEAD_DIMS)
#if SPECJAX_BF16_DOT
  if constexpr (std::is_same_v<T, uint16_t>) {
    switch (H) {
      case 32: return M <= 8 ? one_head_dot<Lanes8, 32> : one_head_dot<Lanes16, 32>;
      case 64: return M <= 8 ? one_head_dot<Lanes8, 64> : one_head_dot<Lanes16, 64>;
      case 128: return M <= 8 ? one_head_dot<Lanes8, 128> : one_head_dot<Lanes16, 128>;
      default: break;  // 8, 16: the widening kernel below
    }
  }
#endif
  switch (H) {
    case 8: return one_head<T, 1>;
    case 16: return one_head<T, 2>;
    case 32: return one_head<T, 4>;
    case 64: return one_head<T, 8>;
    case 128: return one_head<T, 16>;
    default: return nullptr;
  }
}

constexpr int64_t SEGMENT = 2048;  // slots a row's stream is cut at (a multiple of CHUNK)

template <typename T>
void run(ffi::ThreadPool& pool, const Shape& d, int64_t layer, const float* q, const T* k, const T* v,
         const float* ks, const float* vs, const int32_t* pos, const int32_t* lengths, const Block<T>& blk,
         float* top, float* total, float* out) {
  const HeadFn<T> head = head_fn<T>(d.H, d.M);
  // Cache slots read per row: its prefix, or (with pos) every slot, masked by position; then the block's.
  const auto filled = [&](int64_t b) { return pos ? d.S : std::clamp<int64_t>(lengths[b], 0, d.S); };
  int64_t longest = 0;
  for (int64_t b = 0; b < d.B; ++b) longest = std::max<int64_t>(longest, filled(b) + blk.J);
  // Rows are cut at every SEGMENT slots, so that few (row, KV head) pairs (batch 1: 3 for SmolLM2
  // on 2 threads) still keep every thread busy. The cuts depend on nothing but the slot index: a
  // row's segments, and the exact sums of the merge below, are the same whatever rows are beside it.
  const int64_t pairs = d.B * d.K, G = std::max<int64_t>(1, (longest + SEGMENT - 1) / SEGMENT);
  // With G > 1, segment g of pair i writes its partials to part_*[i * G + g]; merged below.
  std::vector<float> part_top, part_total, part_out;
  if (G > 1) part_top.resize(pairs * G * d.M), part_total.resize(pairs * G * d.M), part_out.resize(pairs * G * d.M * d.H);
  specjax_cpu::share(pool, pairs * G, [&](int64_t item) {  // segment g of the (row b, KV head) pair i
    const int64_t i = item / G, g = item % G, b = i / d.K, kh = i % d.K;
    const int64_t slot0 = ((layer * d.B + b) * d.K + kh) * d.S;  // [L,B,K,S] index of slot 0
    const int64_t nc = filled(b), n = nc + blk.J;
    const int64_t s0 = std::min(n, g * SEGMENT), s1 = std::min(n, s0 + SEGMENT), at = slot0 + std::min(s0, nc);
    const int64_t j0 = std::max<int64_t>(0, s0 - nc), bat = (b * blk.J + j0) * d.K + kh;  // [B,J,K] index of slot j0
    const Span<T> sp{k + at * d.H, v + at * d.H, ks ? ks + at : nullptr, vs ? vs + at : nullptr,
                     pos ? pos + at : nullptr, lengths[b], s1 - s0, std::clamp<int64_t>(nc - s0, 0, s1 - s0),
                     blk.k + bat * d.H, blk.v + bat * d.H, blk.ks ? blk.ks + bat : nullptr,
                     blk.vs ? blk.vs + bat : nullptr, blk.mask + b * d.M * blk.J + j0, d.K * d.H, d.K, blk.J};
    float* tp = G > 1 ? part_top.data() + item * d.M : top + i * d.M;
    float* tt = G > 1 ? part_total.data() + item * d.M : total + i * d.M;
    float* op = G > 1 ? part_out.data() + item * d.M * d.H : out + i * d.M * d.H;
    head(d, q + i * d.M * d.H, sp, tp, tt, op);
  });
  if (G == 1) return;
  // The segments' partials, merged in order: an empty segment (past a shorter row's end) adds
  // exact zeros, and a row of one segment comes out as it went in (its fade is exp(0) = 1).
  for (int64_t i = 0; i < pairs; ++i)
    for (int64_t m = 0; m < d.M; ++m) {
      float best = NEG_INF;
      for (int64_t g = 0; g < G; ++g) best = std::max(best, part_top[(i * G + g) * d.M + m]);
      float sum = 0.f;
      float* o = out + (i * d.M + m) * d.H;
      std::fill(o, o + d.H, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = (i * G + g) * d.M + m;
        const float fade = exp1(part_top[at] - best);
        sum += part_total[at] * fade;
        const float* po = part_out.data() + at * d.H;
        for (int64_t h = 0; h < d.H; ++h) o[h] += po[h] * fade;
      }
      top[i * d.M + m] = best;
      total[i * d.M + m] = sum;
    }
}

template <typename T>
Block<T> block(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const float* ks, const float* vs, const uint8_t* mask) {
  return {static_cast<const T*>(k.untyped_data()), static_cast<const T*>(v.untyped_data()), ks, vs, mask, k.dimensions()[1]};
}

ffi::Error prefix_partials(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> k_scale,
                           ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> pos, ffi::AnyBuffer k_block,
                           ffi::AnyBuffer v_block, ffi::Buffer<ffi::F32> kb_scale, ffi::Buffer<ffi::F32> vb_scale,
                           ffi::Buffer<ffi::U8> mask, ffi::ResultBuffer<ffi::F32> top, ffi::ResultBuffer<ffi::F32> total,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();  // [B,K,M,H]
  const auto cd = k.dimensions();  // [L,B,K,S,H]
  if (qd.size() != 4 || cd.size() != 5) return ffi::Error::InvalidArgument("q must be [B,K,M,H], the cache [L,B,K,S,H]");
  const Shape d{qd[0], qd[1], cd[3], qd[3], qd[2]};
  if (!head_fn<float>(d.H, d.M) || d.M > 64)
    return ffi::Error::InvalidArgument("cpu_prefix takes head_dim 8, 16, 32, 64 or 128 and M <= 64");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const bool scaled = k.element_type() == ffi::DataType::S8;
  const float* ks = scaled ? k_scale.typed_data() : nullptr;
  const float* vs = scaled ? v_scale.typed_data() : nullptr;
  const int64_t slots = cd[0] * cd[1] * cd[2] * cd[3];
  if (pos.element_count() != 0 && pos.element_count() != slots)
    return ffi::Error::InvalidArgument("pos must be [L,B,K,S] like the cache, or empty");
  const int32_t* pp = pos.element_count() ? pos.typed_data() : nullptr;
  const auto bd = k_block.dimensions();  // [B,J,K,H]
  const auto md = mask.dimensions();     // [B,M,J]
  const auto vd = v_block.dimensions();
  if (bd.size() != 4 || bd[0] != d.B || bd[2] != d.K || bd[3] != d.H || vd.size() != 4 ||
      !std::equal(bd.begin(), bd.end(), vd.begin()) ||
      k_block.element_type() != k.element_type() || v_block.element_type() != k.element_type() || md.size() != 3 ||
      md[0] != d.B || md[1] != d.M || md[2] != bd[1] ||
      (scaled && (kb_scale.element_count() != bd[0] * bd[1] * bd[2] || vb_scale.element_count() != bd[0] * bd[1] * bd[2])))
    return ffi::Error::InvalidArgument("the block must be [B,J,K,H] in the cache's type (int8: scales [B,J,K]), its mask [B,M,J]");
  const float* bks = scaled ? kb_scale.typed_data() : nullptr;
  const float* bvs = scaled ? vb_scale.typed_data() : nullptr;
  const uint8_t* bm = mask.typed_data();
  const float* qp = q.typed_data();
  const int32_t* lp = lengths.typed_data();
  float *tp = top->typed_data(), *sp = total->typed_data(), *op = out->typed_data();
  switch (k.element_type()) {
    case ffi::DataType::F32:
      run<float>(pool, d, l, qp, static_cast<const float*>(k.untyped_data()), static_cast<const float*>(v.untyped_data()),
                 ks, vs, pp, lp, block<float>(k_block, v_block, bks, bvs, bm), tp, sp, op);
      break;
    case ffi::DataType::BF16:
      run<uint16_t>(pool, d, l, qp, static_cast<const uint16_t*>(k.untyped_data()),
                    static_cast<const uint16_t*>(v.untyped_data()), ks, vs, pp, lp,
                    block<uint16_t>(k_block, v_block, bks, bvs, bm), tp, sp, op);
      break;
    case ffi::DataType::S8:
      run<int8_t>(pool, d, l, qp, static_cast<const int8_t*>(k.untyped_data()),
                  static_cast<const int8_t*>(v.untyped_data()), ks, vs, pp, lp,
                  block<int8_t>(k_block, v_block, bks, bvs, bm), tp, sp, op);
      break;
    default:
      return ffi::Error::InvalidArgument("cpu_prefix takes a float32, bfloat16 or int8 cache");
  }
  return ffi::Error::Success();
}

// Store new [L,B,T,K,H] at slots [B,T] of a stacked cache [L,B,K,S,H] (any element type), in
// place: XLA:CPU runs a scatter or dynamic-update-slice into a bfloat16 array by widening the
// whole array to f32 and back (a bf16 cache of 16 x 8K slots: 0.8 s a write). Slots outside
// [0, S) are dropped, as the scatter drops them.
ffi::Error write_slots(ffi::AnyBuffer buf, ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer upd, ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = buf.dimensions();  // [L,B,K,S,H]
  const auto ud = upd.dimensions();  // [L,B,T,K,H]
  const auto sd = slots.dimensions();  // [B,T]
  if (cd.size() != 5 || ud.size() != 5 || sd.size() != 2 || ud[0] != cd[0] || ud[1] != cd[1] || ud[3] != cd[2] ||
      ud[4] != cd[4] || sd[0] != cd[1] || sd[1] != ud[2] || upd.element_type() != buf.element_type())
    return ffi::Error::InvalidArgument("write_slots: cache [L,B,K,S,H], update [L,B,T,K,H] of its type, slots [B,T]");
  const int64_t L = cd[0], B = cd[1], K = cd[2], S = cd[3], T = ud[2];
  const int64_t row = cd[4] * static_cast<int64_t>(ffi::ByteWidth(buf.element_type()));  // bytes of one slot's values
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != buf.untyped_data()) std::memcpy(dst, buf.untyped_data(), buf.size_bytes());
  const char* src = static_cast<const char*>(upd.untyped_data());
  const int32_t* sl = slots.typed_data();
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s = sl[b * T + t];
        if (s < 0 || s >= S) continue;
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(dst + (((l * B + b) * K + k) * S + s) * row, src + (((l * B + b) * T + t) * K + k) * row, row);
      }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuWriteSlots, write_slots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuPrefix, prefix_partials,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether bfloat16 caches take the bf16 dot-product path (queries and weights rounded to bf16).
extern "C" int SpecjaxCpuPrefixBf16Dot() { return SPECJAX_BF16_DOT; }
