/* One-off probe (benchmarks/probes/decode_step_kernel.py); not part of normlab or make bench.
 *
 * A whole cached decoding step of a `pre` decoder in one call: LayerNorm (with bias), q, k and v
 * from one matmul, RoPE (rotate-half), the new key and value written into the cache's buffers,
 * attention over them (native.c's decoding attention, one row at a time), the output
 * projection, LayerNorm, the MLP with exact GELU, both residuals; every block. A step's rows are
 * independent, so each thread takes its own chunks of CH rows through the blocks with no
 * hand-over between ops or threads: block by block, so that a block's weights (192 KiB at the
 * quick grid's size) stay in the core's L2 while the thread's chunks go through, each chunk's
 * activations in L1. No hooks, no checks: the probe asserts the sizes this file assumes (D = H E
 * <= 256, 3 D and M <= MAXW, D and M multiples of 32, E <= 64, n < cap, n + 1 <= ATTN_MAX_KEYS,
 * a bool mask [B, n + 1]) and checks the logits against the model's; greedy decoding's mask
 * lets each new token see itself (its last column), as the model's own mask does.
 *
 * Built by the probe with native.c's first flags (-O3 -march=native -fopenmp), native.c
 * included for its attention row, its exponential, its LayerNorm rows and its thread split.
 */
#include "../../src/normlab/model/native.c"

#define CH 8      /* rows a chunk */
#define MAXW 1024 /* widest activation a row: 3 D and M at most */

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* at any address */

/* C[CH x N] (+)= A[CH x K] @ W[K x N], W row-major, N a multiple of 32: 8 rows x 32 columns of
 * accumulators, one weight row read per k; in registers with AVX-512's 32 (with AVX2's 16 they
 * spill: slower, not wrong) */
static inline void mm(const float *A, int64_t lda, const float *W, int64_t K, int64_t N,
                      float *C, int64_t ldc, int acc_in) {
  for (int64_t n = 0; n < N; n += 32) {
    v16 c0[CH], c1[CH];
    for (int r = 0; r < CH; ++r) {
      if (acc_in) {
        c0[r] = *(const v16 *)(C + r * ldc + n);
        c1[r] = *(const v16 *)(C + r * ldc + n + 16);
      } else {
        c0[r] = (v16){0};
        c1[r] = (v16){0};
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      const v16 w0 = *(const v16 *)(W + k * N + n), w1 = *(const v16 *)(W + k * N + n + 16);
      for (int r = 0; r < CH; ++r) {
        const float a = A[r * lda + k];
        c0[r] += a * w0;
        c1[r] += a * w1;
      }
    }
    for (int r = 0; r < CH; ++r) {
      *(v16 *)(C + r * ldc + n) = c0[r];
      *(v16 *)(C + r * ldc + n + 16) = c1[r];
    }
  }
}

static inline void ln_rows(const float *x, const float *w, const float *b, float *y, int64_t D,
                           float eps) {
  float mean[CH], rstd[CH];
  fwd_part(x, w, b, y, mean, rstd, 0, CH, D, 1, eps, NULL, 0); /* native.c's eight-row path */
}

/* x*cos + roll(x*sin', E/2), as torch_rope (sin' = cat(s, -s)), in place: the two halves */
static inline void rope_row(float *v, const float *c, const float *s, int64_t E) {
  float lo[32], hi[32];
  const int64_t h = E / 2;
  for (int64_t i = 0; i < h; ++i) lo[i] = v[i] * c[i] + v[i + h] * s[i + h];
  for (int64_t i = 0; i < h; ++i) hi[i] = v[i + h] * c[i + h] + v[i] * s[i];
  for (int64_t i = 0; i < h; ++i) {
    v[i] = lo[i];
    v[i + h] = hi[i];
  }
}

/* x [B, D] the step's input, residual stream out; cs, sn [B, E]; per layer l: ln1w/ln1b,
 * wqkv [D, 3D], wo [D, D], ln2w/ln2b, win [D, M], wout [M, D], scale [H], kbuf/vbuf [B, H, cap,
 * E] with positions [0, n) filled (the step writes n); mask [B, n + 1] bytes */
void probe_step(float *x, const float *cs, const float *sn, int64_t L,
                const float *const *ln1w, const float *const *ln1b, const float *const *wqkv,
                const float *const *wo, const float *const *ln2w, const float *const *ln2b,
                const float *const *win, const float *const *wout,
                const float *const *scale, float *const *kbuf, float *const *vbuf,
                int64_t cap, int64_t n, const uint8_t *mask, int64_t B, int64_t D, int64_t H,
                int64_t M, float eps, int nthreads) {
  const int64_t E = D / H, T = n + 1, chunks = (B + CH - 1) / CH;
  /* each thread keeps its own chunks through all the blocks, block by block, so a block's
   * weights stay in its core's L2 while its chunks go through */
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t c0, c1;
    my_rows(chunks, &c0, &c1);
    float xs[CH * 256], h[CH * 256], u[CH * MAXW], z[CH * 256];
    float sc[ATTN_MAX_KEYS + 8];
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b0 = c * CH, rows = B - b0 < CH ? B - b0 : CH;
        memset(xs, 0, sizeof(float) * CH * D);
        memcpy(xs, x + b0 * D, sizeof(float) * rows * D);
        ln_rows(xs, ln1w[l], ln1b[l], h, D, eps);
        mm(h, D, wqkv[l], D, 3 * D, u, 3 * D, 0);
        memset(z, 0, sizeof(float) * CH * D);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t b = b0 + r;
          float *q = u + r * 3 * D, *k = q + D, *v = q + 2 * D;
          for (int64_t hh = 0; hh < H; ++hh) {
            rope_row(q + hh * E, cs + b * E, sn + b * E, E);
            rope_row(k + hh * E, cs + b * E, sn + b * E, E);
            float *kr = kbuf[l] + (b * H + hh) * cap * E, *vr = vbuf[l] + (b * H + hh) * cap * E;
            memcpy(kr + n * E, k + hh * E, sizeof(float) * E);
            memcpy(vr + n * E, v + hh * E, sizeof(float) * E);
#if HAVE_ROWS8
            if (E % 8 == 0) {
              attn1_row8(q + hh * E, kr, E, vr, E, scale[l][hh], mask + b * T, 1,
                         z + r * D + hh * E, sc, T, E / 8);
              continue;
            }
#endif
            attn1_row(q + hh * E, kr, E, vr, E, scale[l][hh], mask + b * T, 1, z + r * D + hh * E,
                      sc, T, E);
          }
        }
        mm(z, D, wo[l], D, D, xs, D, 1);
        ln_rows(xs, ln2w[l], ln2b[l], h, D, eps);
        mm(h, D, win[l], D, M, u, M, 0);
        for (int64_t i = 0; i < CH * M; ++i) {
          float g;
          u[i] *= gelu_cdf(u[i], &g); /* native.c's GELU, without its derivative */
        }
        mm(u, M, wout[l], M, D, xs, D, 1);
        memcpy(x + b0 * D, xs, sizeof(float) * rows * D);
      }
    }
  }
}
