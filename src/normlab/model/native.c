/* normlab's native CPU kernels, behind normlab.model.native (see its docstring for why):
 * LayerNorm / RMSNorm over the last dim of a contiguous float32 [N, D] tensor, forward and
 * backward; and RoPE's rotation (at the end of this file).
 *
 * Norms. ATen's CPU kernel reduces one row at a time, so on QKV-Norm's 16-float rows it is
 * bound by each row's chain of adds (~22 ns a row). Here, with AVX2, eight rows are reduced at
 * once (a tree of horizontal adds puts the eight row sums in one register); other widths and
 * CPUs take a plain per-row loop. Rows are split over `nthreads` OpenMP threads.
 *
 * y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(mean((x - mean)^2) + eps); `center` = 0 gives
 * RMSNorm (mean = 0). `b` may be NULL. mean and rstd ([N]) are saved for the backward:
 * gx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)), gw = sum g*xhat, gb = sum g.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* rows [s, e), one at a time: any width */
static void fwd_rows(const float *x, const float *w, const float *b, float *y, float *mean,
                     float *rstd, int64_t s, int64_t e, int64_t D, int center, float eps) {
  for (int64_t i = s; i < e; ++i) {
    const float *r = x + i * D;
    float *o = y + i * D;
    float m = 0.f, v = 0.f;
    if (center) {
      for (int64_t j = 0; j < D; ++j) m += r[j];
      m /= (float)D;
    }
    for (int64_t j = 0; j < D; ++j) v += (r[j] - m) * (r[j] - m);
    float rs = 1.f / sqrtf(v / (float)D + eps);
    for (int64_t j = 0; j < D; ++j) o[j] = (r[j] - m) * rs * w[j] + (b ? b[j] : 0.f);
    mean[i] = m;
    rstd[i] = rs;
  }
}

