// y[M, N] = x[M, K] @ W[l]^T for one layer l of stacked weights W[L, N, K] (float32, row-major), small M.
//
// The decode step at small batch reads every weight once per step. XLA:CPU's and OpenBLAS's GEMM kernels reach
// only ~5-7 GB/s of weight reads at M = 8 on a 2-core EPYC (docs/performance.md), a quarter of the memory
// bandwidth. This kernel keeps the weights in the "one row of W per output column" layout so that every tile
// streams contiguous rows, register-blocks R rows of x against C rows of W (AVX2 + FMA), and prefetches the
// tile after next while computing, so that the weight stream and the FMAs overlap. Taking the stacked weights
// and the layer index also avoids the copy XLA makes when slicing a layer out of scanned parameters.
//
// Called from JAX through the XLA FFI (aepo_jax/model/_cpu_decode.py builds and registers it). Work is split
// over columns into parts run on XLA's intra-op thread pool; the caller claims parts itself and waits only for
// parts another thread has already started, so a busy pool never blocks it.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "aepo_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using aepo_cpu::exp_ps;
using aepo_cpu::hsum;
using aepo_cpu::run_parts;

constexpr int kAhead = 2;  // tiles ahead to prefetch

// y[r, n + c] = x[r, :] . w[c, :] for r < R, c < C; meanwhile prefetches `pf_lines` cache lines from `pf`.
template <int R, int C>
inline void tile(const float* x, int64_t K, const float* w, float* y, int64_t N, const char* pf, int64_t pf_lines) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t iters = K / 8;
  const int64_t per_iter = iters > 0 ? (pf_lines + iters - 1) / iters : 0;
  int64_t issued = 0;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int64_t j = 0; j < per_iter && issued < pf_lines; ++j, ++issued) _mm_prefetch(pf + 64 * issued, _MM_HINT_T0);
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) s += x[r * K + kk] * w[c * K + kk];
      y[r * N + c] = s;
    }
}

// Columns [n, n + C) for all M rows of x, in passes of 4 rows; the prefetch of the block `pf` (pf_lines lines)
// is spread over the passes.
template <int C>
inline void column_block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N,
                         const char* pf, int64_t pf_lines) {
  const int64_t passes = (M + 3) / 4;
  const int64_t per_pass = (pf_lines + passes - 1) / passes;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t m = 4 * p;
    const int64_t lo = std::min(pf_lines, p * per_pass);
    const int64_t cnt = std::min(per_pass, pf_lines - lo);
    const char* pp = pf + 64 * lo;
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(4, M - m)) {
      case 4: tile<4, C>(xm, K, w, ym, N, pp, cnt); break;
      case 3: tile<3, C>(xm, K, w, ym, N, pp, cnt); break;
      case 2: tile<2, C>(xm, K, w, ym, N, pp, cnt); break;
      default: tile<1, C>(xm, K, w, ym, N, pp, cnt); break;
    }
  }
}

// Output columns [n0, n1).
void columns(const float* x, int64_t M, int64_t K, const float* W, int64_t N, float* y, int64_t n0, int64_t n1) {
  constexpr int C = 3;
  const int64_t lines = (C * K * 4 + 63) / 64;
  int64_t n = n0;
  for (; n + C <= n1; n += C) {
    const int64_t ahead = n + kAhead * C;
    const int64_t pf_lines = ahead + C <= n1 ? lines : 0;
    column_block<C>(x, M, K, W + n * K, y + n, N, reinterpret_cast<const char*>(W + ahead * K), pf_lines);
  }
  for (; n < n1; ++n) column_block<1>(x, M, K, W + n * K, y + n, N, nullptr, 0);
}

ffi::Error SmallMMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t parts) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2)
    return ffi::Error::InvalidArgument("aepo_small_m_matmul: x must be [M, K] and w [..., N, K]");
  const int64_t M = xd[0], K = xd[1];
  const int64_t N = wd[wd.size() - 2];
  if (wd[wd.size() - 1] != K)
    return ffi::Error::InvalidArgument("aepo_small_m_matmul: the last axis of w must equal the last axis of x");
  int64_t layers = 1;
  for (size_t i = 0; i + 2 < wd.size(); ++i) layers *= wd[i];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("aepo_small_m_matmul: layer index out of range");
  const float* W = w.typed_data() + l * N * K;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  if (parts <= 0) parts = std::max<int64_t>(1, pool.num_threads());
  // At least 16 columns per part; part boundaries on multiples of 3 columns (the tile width).
  const int np = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(parts, N / 16)));
  const int64_t chunk = ((N + np - 1) / np + 2) / 3 * 3;
  run_parts(pool, np, [=](int p) {
    const int64_t n0 = std::min<int64_t>(N, p * chunk);
    const int64_t n1 = p == np - 1 ? N : std::min<int64_t>(N, n0 + chunk);
    columns(xp, M, K, W, N, yp, n0, n1);
  });
  return ffi::Error::Success();
}

