// Helpers shared by this package's CPU kernels (rollout/csrc/small_m_matmul.cc, model/csrc/train_attention.cc):
// AVX2 horizontal sum and exp, and the part scheduler on XLA's intra-op thread pool. Built into each kernel by
// aepo_jax/parallel/_native.py (which adds this directory to the include path and to the build's cache key).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace aepo_cpu {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 floats, x <= 0 (softmax after subtracting the row maximum): Cephes' expf polynomial, ~1 ulp.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

struct Job {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  int parts = 1;
};

// fn(p) for p < parts on the caller and up to `workers - 1` pool threads (parts claimed dynamically).
template <typename Fn>
void run_parts(xla::ffi::ThreadPool& pool, int parts, Fn fn, int workers = 1 << 30) {
  if (parts <= 1 || workers <= 1) {
    for (int p = 0; p < parts; ++p) fn(p);
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
  for (int i = 1; i < std::min(parts, workers); ++i) {
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

}  // namespace aepo_cpu