static void bwd_rows(const float *gy, const float *x, const float *w, const float *mean,
                     const float *rstd, float *gx, float *gw, float *gb, int64_t s, int64_t e,
                     int64_t D, int center) {
  for (int64_t i = s; i < e; ++i) {
    const float *g = gy + i * D, *r = x + i * D;
    float *o = gx + i * D;
    float m = mean[i], rs = rstd[i], a = 0.f, c = 0.f;
    for (int64_t j = 0; j < D; ++j) {
      float xh = (r[j] - m) * rs, gh = g[j] * w[j];
      a += gh;
      c += gh * xh;
      gw[j] += g[j] * xh;
      gb[j] += g[j];
    }
    a = center ? a / (float)D : 0.f;
    c /= (float)D;
    for (int64_t j = 0; j < D; ++j) o[j] = rs * (g[j] * w[j] - a - (r[j] - m) * rs * c);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOAD _mm256_loadu_ps
#define BCAST _mm256_broadcast_ss

/* lane q of the result = the sum of the 8 lanes of v[q] */
static inline __m256 hsum8(const __m256 *v) {
  __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                       _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* rows of D = 8K floats, eight at a time; returns the first row left for fwd_rows */
static inline int64_t fwd_rows8(const float *x, const float *w, const float *b, float *y,
                                float *mean, float *rstd, int64_t s, int64_t e, int64_t K,
                                int center, float eps) {
  const int64_t D = 8 * K;
  const __m256 inv_d = _mm256_set1_ps(1.f / (float)D), veps = _mm256_set1_ps(eps);
  int64_t i = s;
  for (; i + 8 <= e; i += 8) {
    const float *r = x + i * D;
    __m256 acc[8], mv = _mm256_setzero_ps();
    if (center) {
      for (int q = 0; q < 8; ++q) {
        __m256 t = LOAD(r + q * D);
        for (int64_t k = 1; k < K; ++k) t = _mm256_add_ps(t, LOAD(r + q * D + 8 * k));
        acc[q] = t;
      }
      mv = _mm256_mul_ps(hsum8(acc), inv_d);
    }
    _mm256_storeu_ps(mean + i, mv);
    for (int q = 0; q < 8; ++q) {
      __m256 m = BCAST(mean + i + q), t = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        __m256 c = _mm256_sub_ps(LOAD(r + q * D + 8 * k), m);
        t = _mm256_fmadd_ps(c, c, t);
      }
      acc[q] = t;
    }
    __m256 rs = _mm256_div_ps(_mm256_set1_ps(1.f),
                              _mm256_sqrt_ps(_mm256_fmadd_ps(hsum8(acc), inv_d, veps)));
    _mm256_storeu_ps(rstd + i, rs);
    for (int q = 0; q < 8; ++q) {
      __m256 m = BCAST(mean + i + q), a = BCAST(rstd + i + q);
      for (int64_t k = 0; k < K; ++k) {
        __m256 xh = _mm256_mul_ps(_mm256_sub_ps(LOAD(r + q * D + 8 * k), m), a);
        __m256 o = b ? _mm256_fmadd_ps(xh, LOAD(w + 8 * k), LOAD(b + 8 * k))
                     : _mm256_mul_ps(xh, LOAD(w + 8 * k));
        _mm256_storeu_ps(y + (i + q) * D + 8 * k, o);
      }
    }
  }
  return i;
}

static inline int64_t bwd_rows8(const float *gy, const float *x, const float *w,
                                const float *mean, const float *rstd, float *gx, float *gw,
                                float *gb, int64_t s, int64_t e, int64_t K, int center) {
  const int64_t D = 8 * K;
  const __m256 inv_d = _mm256_set1_ps(1.f / (float)D);
  /* gw, gb partial sums stay in registers over all rows (K is 2 or 8 in the inlined copies) */
  __m256 aw[32], ab[32];
  for (int64_t k = 0; k < K; ++k) {
    aw[k] = LOAD(gw + 8 * k);
    ab[k] = LOAD(gb + 8 * k);
  }
  int64_t i = s;
  for (; i + 8 <= e; i += 8) {
    __m256 sa[8], sc[8];
    for (int q = 0; q < 8; ++q) {
      const float *g = gy + (i + q) * D, *r = x + (i + q) * D;
      __m256 m = BCAST(mean + i + q), a = BCAST(rstd + i + q);
      __m256 ta = _mm256_setzero_ps(), tc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        __m256 gv = LOAD(g + 8 * k), xh = _mm256_mul_ps(_mm256_sub_ps(LOAD(r + 8 * k), m), a);
        __m256 gh = _mm256_mul_ps(gv, LOAD(w + 8 * k));
        ta = _mm256_add_ps(ta, gh);
        tc = _mm256_fmadd_ps(gh, xh, tc);
        aw[k] = _mm256_fmadd_ps(gv, xh, aw[k]);
        ab[k] = _mm256_add_ps(gv, ab[k]);
      }
      sa[q] = ta;
      sc[q] = tc;
    }
    float av[8], cv[8];
    _mm256_storeu_ps(av, center ? _mm256_mul_ps(hsum8(sa), inv_d) : _mm256_setzero_ps());
    _mm256_storeu_ps(cv, _mm256_mul_ps(hsum8(sc), inv_d));
    /* gx may be gy's own buffer: each float of g is read before its gx is written */
    for (int q = 0; q < 8; ++q) {
      const float *g = gy + (i + q) * D, *r = x + (i + q) * D;
      __m256 m = BCAST(mean + i + q), a = BCAST(rstd + i + q);
      __m256 A = BCAST(av + q), C = BCAST(cv + q);
      for (int64_t k = 0; k < K; ++k) {
        __m256 xh = _mm256_mul_ps(_mm256_sub_ps(LOAD(r + 8 * k), m), a);
        __m256 gh = _mm256_mul_ps(LOAD(g + 8 * k), LOAD(w + 8 * k));
        __m256 t = _mm256_fnmadd_ps(xh, C, _mm256_sub_ps(gh, A));
        _mm256_storeu_ps(gx + (i + q) * D + 8 * k, _mm256_mul_ps(t, a));
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm256_storeu_ps(gw + 8 * k, aw[k]);
    _mm256_storeu_ps(gb + 8 * k, ab[k]);
  }
  return i;
}
#define HAVE_ROWS8 1
#else
#define HAVE_ROWS8 0
#endif

/* this thread's rows [s, e) of N */
static void my_rows(int64_t N, int64_t *s, int64_t *e) {
  int64_t t = 0, T = 1;
#ifdef _OPENMP
  t = omp_get_thread_num();
  T = omp_get_num_threads();
#endif
  *s = N * t / T;
  *e = N * (t + 1) / T;
}

/* 1 when widths that are multiples of 8 take the eight-rows-at-once path */
int nl_has_rows8(void) { return HAVE_ROWS8; }

void nl_norm_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                 float *rstd, int64_t N, int64_t D, int center, float eps, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e;
    my_rows(N, &s, &e);
#if HAVE_ROWS8
    /* the common widths get their own inlined copies, with K known to the compiler */
    if (D == 16) s = fwd_rows8(x, w, b, y, mean, rstd, s, e, 2, center, eps);
    else if (D == 64) s = fwd_rows8(x, w, b, y, mean, rstd, s, e, 8, center, eps);
    else if (D % 8 == 0) s = fwd_rows8(x, w, b, y, mean, rstd, s, e, D / 8, center, eps);
#endif
    fwd_rows(x, w, b, y, mean, rstd, s, e, D, center, eps);
  }
}

/* gw, gb: [nthreads, D] scratch; on return row 0 holds the totals */
void nl_norm_bwd(const float *gy, const float *x, const float *w, const float *mean,
                 const float *rstd, float *gx, float *gw, float *gb, int64_t N, int64_t D,
                 int center, int nthreads) {
  int used = 1;
  memset(gw, 0, sizeof(float) * D * nthreads);
  memset(gb, 0, sizeof(float) * D * nthreads);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e, t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
    if (t == 0) used = omp_get_num_threads();
#endif
    my_rows(N, &s, &e);
    float *tw = gw + t * D, *tb = gb + t * D;
#if HAVE_ROWS8
    if (D == 16) s = bwd_rows8(gy, x, w, mean, rstd, gx, tw, tb, s, e, 2, center);
    else if (D == 64) s = bwd_rows8(gy, x, w, mean, rstd, gx, tw, tb, s, e, 8, center);
    else if (D % 8 == 0 && D <= 256) /* bwd_rows8 keeps D / 8 <= 32 sums in registers */
      s = bwd_rows8(gy, x, w, mean, rstd, gx, tw, tb, s, e, D / 8, center);
#endif
    bwd_rows(gy, x, w, mean, rstd, gx, tw, tb, s, e, D, center);
  }
  for (int t = 1; t < used; ++t)
    for (int64_t j = 0; j < D; ++j) {
      gw[j] += gw[t * D + j];
      gb[j] += gb[t * D + j];
    }
}

