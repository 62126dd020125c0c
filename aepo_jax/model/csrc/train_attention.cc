// Full-sequence (training) attention on CPU: forward and backward of
//   out = softmax(mask(q k^T / sqrt(D))) v
// with grouped query heads, for float32, called through the XLA FFI (aepo_jax/model/_cpu_attention.py).
//
// Why: XLA:CPU computes this as batched dots over the whole [T, S] score matrix of every head, with the causal
// half masked rather than skipped, and writes the scores, probabilities and their transposed layouts between
// the dots (~4 s of a 26 s SmolLM2-135M update step at 8 x 256, docs/performance.md). Here each (batch row,
// KV head) runs blocks of 16 queries x all G query heads against only the key range the mask allows for that
// block (a causal mask skips the upper triangle, left padding skips the pad columns), with AVX2 register-tiled
// GEMMs on packed, L1/L2-resident operands, and the softmax and its backward fused in between.
//
// Layouts (row-major): q [B, T, H, D] with query head h = kh * G + g; k, v [B, S, KH, D]; mask [B, T, S] (PRED);
// out [B, T, H, D]; lse [B, KH, T, G] (log-sum-exp of the scaled, masked scores: the backward recomputes the
// probabilities from it). A query row whose mask row is all false gets uniform probabilities over all S keys
// and zero score gradient, exactly what the XLA path does with its finite -1e30 fill. Such rows (the queries of
// left padding) stay out of the blocks' key ranges: their output is the mean of v, and their dO reaches dV as
// (1/S) * sum of their dO, added to every key's row at the end.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "aepo_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using aepo_cpu::exp_ps;
using aepo_cpu::hsum;
using aepo_cpu::run_parts;

constexpr int64_t kQ = 16;   // queries per block
constexpr int64_t kNR = 16;  // GEMM tile columns (2 AVX2 vectors)
constexpr int64_t kMR = 6;   // GEMM tile rows

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// C[i, j] (+)= sum_k A(i, k) B[k, j] for i < MR, j < 16, with A(i, k) = A[i * ai + k * ak].
// The 2 x MR accumulators are named variables, not an array: with `__m256 c[MR]` GCC 12 keeps the array in
// memory and stores every accumulator back to the stack on each k step, which halved the kernel's FMA rate
// (18 vs 36 GFLOP/s on one core of the development EPYC, whose peak is 39).
#define AEPO_TILE_ROW(i, STMT) \
  if constexpr (MR > i) {       \
    STMT(i, c##i##0, c##i##1)   \
  }
#define AEPO_TILE_ROWS(STMT)                                                                                   \
  AEPO_TILE_ROW(0, STMT) AEPO_TILE_ROW(1, STMT) AEPO_TILE_ROW(2, STMT) AEPO_TILE_ROW(3, STMT) AEPO_TILE_ROW(4, STMT) \
  AEPO_TILE_ROW(5, STMT)
#define AEPO_LOAD(i, x0, x1)                    \
  if constexpr (kAcc) {                         \
    x0 = _mm256_loadu_ps(C + i * ldc);          \
    x1 = _mm256_loadu_ps(C + i * ldc + 8);      \
  }
#define AEPO_FMA(i, x0, x1)                                 \
  {                                                         \
    const __m256 av = _mm256_broadcast_ss(a + i * ai);      \
    x0 = _mm256_fmadd_ps(av, b0, x0);                       \
    x1 = _mm256_fmadd_ps(av, b1, x1);                       \
  }
#define AEPO_STORE(i, x0, x1)               \
  _mm256_storeu_ps(C + i * ldc, x0);        \
  _mm256_storeu_ps(C + i * ldc + 8, x1);

template <int MR, bool kAcc>
inline void micro(int64_t K, const float* A, int64_t ai, int64_t ak, const float* B, int64_t ldb, float* C,
                  int64_t ldc) {
  static_assert(MR >= 1 && MR <= kMR, "tile rows");
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  AEPO_TILE_ROWS(AEPO_LOAD)
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    const __m256 b1 = _mm256_loadu_ps(B + k * ldb + 8);
    const float* a = A + k * ak;
    AEPO_TILE_ROWS(AEPO_FMA)
  }
  AEPO_TILE_ROWS(AEPO_STORE)
}
#undef AEPO_STORE
#undef AEPO_FMA
#undef AEPO_LOAD
#undef AEPO_TILE_ROWS
#undef AEPO_TILE_ROW