// o[i * D + 8 j ...] = inv[i] * sum_a p[i * n + a] v[a * row + 8 j ...] for i < NG <= 3 query heads and j < NB <= 4
// vectors of 8: 12 accumulators + 3 broadcast probabilities + 1 value vector = all 16 AVX2 registers. Named
// variables, not arrays: with `__m256 acc[3][4]` GCC 12 kept the accumulators on the stack (a load and a store
// per FMA), as it did in the training-attention kernel's tile.
template <int NG, int NB>
inline void pv_tile(const float* vp, int64_t row, const float* p, int64_t n, const float* inv, float* o, int64_t D) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z, a23 = z;
  for (int64_t a = 0; a < n; ++a, vp += row) {
    const __m256 p0 = _mm256_broadcast_ss(p + a);
    const __m256 p1 = NG > 1 ? _mm256_broadcast_ss(p + n + a) : z;
    const __m256 p2 = NG > 2 ? _mm256_broadcast_ss(p + 2 * n + a) : z;
#define AEPO_PV_COL(j)                                         \
  if constexpr (NB > j) {                                      \
    const __m256 v = _mm256_loadu_ps(vp + 8 * j);              \
    a0##j = _mm256_fmadd_ps(p0, v, a0##j);                     \
    if constexpr (NG > 1) a1##j = _mm256_fmadd_ps(p1, v, a1##j); \
    if constexpr (NG > 2) a2##j = _mm256_fmadd_ps(p2, v, a2##j); \
  }
    AEPO_PV_COL(0) AEPO_PV_COL(1) AEPO_PV_COL(2) AEPO_PV_COL(3)
#undef AEPO_PV_COL
  }
#define AEPO_PV_STORE(i, j) \
  if constexpr (NG > i && NB > j) _mm256_storeu_ps(o + i * D + 8 * j, _mm256_mul_ps(a##i##j, _mm256_set1_ps(inv[i])));
  AEPO_PV_STORE(0, 0) AEPO_PV_STORE(0, 1) AEPO_PV_STORE(0, 2) AEPO_PV_STORE(0, 3)
  AEPO_PV_STORE(1, 0) AEPO_PV_STORE(1, 1) AEPO_PV_STORE(1, 2) AEPO_PV_STORE(1, 3)
  AEPO_PV_STORE(2, 0) AEPO_PV_STORE(2, 1) AEPO_PV_STORE(2, 2) AEPO_PV_STORE(2, 3)
#undef AEPO_PV_STORE
}

// [sum(c0), sum(c1), ..., sum(c7)]: the horizontal sums of 8 vectors at once (6 hadds, 2 lane permutes, 1 add).
inline __m256 hsum8(__m256 c0, __m256 c1, __m256 c2, __m256 c3, __m256 c4, __m256 c5, __m256 c6, __m256 c7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));  // lanes: c0..c3 low | high
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(c4, c5), _mm256_hadd_ps(c6, c7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Decode attention of slot s for one layer: the query heads of every KV head attend to cache entries
// [0, n) of that slot (n = pos[s] + 1), read in place from the stacked cache [L, S, T, KH, D].
//   q [S, H * D] (heads h = kh * G + g), out [S, H * D]; lg: scratch of KH * G * n floats.
void attend_slot(const float* q, const float* kc, const float* vc, float* out, int64_t s, int64_t n, int64_t T,
                 int64_t KH, int64_t G, int64_t D, float scale, float* lg) {
  const int64_t H = KH * G, row = KH * D;  // floats per cache position
  const float* qs = q + s * H * D;
  // Logits: blocks of 8 positions; per KV head, each of its G query heads against the block's 8 key rows (read
  // from memory once, then from L1), the 8 dot products reduced together (`hsum8`) instead of one at a time.
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t a0 = 0;
  for (; a0 + 8 <= n; a0 += 8) {
    const float* kp = kc + (s * T + a0) * row;
    for (int64_t kh = 0; kh < KH; ++kh) {
      const float* kr = kp + kh * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        const float* qh = qs + h * D;
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + d);
          c0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + d), c0);
          c1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + row + d), c1);
          c2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 2 * row + d), c2);
          c3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 3 * row + d), c3);
          c4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 4 * row + d), c4);
          c5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 5 * row + d), c5);
          c6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 6 * row + d), c6);
          c7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 7 * row + d), c7);
        }
        _mm256_storeu_ps(lg + h * n + a0, _mm256_mul_ps(hsum8(c0, c1, c2, c3, c4, c5, c6, c7), sc));
      }
    }
  }
  for (int64_t a = a0; a < n; ++a) {
    const float* kp = kc + (s * T + a) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float* kh = kp + (h / G) * D;
      const float* qh = qs + h * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(kh + d), acc);
      lg[h * n + a] = hsum(acc) * scale;
    }
  }
  // Softmax per head; the normaliser is applied to the output.
  float inv[64];
  for (int64_t h = 0; h < H; ++h) {
    float* l = lg + h * n;
    float m = l[0];
    for (int64_t a = 1; a < n; ++a) m = std::max(m, l[a]);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    int64_t a = 0;
    for (; a + 8 <= n; a += 8) {
      const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(l + a), mv));
      _mm256_storeu_ps(l + a, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; a < n; ++a) {
      alignas(32) float t[8] = {l[a] - m, 0, 0, 0, 0, 0, 0, 0};
      const float e = _mm256_cvtss_f32(exp_ps(_mm256_load_ps(t)));
      l[a] = e;
      sum += e;
    }
    inv[h] = 1.0f / sum;
  }
  // out[h] = sum_a p[h, a] v[a, h / G]: per KV head and 32-float block of D, the G heads' accumulators stay in
  // registers while the values stream once.
  float* os = out + s * H * D;
  for (int64_t kh = 0; kh < KH; ++kh) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const int64_t nb = std::min<int64_t>(4, (D - d0) / 8);
      for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int64_t ng = std::min<int64_t>(3, G - g0);
        const float* vp = vc + s * T * row + kh * D + d0;
        const float* p0 = lg + (kh * G + g0) * n;
        float* o = os + (kh * G + g0) * D + d0;
        const float* iv = inv + kh * G + g0;
        switch (ng * 4 + nb - 1) {
#define AEPO_PV_CASE(NG, NB) \
  case NG * 4 + NB - 1: pv_tile<NG, NB>(vp, row, p0, n, iv, o, D); break;
          AEPO_PV_CASE(1, 1) AEPO_PV_CASE(1, 2) AEPO_PV_CASE(1, 3) AEPO_PV_CASE(1, 4)
          AEPO_PV_CASE(2, 1) AEPO_PV_CASE(2, 2) AEPO_PV_CASE(2, 3) AEPO_PV_CASE(2, 4)
          AEPO_PV_CASE(3, 1) AEPO_PV_CASE(3, 2) AEPO_PV_CASE(3, 3) AEPO_PV_CASE(3, 4)
#undef AEPO_PV_CASE
          default: break;
        }
      }
    }
  }
}