/* ---------------------------------------------------------------------------------------------
 * RoPE in the rotate-half layout on x [B, T, H, D], tables cos, sin2 [B * T, D] shared by the
 * H heads, h = D / 2, m(j) = (j + h) mod D, sin2 = cat(sin, -sin):
 *   forward        y[j] = x[j] * cos[j] + x[m(j)] * sin2[m(j)]
 *   transposed     y[j] = x[j] * cos[j] + x[m(j)] * sin2[j]     (the backward: R^T g)
 * These are the very products and sums of torch's `x * cos + roll(x * sin2, h)` and of its
 * autograd backward, so without contraction into FMAs (switched off below for gcc; clang
 * contracts only within one expression) the results are bitwise torch's. ATen needs four
 * passes over x and a widened table per head count; this is one.
 * x is read through its strides (b, t, h, d), so a transposed gradient needs no copy; y is
 * written through its strides (b, t, h; d contiguous), so q and k can be written straight
 * into the head-major layout attention's matmuls read.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
static inline void rope_rows(const float *x, int64_t xb, int64_t xt, int64_t xh, int64_t xd,
                             const float *cs, const float *sn, float *y, int64_t yb, int64_t yt,
                             int64_t yh, int64_t s, int64_t e, int64_t T, int64_t H, int64_t D,
                             int transposed) {
  const int64_t h = D / 2;
  int64_t b = s / T, t = s % T; /* row n = b * T + t, stepped on without a division per row */
  for (int64_t n = s; n < e; ++n) {
    const float *c = cs + n * D, *sin2 = sn + n * D;
    /* the sin2 entries multiplying x[i + h] (into y[i]) and x[i] (into y[i + h]) */
    const float *s_lo = transposed ? sin2 : sin2 + h, *s_hi = transposed ? sin2 + h : sin2;
    for (int64_t k = 0; k < H; ++k) {
      const float *r = x + b * xb + t * xt + k * xh;
      float *o = y + b * yb + t * yt + k * yh;
      int64_t i = 0;
#if HAVE_ROWS8
      if (xd == 1) /* eight pairs at a time: the same products and sums, in AVX registers */
        for (; i + 8 <= h; i += 8) {
          __m256 lo = LOAD(r + i), hi = LOAD(r + i + h);
          _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(lo, LOAD(c + i)),
                                                _mm256_mul_ps(hi, LOAD(s_lo + i))));
          _mm256_storeu_ps(o + i + h, _mm256_add_ps(_mm256_mul_ps(hi, LOAD(c + i + h)),
                                                    _mm256_mul_ps(lo, LOAD(s_hi + i))));
        }
#endif
      for (; i < h; ++i) {
        float a = r[i * xd] * c[i];
        float bb = r[(i + h) * xd] * s_lo[i];
        float a2 = r[(i + h) * xd] * c[i + h];
        float b2 = r[i * xd] * s_hi[i];
        o[i] = a + bb;
        o[i + h] = a2 + b2;
      }
    }
    if (++t == T) {
      t = 0;
      ++b;
    }
  }
}

void nl_rope(const float *x, int64_t xb, int64_t xt, int64_t xh, int64_t xd, const float *cs,
             const float *sn, float *y, int64_t yb, int64_t yt, int64_t yh, int64_t B, int64_t T,
             int64_t H, int64_t D, int transposed, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e;
    my_rows(B * T, &s, &e);
    /* contiguous rows get copies with the inner stride (and d_head 16) known, to vectorise */
    if (xd == 1 && D == 16)
      rope_rows(x, xb, xt, xh, 1, cs, sn, y, yb, yt, yh, s, e, T, H, 16, transposed);
    else if (xd == 1) rope_rows(x, xb, xt, xh, 1, cs, sn, y, yb, yt, yh, s, e, T, H, D, transposed);
    else rope_rows(x, xb, xt, xh, xd, cs, sn, y, yb, yt, yh, s, e, T, H, D, transposed);
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