template <bool kAcc>
inline void micro_rows(int64_t rows, int64_t K, const float* A, int64_t ai, int64_t ak, const float* B, int64_t ldb,
                       float* C, int64_t ldc) {
  switch (rows) {
    case 6: micro<6, kAcc>(K, A, ai, ak, B, ldb, C, ldc); break;
    case 5: micro<5, kAcc>(K, A, ai, ak, B, ldb, C, ldc); break;
    case 4: micro<4, kAcc>(K, A, ai, ak, B, ldb, C, ldc); break;
    case 3: micro<3, kAcc>(K, A, ai, ak, B, ldb, C, ldc); break;
    case 2: micro<2, kAcc>(K, A, ai, ak, B, ldb, C, ldc); break;
    default: micro<1, kAcc>(K, A, ai, ak, B, ldb, C, ldc); break;
  }
}

// C[M, N] (+)= A(M, K) B[K, N]; N a multiple of 16. A(i, k) = A[i * ai + k * ak].
void gemm(bool acc, int64_t M, int64_t N, int64_t K, const float* A, int64_t ai, int64_t ak, const float* B,
          int64_t ldb, float* C, int64_t ldc) {
  for (int64_t j = 0; j < N; j += kNR) {
    for (int64_t i = 0; i < M; i += kMR) {
      const int64_t rows = std::min<int64_t>(kMR, M - i);
      if (acc) {
        micro_rows<true>(rows, K, A + i * ai, ai, ak, B + j, ldb, C + i * ldc + j, ldc);
      } else {
        micro_rows<false>(rows, K, A + i * ai, ai, ak, B + j, ldb, C + i * ldc + j, ldc);
      }
    }
  }
}