// out[S, H * D] = decode attention of q[S, H * D] over layer `layer` of k/v caches [L, S, T, KH, D], slot s
// attending to its entries [0, pos[s]]. D must be a multiple of 8 and H <= 64 (checked).
ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pos,
                               ffi::ResultBuffer<ffi::F32> out, int64_t parts) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 2 || kd.size() != 5 || v.dimensions().size() != 5)
    return ffi::Error::InvalidArgument("aepo_decode_attention: q must be [S, H*D] and k, v [L, S, T, KH, D]");
  const int64_t L = kd[0], S = kd[1], T = kd[2], KH = kd[3], D = kd[4];
  for (int i = 0; i < 5; ++i)
    if (v.dimensions()[i] != kd[i]) return ffi::Error::InvalidArgument("aepo_decode_attention: k and v differ in shape");
  if (qd[0] != S || D % 8 != 0 || qd[1] % (KH * D) != 0 || pos.dimensions().size() != 1 || pos.dimensions()[0] != S)
    return ffi::Error::InvalidArgument("aepo_decode_attention: q [S, H*D] with H a multiple of KH, D % 8 == 0, pos [S]");
  const int64_t G = qd[1] / (KH * D);
  if (KH * G > 64) return ffi::Error::InvalidArgument("aepo_decode_attention: at most 64 query heads");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("aepo_decode_attention: layer index out of range");
  const float* kc = k.typed_data() + l * S * T * KH * D;
  const float* vc = v.typed_data() + l * S * T * KH * D;
  const float* qp = q.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (parts <= 0) parts = std::max<int64_t>(1, pool.num_threads());
  // One part per slot, claimed dynamically (rows differ in length); `parts` threads at most.
  run_parts(pool, static_cast<int>(S), [=](int s) {
    const int64_t n = std::min<int64_t>(std::max<int32_t>(pp[s], 0) + 1, T);
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < KH * G * n) scratch.resize(KH * G * n);
    attend_slot(qp, kc, vc, op, s, n, T, KH, G, D, scale, scratch.data());
  }, static_cast<int>(parts));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AepoSmallMMatmul, SmallMMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AepoDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));
