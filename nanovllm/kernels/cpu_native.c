/* The CPU's small per-token ops of a decoder layer, in C: what the torch backend
 * (torch_ops.py, torch_attention.py) computes, each as one call instead of the few to a dozen
 * torch ops (and their dispatch from Python) that a single decode token pays for there.
 * cpu_native.py compiles this file with the system's C compiler on first use and calls it
 * through ctypes. float32 only; each tensor is passed as a pointer and its strides in
 * elements, the innermost dimension contiguous. No function allocates a tensor: outputs are
 * the caller's. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The sums are vector reductions (`omp simd`, compiled with -fopenmp-simd: no OpenMP
 * runtime): a float sum is otherwise one add after another, 4 cycles each. */
static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* e^x in float32 within ~2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for e^r, times 2^n built in the exponent bits), branch-free so that loops over
 * it vectorize: libm's expf is called one value at a time, several times torch's cost. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;  /* not fminf: its NaN rule */
    /* n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer (no floorf: it would not
     * vectorize without -fno-trapping-math) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);  /* 2^n; a bit cast the vectorizer keeps */
    return p * scale;
}

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)) */
static void norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    const float sum = dot(x, x, n);
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

void rms_norm(const float *x, int64_t sx, const float *w, float *out, int64_t so,
              int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * sx, w, out + r * so, n, eps);
}

/* residual[r] += x[r] (in place); out[r] = rms_norm(residual[r]) */
void add_rms_norm(const float *x, int64_t sx, float *res, int64_t sr, const float *w,
                  float *out, int64_t so, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *rr = res + r * sr;
        const float *xr = x + r * sx;
        for (int64_t i = 0; i < n; i++) rr[i] = xr[i] + rr[i];
        norm_row(rr, w, out + r * so, n, eps);
    }
}

/* Neox RoPE of `heads` heads of one token in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
 * after an RMSNorm of each head by `norm_w` (Qwen3's q_norm / k_norm) when given. */
static void rope_heads(float *x, int64_t sh, int64_t heads, const float *cos,
                       const float *sin, int64_t half, const float *norm_w, float eps) {
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * sh;
        if (norm_w) norm_row(xh, norm_w, xh, 2 * half, eps);
        for (int64_t i = 0; i < half; i++) {
            const float x1 = xh[i], x2 = xh[i + half];
            xh[i] = x1 * cos[i] - x2 * sin[i];
            xh[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/* q [T, Hq, D] and k [T, Hk, D] rotated in place by each token's position; cos / sin are
 * [max_position, D / 2] tables (rotary.py) */
void qk_norm_rope(float *q, int64_t sqt, int64_t sqh, float *k, int64_t skt, int64_t skh,
                  const int64_t *positions, const float *cos, const float *sin, int64_t scs,
                  int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t half,
                  const float *q_w, const float *k_w, float eps) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t p = positions[t];
        rope_heads(q + t * sqt, sqh, q_heads, cos + p * scs, sin + p * scs, half, q_w, eps);
        rope_heads(k + t * skt, skh, k_heads, cos + p * scs, sin + p * scs, half, k_w, eps);
    }
}

/* out[t] = silu(x[t, :n]) * x[t, n:] */
void silu_and_mul(const float *x, int64_t sx, float *out, int64_t so, int64_t rows,
                  int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * sx, *up = gate + n;
        float *o = out + r * so;
        for (int64_t i = 0; i < n; i++) o[i] = gate[i] / (1.0f + exp_f32(-gate[i])) * up[i];
    }
}

/* each token's K/V [H, D] into its slot of a contiguous [num_slots, H, D] cache; a negative
 * slot (-1) skips the token. Returns 0, or -2 (writing nothing) if a slot lies past the cache. */
int store_kv(const float *k, int64_t skt, int64_t skh, const float *v, int64_t svt,
             int64_t svh, float *k_cache, float *v_cache, const int64_t *slots,
             int64_t tokens, int64_t heads, int64_t dim, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -2;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        float *kc = k_cache + slots[t] * heads * dim, *vc = v_cache + slots[t] * heads * dim;
        for (int64_t h = 0; h < heads; h++)
            for (int64_t d = 0; d < dim; d++) {
                kc[h * dim + d] = k[t * skt + h * skh + d];
                vc[h * dim + d] = v[t * svt + h * svh + d];
            }
    }
    return 0;
}

/* One query token per row over its context in a paged [blocks, block_size, Hkv, D] cache:
 * row r's query is q[r] [Hq, D], its context the first lens[r] slots of its block table;
 * each K/V head serves its group of Hq / Hkv query heads. softmax(q k^T * scale) v, in
 * float32, into out[r]. Returns 0; -1 if scratch memory could not be had; -2 (reading
 * nothing) if a row's context is longer than its table or the table names a block past the
 * cache's num_blocks. */
int decode_attention(const float *q, int64_t sqt, int64_t sqh, const float *k_cache,
                     const float *v_cache, const int32_t *tables, int64_t st,
                     const int32_t *lens, float *out, int64_t sot, int64_t soh,
                     int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t dim,
                     int64_t block_size, float scale, int64_t table_width,
                     int64_t num_blocks) {
    const int64_t group = q_heads / kv_heads;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (lens[r] < 0 || lens[r] > table_width * block_size) return -2;
        for (int64_t b = 0; b * block_size < lens[r]; b++)
            if (tables[r * st + b] < 0 || tables[r * st + b] >= num_blocks) return -2;
        longest = lens[r] > longest ? lens[r] : longest;
    }
    float *scores = malloc(sizeof(float) * (size_t)(group * longest + group * dim));
    if (!scores) return -1;
    float *qs = scores + group * longest;  /* the group's queries, times scale */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = lens[r];
        const int32_t *table = tables + r * st;
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < dim; d++)
                    qs[g * dim + d] = q[r * sqt + (h * group + g) * sqh + d] * scale;
            /* block by block: a block's positions are consecutive slots */
            for (int64_t start = 0; start < len; start += block_size) {
                const int64_t base = (int64_t)table[start / block_size] * block_size;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t j = 0; j < n; j++) {
                    const float *kr = k_cache + ((base + j) * kv_heads + h) * dim;
                    for (int64_t g = 0; g < group; g++)
                        scores[g * longest + start + j] = dot(qs + g * dim, kr, dim);
                }
            }
            for (int64_t g = 0; g < group; g++) {  /* softmax, the 1 / sum folded in */
                float *sg = scores + g * longest;
                float top = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : top)
                for (int64_t pos = 0; pos < len; pos++) top = sg[pos] > top ? sg[pos] : top;
#pragma omp simd reduction(+ : sum)
                for (int64_t pos = 0; pos < len; pos++) {
                    sg[pos] = exp_f32(sg[pos] - top);
                    sum += sg[pos];
                }
                for (int64_t pos = 0; pos < len; pos++) sg[pos] /= sum;
                float *o = out + r * sot + (h * group + g) * soh;
                for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
            }
            for (int64_t start = 0; start < len; start += block_size) {  /* each V row once */
                const int64_t base = (int64_t)table[start / block_size] * block_size;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t j = 0; j < n; j++) {
                    const float *vr = v_cache + ((base + j) * kv_heads + h) * dim;
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * longest + start + j];
                        float *o = out + r * sot + (h * group + g) * soh;
                        for (int64_t d = 0; d < dim; d++) o[d] += p * vr[d];
                    }
                }
            }
        }
    }
    free(scores);
    return 0;
}