inline float exp1(float x) {
  alignas(32) float t[8] = {x, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_cvtss_f32(exp_ps(_mm256_load_ps(t)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// 8 mask bytes -> an all-ones / all-zeros float lane mask.
inline __m256 lane_mask(const bool* m) {
  int64_t bytes;
  std::memcpy(&bytes, m, 8);
  const __m256i w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(w, _mm256_setzero_si256()));
}

struct Shape {
  int64_t B, T, S, KH, G, D;
  int64_t H() const { return KH * G; }
  int64_t Sp() const { return round_up(S, kNR); }
  // Row strides of the scratch tiles, padded off powers of two: with a 1 KB stride (Sp = 256) the 64 rows a GEMM
  // tile reads map onto 4 of L1's 64 sets (no measurable difference at 8 x 256 on the development VM, though).
  int64_t ldr() const { return D + kNR; }     // [*, D] tiles
  int64_t lds() const { return Sp() + kNR; }  // [*, Sp] tiles
};

// Per (batch row, KV head): packed keys/values in both layouts, and per query row whether any key is allowed.
struct Packed {
  std::vector<float> kp, kt, vp, vt;  // [Sp, D] (stride ldr) and [D, Sp] (stride lds), zero-padded beyond S
  std::vector<uint8_t> empty;         // [T]
  bool any_empty = false;             // some query row of b has no valid key
  void pack(const Shape& s, const float* k, const float* v, const bool* mask, int64_t b, int64_t kh, bool need_vt,
            bool need_kp) {
    const int64_t Sp = s.Sp(), D = s.D, ldr = s.ldr(), lds = s.lds();
    kt.assign(D * lds, 0.f);
    vp.assign(Sp * ldr, 0.f);
    if (need_kp) kp.assign(Sp * ldr, 0.f);
    if (need_vt) vt.assign(D * lds, 0.f);
    for (int64_t a = 0; a < s.S; ++a) {
      const float* kr = k + ((b * s.S + a) * s.KH + kh) * D;
      const float* vr = v + ((b * s.S + a) * s.KH + kh) * D;
      std::memcpy(vp.data() + a * ldr, vr, D * sizeof(float));
      if (need_kp) std::memcpy(kp.data() + a * ldr, kr, D * sizeof(float));
      for (int64_t d = 0; d < D; ++d) {
        kt[d * lds + a] = kr[d];
        if (need_vt) vt[d * lds + a] = vr[d];
      }
    }
    empty.assign(s.T, 1);
    const bool* mb = mask + b * s.T * s.S;
    any_empty = false;
    for (int64_t t = 0; t < s.T; ++t) {
      const bool* mr = mb + t * s.S;
      for (int64_t a = 0; a < s.S; ++a)
        if (mr[a]) { empty[t] = 0; break; }
      any_empty |= empty[t] != 0;
    }
  }
};

// The key range [s0, s1) (multiples of 16, within [0, Sp)) that the non-empty queries of [t0, t1) of row b may
// attend to (empty when all are empty).
void key_range(const Shape& s, const bool* mask, const std::vector<uint8_t>& empty, int64_t b, int64_t t0, int64_t t1,
               int64_t* s0, int64_t* s1) {
  int64_t lo = s.S, hi = -1;
  for (int64_t t = t0; t < t1; ++t) {
    if (empty[t]) continue;
    const bool* mr = mask + (b * s.T + t) * s.S;
    for (int64_t a = 0; a < std::min(lo, s.S); ++a)
      if (mr[a]) { lo = a; break; }
    for (int64_t a = s.S - 1; a > hi; --a)
      if (mr[a]) { hi = a; break; }
  }
  if (hi < lo) { *s0 = *s1 = 0; return; }
  *s0 = lo / kNR * kNR;
  *s1 = std::min(round_up(hi + 1, kNR), s.Sp());
}

// Probabilities of block rows r (query t0 + r / G, head g = r % G) over keys [s0, s1), in place on the scores in
// p (row stride ldp). With lse_in, p = exp(score - lse) (the backward); otherwise the row max / sum are computed
// and lse_out written. Masked keys, rows beyond the last query and empty rows get 0 (an empty row's uniform
// probabilities, and its lse log S, are applied by the callers, outside the key range).
void probabilities(const Shape& s, const bool* mask, const std::vector<uint8_t>& empty, int64_t b, int64_t t0,
                   int64_t nrows, int64_t rows_pad, int64_t s0, int64_t s1, float scale, float* p, int64_t ldp,
                   const float* lse_in, float* lse_out) {
  const int64_t G = s.G;
  for (int64_t r = 0; r < rows_pad; ++r) {
    float* pr = p + r * ldp;
    if (r >= nrows) {
      std::fill(pr + s0, pr + s1, 0.f);
      continue;
    }
    const int64_t t = t0 + r / G;
    if (empty[t]) {
      std::fill(pr + s0, pr + s1, 0.f);
      continue;
    }
    const bool* mr = mask + (b * s.T + t) * s.S;
    const int64_t full = std::min(s1, s.S / 8 * 8);  // vector part with mask bytes inside [0, S)
    const __m256 sc = _mm256_set1_ps(scale);
    float m;
    if (lse_in) {
      m = lse_in[r];
    } else {
      __m256 mv = _mm256_set1_ps(-INFINITY);
      int64_t a = s0;
      for (; a + 8 <= full; a += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(pr + a), sc);
        mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, lane_mask(mr + a)));
      }
      m = hmax(mv);
      for (; a < std::min(s1, s.S); ++a)
        if (mr[a]) m = std::max(m, pr[a] * scale);
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    int64_t a = s0;
    for (; a + 8 <= full; a += 8) {
      const __m256 x = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(pr + a), sc), mv);
      const __m256 e = _mm256_and_ps(exp_ps(_mm256_min_ps(x, _mm256_setzero_ps())), lane_mask(mr + a));
      _mm256_storeu_ps(pr + a, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; a < s1; ++a) {
      const float e = (a < s.S && mr[a]) ? exp1(std::min(pr[a] * scale - m, 0.f)) : 0.f;
      pr[a] = e;
      sum += e;
    }
    if (!lse_in) {
      const float inv = 1.0f / sum;
      const __m256 iv = _mm256_set1_ps(inv);
      for (a = s0; a < s1; a += 8) _mm256_storeu_ps(pr + a, _mm256_mul_ps(_mm256_loadu_ps(pr + a), iv));
      lse_out[r] = m + std::log(sum);
    }
  }
}

