// y[M, N] = x[M, K] @ W[l]^T for one layer l of stacked weights W[L, N, K] (float32, row-major), small M.
//
// The decode step at small batch reads every weight once per step. XLA:CPU's and OpenBLAS's GEMM kernels reach
// only ~5-7 GB/s of weight reads at M = 8 on a 2-core EPYC (docs/performance.md), a quarter of the memory
// bandwidth. This kernel keeps the weights in the "one row of W per output column" layout so that every tile
// streams contiguous rows, register-blocks R rows of x against C rows of W (AVX2 + FMA), and prefetches the
// tile after next while computing, so that the weight stream and the FMAs overlap. Taking the stacked weights
// and the layer index also avoids the copy XLA makes when slicing a layer out of scanned parameters.
//
// Called from JAX through the XLA FFI (aepo_jax/rollout/_cpu_matmul.py builds and registers it). Work is split
// over columns into parts run on XLA's intra-op thread pool; the caller claims parts itself and waits only for
// parts another thread has already started, so a busy pool never blocks it.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kAhead = 2;  // tiles ahead to prefetch

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

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

struct Job {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  int parts = 1;
};

template <typename Fn>
void run_parts(ffi::ThreadPool& pool, int parts, Fn fn) {
  if (parts <= 1) {
    fn(0);
    return;
  }
  auto job = std::make_shared<Job>();
  job->parts = parts;
  auto work = [job, fn]() {
    for (int p; (p = job->next.fetch_add(1)) < job->parts;) {
      fn(p);
      job->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int i = 1; i < parts; ++i) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  // Parts still running belong to threads that already started them. Spin briefly, then yield the core: with
  // more runnable threads than cores (several processes on a small machine) that thread may need this one.
  for (int spins = 0; job->done.load(std::memory_order_acquire) < parts; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AepoSmallMMatmul, SmallMMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));