template <typename Dims>
ffi::Error check(const Shape& s, const Dims& qd, const Dims& kd, const Dims& vd, const Dims& md, const char* who) {
  const std::string w(who);
  if (qd[2] % kd[2] != 0) return ffi::Error::InvalidArgument(w + ": query heads must be a multiple of KV heads");
  for (int i = 0; i < 4; ++i)
    if (vd[i] != kd[i]) return ffi::Error::InvalidArgument(w + ": k and v differ in shape");
  if (kd[0] != s.B || kd[3] != s.D) return ffi::Error::InvalidArgument(w + ": q and k differ in batch or head_dim");
  if (md[0] != s.B || md[1] != s.T || md[2] != s.S)
    return ffi::Error::InvalidArgument(w + ": mask must be [B, T, S] (no broadcasting)");
  if (s.D % kNR != 0) return ffi::Error::InvalidArgument(std::string(who) + ": head_dim must be a multiple of 16");
  if (s.S < 1 || s.T < 1) return ffi::Error::InvalidArgument(std::string(who) + ": empty sequence");
  if (s.G < 1 || s.G > 64) return ffi::Error::InvalidArgument(std::string(who) + ": 1 to 64 query heads per KV head");
  return ffi::Error::Success();
}

ffi::Error AttentionFwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse, int64_t parts) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v.dimensions().size() != 4 || mask.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("aepo_train_attention_fwd: q [B,T,H,D], k/v [B,S,KH,D], mask [B,T,S]");
  Shape s{qd[0], qd[1], kd[1], kd[2], qd[2] / kd[2], qd[3]};
  if (auto e = check(s, qd, kd, v.dimensions(), mask.dimensions(), "aepo_train_attention_fwd"); e.failure()) return e;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  if (parts <= 0) parts = std::max<int64_t>(1, pool.num_threads());
  run_parts(pool, static_cast<int>(s.B * s.KH), [=](int task) {
    const int64_t b = task / s.KH, kh = task % s.KH, G = s.G, D = s.D, H = s.H(), ldr = s.ldr(), lds = s.lds();
    thread_local Packed pk;
    thread_local std::vector<float> qb, pb, ob, vmean;
    pk.pack(s, kp, vp, mp, b, kh, false, false);
    vmean.assign(D, 0.f);  // the output of an empty row: the mean of v over all S keys
    if (pk.any_empty) {
      for (int64_t a = 0; a < s.S; ++a)
        for (int64_t d = 0; d < D; ++d) vmean[d] += pk.vp[a * ldr + d];
      const float inv = 1.0f / static_cast<float>(s.S);
      for (int64_t d = 0; d < D; ++d) vmean[d] *= inv;
    }
    const int64_t rows_pad = round_up(kQ * G, kMR);
    qb.assign(rows_pad * ldr, 0.f);
    pb.resize(rows_pad * lds);
    ob.resize(rows_pad * ldr);
    float lse_blk[kQ * 64];
    for (int64_t t0 = 0; t0 < s.T; t0 += kQ) {
      const int64_t t1 = std::min(s.T, t0 + kQ), nrows = (t1 - t0) * G;
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t g = 0; g < G; ++g)
          std::memcpy(qb.data() + ((t - t0) * G + g) * ldr, qp + ((b * s.T + t) * H + kh * G + g) * D,
                      D * sizeof(float));
      std::fill(qb.begin() + nrows * ldr, qb.end(), 0.f);
      int64_t s0, s1;
      key_range(s, mp, pk.empty, b, t0, t1, &s0, &s1);
      if (s1 > s0) {
        gemm(false, rows_pad, s1 - s0, D, qb.data(), ldr, 1, pk.kt.data() + s0, lds, pb.data() + s0, lds);
        probabilities(s, mp, pk.empty, b, t0, nrows, rows_pad, s0, s1, scale, pb.data(), lds, nullptr, lse_blk);
        gemm(false, rows_pad, D, s1 - s0, pb.data() + s0, lds, 1, pk.vp.data() + s0 * ldr, ldr, ob.data(), ldr);
      }
      for (int64_t r = 0; r < nrows; ++r)  // empty rows: uniform over all S keys (with s1 == s0, every row is)
        if (pk.empty[t0 + r / G]) {
          std::memcpy(ob.data() + r * ldr, vmean.data(), D * sizeof(float));
          lse_blk[r] = std::log(static_cast<float>(s.S));
        }
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t g = 0; g < G; ++g) {
          std::memcpy(op + ((b * s.T + t) * H + kh * G + g) * D, ob.data() + ((t - t0) * G + g) * ldr,
                      D * sizeof(float));
          lp[((b * s.KH + kh) * s.T + t) * G + g] = lse_blk[(t - t0) * G + g];
        }
    }
  }, static_cast<int>(parts));
  return ffi::Error::Success();
}

ffi::Error AttentionBwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> out,
                            ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                            ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, int64_t parts) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v.dimensions().size() != 4 || mask.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("aepo_train_attention_bwd: q [B,T,H,D], k/v [B,S,KH,D], mask [B,T,S]");
  Shape s{qd[0], qd[1], kd[1], kd[2], qd[2] / kd[2], qd[3]};
  if (auto e = check(s, qd, kd, v.dimensions(), mask.dimensions(), "aepo_train_attention_bwd"); e.failure()) return e;
  if (out.dimensions().size() != 4 || dout.dimensions().size() != 4 || lse.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("aepo_train_attention_bwd: out, dout [B,T,H,D] and lse [B,KH,T,G]");
  for (int i = 0; i < 4; ++i)
    if (out.dimensions()[i] != qd[i] || dout.dimensions()[i] != qd[i])
      return ffi::Error::InvalidArgument("aepo_train_attention_bwd: out and dout must have q's shape");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  const float* op = out.typed_data();
  const float* lp = lse.typed_data();
  const float* gp = dout.typed_data();
  float* dqp = dq->typed_data();
  float* dkp = dk->typed_data();
  float* dvp = dv->typed_data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  if (parts <= 0) parts = std::max<int64_t>(1, pool.num_threads());
  run_parts(pool, static_cast<int>(s.B * s.KH), [=](int task) {
    const int64_t b = task / s.KH, kh = task % s.KH, G = s.G, D = s.D, H = s.H(), Sp = s.Sp();
    const int64_t ldr = s.ldr(), lds = s.lds();
    thread_local Packed pk;
    thread_local std::vector<float> qb, gb, pb, db, dqb, dkacc, dvacc, gsum;
    pk.pack(s, kp, vp, mp, b, kh, true, true);
    gsum.assign(D, 0.f);  // sum of the empty rows' dO: each key's dV gets gsum / S
    const int64_t rows_pad = round_up(kQ * G, kMR);
    qb.assign(rows_pad * ldr, 0.f);
    gb.assign(rows_pad * ldr, 0.f);
    pb.resize(rows_pad * lds);
    db.resize(rows_pad * lds);
    dqb.resize(rows_pad * ldr);
    dkacc.assign(Sp * ldr, 0.f);
    dvacc.assign(Sp * ldr, 0.f);
    float lse_blk[kQ * 64], delta[kQ * 64];
    for (int64_t t0 = 0; t0 < s.T; t0 += kQ) {
      const int64_t t1 = std::min(s.T, t0 + kQ), nrows = (t1 - t0) * G;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t off = ((b * s.T + t) * H + kh * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (t - t0) * G + g;
          std::memcpy(qb.data() + r * ldr, qp + off + g * D, D * sizeof(float));
          std::memcpy(gb.data() + r * ldr, gp + off + g * D, D * sizeof(float));
          lse_blk[r] = lp[((b * s.KH + kh) * s.T + t) * G + g];
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(gp + off + g * D + d), _mm256_loadu_ps(op + off + g * D + d), acc);
          delta[r] = hsum(acc);
          if (pk.empty[t])
            for (int64_t d = 0; d < D; ++d) gsum[d] += gp[off + g * D + d];
        }
      }
      std::fill(qb.begin() + nrows * ldr, qb.end(), 0.f);
      std::fill(gb.begin() + nrows * ldr, gb.end(), 0.f);
      int64_t s0, s1;
      key_range(s, mp, pk.empty, b, t0, t1, &s0, &s1);
      if (s1 <= s0) {
        for (int64_t t = t0; t < t1; ++t)
          std::memset(dqp + ((b * s.T + t) * H + kh * G) * D, 0, G * D * sizeof(float));
        continue;
      }
      const int64_t n = s1 - s0;
      // P (recomputed from the saved log-sum-exp), dV += P^T dO, dP = dO V^T
      gemm(false, rows_pad, n, D, qb.data(), ldr, 1, pk.kt.data() + s0, lds, pb.data() + s0, lds);
      probabilities(s, mp, pk.empty, b, t0, nrows, rows_pad, s0, s1, scale, pb.data(), lds, lse_blk, nullptr);
      // the rows with keys carry exp(score - lse); empty rows 0 (their dV share is gsum)
      gemm(true, n, D, rows_pad, pb.data() + s0, 1, lds, gb.data(), ldr, dvacc.data() + s0 * ldr, ldr);
      gemm(false, rows_pad, n, D, gb.data(), ldr, 1, pk.vt.data() + s0, lds, db.data() + s0, lds);
      // dS = P * (dP - delta) * scale; zero on masked keys (P is 0 there), padding rows and empty rows
      for (int64_t r = 0; r < rows_pad; ++r) {
        float* dr = db.data() + r * lds;
        const float* pr = pb.data() + r * lds;
        if (r >= nrows || pk.empty[t0 + r / G]) {
          std::fill(dr + s0, dr + s1, 0.f);
          continue;
        }
        const __m256 dl = _mm256_set1_ps(delta[r]), sc = _mm256_set1_ps(scale);
        for (int64_t a = s0; a < s1; a += 8) {
          const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(pr + a), _mm256_sub_ps(_mm256_loadu_ps(dr + a), dl));
          _mm256_storeu_ps(dr + a, _mm256_mul_ps(x, sc));
        }
      }
      // dQ = dS K, dK += dS^T Q
      gemm(false, rows_pad, D, n, db.data() + s0, lds, 1, pk.kp.data() + s0 * ldr, ldr, dqb.data(), ldr);
      gemm(true, n, D, rows_pad, db.data() + s0, 1, lds, qb.data(), ldr, dkacc.data() + s0 * ldr, ldr);
      for (int64_t r = 0; r < nrows; ++r)
        std::memcpy(dqp + ((b * s.T + t0 + r / G) * H + kh * G + r % G) * D, dqb.data() + r * ldr,
                    D * sizeof(float));
    }
    if (pk.any_empty) {
      const float inv = 1.0f / static_cast<float>(s.S);
      for (int64_t d = 0; d < D; ++d) gsum[d] *= inv;
      for (int64_t a = 0; a < s.S; ++a)
        for (int64_t d = 0; d < D; ++d) dvacc[a * ldr + d] += gsum[d];
    }
    for (int64_t a = 0; a < s.S; ++a) {
      std::memcpy(dkp + ((b * s.S + a) * s.KH + kh) * D, dkacc.data() + a * ldr, D * sizeof(float));
      std::memcpy(dvp + ((b * s.S + a) * s.KH + kh) * D, dvacc.data() + a * ldr, D * sizeof(float));
    }
  }, static_cast<int>(parts));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AepoTrainAttentionFwd, AttentionFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AepoTrainAttentionBwd, AttentionBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));
