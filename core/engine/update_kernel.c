/* ipuft's optimizer update in one pass over memory (see ipuft/engine/fused.py). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    float factor, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bias2, eps, floor, decay, step;
} hyper_t;

/* Whole AVX-512 registers for the bfloat16 loop, where the compiler would take half of them (-march=native on some
   CPUs prefers 256 bits): with stochastic rounding 1.6x faster on an AVX-512 Xeon (bench/update.py, 2026-12-07);
   the float32 loop and the 8-bit update's gathers gain nothing from them. */
#if defined(__AVX512F__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE_VECTORS
#endif

enum { W_FLOAT32 = 0, W_BFLOAT16_SR = 1, W_FLOAT16_SR = 2 };

typedef struct {
    int64_t n;
    void *weight;
    int mode;
    const void *grad;
    int grad_mode;                    /* the gradient's dtype: W_FLOAT32, or the 16-bit one of that mode */
    void *m, *v;                      /* float32, or uint8 codes */
    float *m_absmax, *v_absmax;       /* 8-bit: one per block */
    const float *m_values, *v_values; /* 8-bit: the 256 values of each map */
    const uint32_t *m_codes, *v_codes; /* 8-bit: each map's table of buckets (see encode) */
    int64_t block;
    const hyper_t *h;
    uint32_t key;
    int64_t first;                    /* the variable-wide index of element 0, when idx is NULL */
    const int64_t *idx;
    int64_t lo, hi;                   /* this thread's elements */
} job_t;

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x85EBCA6Bu; x ^= x >> 13; x *= 0xC2B2AE35u; return x ^ (x >> 16);
}

/* The rounding's 32 random bits of the element with counter low (its low half) under key, high being the mixed
   high half of its counter (ipuft.precision._hash_). */
static inline uint32_t random_bits(uint32_t low, uint32_t key, uint32_t high) { return mix32(mix32(low ^ key) ^ high); }

static inline uint32_t bits_of(const job_t *j, int64_t i, uint32_t high0) {
    uint64_t index = j->idx ? (uint64_t)j->idx[i] : (uint64_t)(j->first + i);
    uint32_t high = (index >> 32) ? mix32((uint32_t)(index >> 32) ^ j->key ^ 0x9E3779B9u) : high0;
    return random_bits((uint32_t)index, j->key, high);
}

static inline uint32_t as_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }

/* The bits torch's CPU conversion writes for any NaN it makes bfloat16, which depend on its CPU capability (0xFFFF
   with AVX2 and AVX-512, 0x7FC0 in its default build): set once at load by ipuft_set_bf16_nan, so that a NaN weight
   has the ops' bits too. */
static uint16_t bf16_nan = 0x7FC0;

static inline uint16_t nearest_bf16(uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16_nan;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Whether float32 bits u are of a value that sr_bf16 rounds to nearest: the largest, infinities and NaN. */
static inline uint32_t to_nearest(uint32_t u) { return (u & 0x7FFFFFFFu) >= 0x7F7F0000u; }

static inline uint16_t sr_bf16(float x, uint32_t bits) {
    uint32_t u = as_bits(x);
    if (to_nearest(u)) return nearest_bf16(u);  /* the largest, infinities, NaN */
    return (uint16_t)((u + (bits >> 16)) >> 16);
}

static inline uint16_t sr_fp16(float x, uint32_t bits) {
    uint32_t u = as_bits(x), mag = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
    if (mag >= 0x477FE000u) {  /* 65504 and beyond: to nearest */
        if (mag > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((mag >> 13) & 0x3FFu));
        return (uint16_t)(sign | (mag >= 0x477FF000u ? 0x7C00u : 0x7BFFu));
    }
    if (mag >= 0x38800000u || mag == 0) {  /* normal: the integer sum, the dropped bits cleared */
        uint32_t r = ((u + (bits >> 19)) & ~0x1FFFu) & 0x7FFFFFFFu;
        if (!r) return (uint16_t)sign;
        return (uint16_t)(sign | (((r >> 23) - 112u) << 10) | ((r >> 13) & 0x3FFu));
    }
    /* float16's subnormals: the float formulation, in the same float32 operations */
    float a = fabsf(x);
    uint32_t k = (uint32_t)(a * 16777216.0f);
    float low = (float)k * 5.9604644775390625e-08f;
    float p = (a - low) * 16777216.0f;
    float uniform = (float)(bits >> 8) * 5.9604644775390625e-08f;
    if (uniform >= 1.0f - p) k += 1;
    return (uint16_t)(sign | k);
}

/* One element's AdamW: the moments updated in place in *m and *v; returns the new float32 weight. */
static inline float adam(const hyper_t *h, float w, float grad, float *m, float *v) {
    float g = grad * h->factor;
    float mm = *m * h->beta1 + g * h->one_minus_beta1;
    float vv = *v * h->beta2 + (g * g) * h->one_minus_beta2;
    float d = sqrtf(vv < h->floor ? h->floor : vv) / h->sqrt_bias2 + h->eps;
    *m = mm; *v = vv;
    return w * h->decay + (mm / d) * h->step;
}

static inline float bf16_value(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

/* Element i of a float32, bfloat16 or float16 (by mode) tensor, as float32 (exact). */
static inline float load(const void *p, int mode, int64_t i) {
    if (mode == W_FLOAT32) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i], r;
    if (mode == W_BFLOAT16_SR) return bf16_value((uint16_t)u);
    uint32_t sign = (u & 0x8000u) << 16, e = (u >> 10) & 0x1Fu, man = u & 0x3FFu;
    if (e == 0x1F) r = sign | 0x7F800000u | (man << 13);
    else if (e) r = sign | ((e + 112u) << 23) | (man << 13);
    else if (!man) r = sign;
    else { float f = (float)man * 5.9604644775390625e-08f; r = sign | as_bits(f); }
    float f; memcpy(&f, &r, 4); return f;
}

static inline void store_weight(const job_t *j, int64_t i, float w, uint32_t high0) {
    if (j->mode == W_FLOAT32) ((float *)j->weight)[i] = w;
    else if (j->mode == W_BFLOAT16_SR) ((uint16_t *)j->weight)[i] = sr_bf16(w, bits_of(j, i, high0));
    else ((uint16_t *)j->weight)[i] = sr_fp16(w, bits_of(j, i, high0));
}

/* SR_CHUNK weights' float32 bits u rounded stochastically into w by consecutive counters from `low` (their high
   half `high`), `large` if any is to_nearest: sr_bf16 element for element, its branch for those values taken
   only for a chunk that holds one, so that the common chunk is a few integer operations an element (with a
   blend of both branches for every element, bfloat16 + SR ran 15% slower on Zen 3, 2026-12-07; `large` is
   found in the caller's loop, which computes u: in a loop of its own here, 10% slower). 64 a chunk: the test of
   `large` reduces a vector to one word, which for chunks of 16 took a fifth of the loop's time on Zen 4 (64: 0.83x
   the time of 16 there, with AVX-512 and without; 32: 0.74-0.85x with it, 0.95x without; 2026-12-07). */
#define SR_CHUNK 64
__attribute__((always_inline)) static inline void sr_bf16_chunk(uint16_t *restrict w, const uint32_t *restrict u,
                                                                uint32_t large, uint32_t low, uint32_t key,
                                                                uint32_t high) {
    if (large) {
        for (int k = 0; k < SR_CHUNK; k++) {
            float x; memcpy(&x, &u[k], 4);
            w[k] = sr_bf16(x, random_bits(low + (uint32_t)k, key, high));
        }
    } else {
        for (int k = 0; k < SR_CHUNK; k++)
            w[k] = (uint16_t)((u[k] + (random_bits(low + (uint32_t)k, key, high) >> 16)) >> 16);
    }
}

/* Whether this thread's counters run from j->first + j->lo without an index tensor and within one span of 2^32
   (so bits_of's high half is one value, put in *high). */
static inline int consecutive_high(const job_t *j, uint32_t high0, uint32_t *high) {
    if (j->idx || j->hi <= j->lo) return 0;
    uint64_t a = (uint64_t)(j->first + j->lo), b = (uint64_t)(j->first + j->hi - 1);
    if ((a >> 32) != (b >> 32)) return 0;
    *high = (a >> 32) ? mix32((uint32_t)(a >> 32) ^ j->key ^ 0x9E3779B9u) : high0;
    return 1;
}

/* float32 weights, written plainly (restrict and not inlined: no aliasing check) so that it vectorises */
__attribute__((noinline)) static void adam_float32(const hyper_t *restrict hp, float *restrict w,
                                                   const float *restrict grad, float *restrict m, float *restrict v,
                                                   int64_t count) {
    const hyper_t h = *hp;
    for (int64_t i = 0; i < count; i++) w[i] = adam(&h, w[i], grad[i], m + i, v + i);
}

/* bfloat16 weights, counters from `first` within one 2^32 span (their high half `high`), the gradient of
   grad_mode (a constant where it is inlined): the branches hoisted, so that it vectorises (the same arithmetic and
   bits as adamw_range's general loop). */
__attribute__((always_inline)) static inline void adamw_bf16_loop(const job_t *j, const hyper_t *hp, int grad_mode,
                                                                  uint32_t high) {
    const hyper_t h = *hp;
    float *m = j->m, *v = j->v;
    uint16_t *w = j->weight;
    const void *grad = j->grad;
    uint32_t low = (uint32_t)(j->first + j->lo), key = j->key;
    int64_t i = j->lo;
    for (; i + SR_CHUNK <= j->hi; i += SR_CHUNK, low += SR_CHUNK) {
        uint32_t u[SR_CHUNK], large = 0;
        for (int k = 0; k < SR_CHUNK; k++) {
            u[k] = as_bits(adam(&h, bf16_value(w[i + k]), load(grad, grad_mode, i + k), m + i + k, v + i + k));
            large |= to_nearest(u[k]);
        }
        sr_bf16_chunk(w + i, u, large, low, key, high);
    }
    for (; i < j->hi; i++, low++)
        w[i] = sr_bf16(adam(&h, bf16_value(w[i]), load(grad, grad_mode, i), m + i, v + i), random_bits(low, key, high));
}

/* adamw_bf16_loop for a float32 or a bfloat16 gradient; not inlined, which would drop its vector width. */
WIDE_VECTORS __attribute__((noinline)) static void adamw_bf16_consecutive(const job_t *j, const hyper_t *hp,
                                                                          uint32_t high) {
    if (j->grad_mode == W_FLOAT32) adamw_bf16_loop(j, hp, W_FLOAT32, high);
    else adamw_bf16_loop(j, hp, W_BFLOAT16_SR, high);
}

static void *adamw_range(void *arg) {
    const job_t *j = arg;
    const hyper_t h = *j->h;
    uint32_t high0 = mix32(j->key ^ 0x9E3779B9u);
    float *m = j->m, *v = j->v;
    if (j->mode == W_FLOAT32 && j->grad_mode == W_FLOAT32) {
        adam_float32(&h, (float *)j->weight + j->lo, (const float *)j->grad + j->lo, m + j->lo, v + j->lo,
                     j->hi - j->lo);
        return NULL;
    }
    uint32_t high;
    if (j->mode == W_BFLOAT16_SR && consecutive_high(j, high0, &high)) {
        adamw_bf16_consecutive(j, &h, high);
        return NULL;
    }
    for (int64_t i = j->lo; i < j->hi; i++) {
        float w = adam(&h, load(j->weight, j->mode, i), load(j->grad, j->grad_mode, i), m + i, v + i);
        store_weight(j, i, w, high0);
    }
    return NULL;
}

/* A normalized value's 8-bit code: the number of its map's 255 bounds below it (the nearest value's index), found
   in a table over the float32 *buckets* (the floats that share their top 17 bits: sign, exponent and 8 bits of
   mantissa), read by the float's bits shifted right by 15, a word each: the bounds below the bucket shifted left by
   15, plus 0x7FFF less the low 15 bits of the one bound inside it (mirrored in negative buckets, where a larger
   value has smaller bits; 0 if none), so that the float's own low 15 bits carry into bit 15 exactly when it lies
   above that bound (see code_words in ipuft_optim_adamw8bit/quantize.py). Every float32, NaN and +-inf included,
   gets the torch ops' code. Branch-free: one read by a shift of the bits. The table is 512 KiB, but a block's
   values read only the kilobyte of each exponent they have; a table of only the buckets from 2^-23 to 1 (46 KiB)
   took 9 operations to clamp the index, and its encoding 1.23x the time on Zen 3 (2026-12-07). */
static inline uint8_t encode(uint32_t bits, const uint32_t *table) {
    uint32_t neg = (uint32_t)((int32_t)bits >> 31);
    return (uint8_t)((table[bits >> 15] + ((bits ^ neg) & 0x7FFFu)) >> 15);
}

/* The hand-written encoding: x86-64 with AVX2 (and AVX-512, where GCC 12 no longer makes gathers of the loop below
   once its index is this simple, and where zmm gathers of the same table took 1.09-1.13x the time of the 8-bit
   update with these pair reads on Zen 4, 2026-12-07; Intel's Downfall microcode slows gathers further). */
#if defined(__AVX2__) && defined(__x86_64__)
#define AVX2_ENCODE 1
#include <immintrin.h>
/* encode of the 8 floats at `at`. AVX2's gather of 8 words costs more than 8 scalar reads on Zen 3, and moving
   indices from a vector into general registers takes 3 of their 5 operations a float: the indices come from the
   bits read as 4 pairs into general registers instead, and only the words' inserts use the vector units (a block's
   encoding in 0.59x the time of an index vector's extracts, Zen 3, 2026-12-07). */
static inline __m256i encode8x(const uint32_t *at, const uint32_t *table) {
    __m128i w[4];
    for (int q = 0; q < 4; q++) {
        uint64_t pair;  /* one 8-byte read each (a 32-byte copy would go through a vector and the stack) */
        memcpy(&pair, at + 2 * q, 8);
        w[q] = _mm_insert_epi32(_mm_cvtsi32_si128((int)table[(uint32_t)pair >> 15]), (int)table[pair >> 47], 1);
    }
    __m256i word = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi64(w[0], w[1])),
                                           _mm_unpacklo_epi64(w[2], w[3]), 1);
    __m256i bits = _mm256_loadu_si256((const __m256i *)at);
    __m256i own = _mm256_and_si256(_mm256_xor_si256(bits, _mm256_srai_epi32(bits, 31)), _mm256_set1_epi32(0x7FFF));
    return _mm256_srli_epi32(_mm256_add_epi32(word, own), 15);
}
#endif

/* The codes of count floats given by their bits (restrict and not inlined: the stores alias nothing, so it
   vectorises). */
__attribute__((noinline)) static void encode_block(const uint32_t *restrict bits, const uint32_t *restrict table,
                                                   uint8_t *restrict codes, int64_t count) {
    int64_t k = 0;
#ifdef AVX2_ENCODE
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* undoes the packs' lane interleaving */
    for (; k + 32 <= count; k += 32) {
        const uint32_t *at = bits + k;
        __m256i c01 = _mm256_packus_epi32(encode8x(at, table), encode8x(at + 8, table));
        __m256i c23 = _mm256_packus_epi32(encode8x(at + 16, table), encode8x(at + 24, table));
        __m256i packed = _mm256_packus_epi16(c01, c23);
        _mm256_storeu_si256((__m256i *)(codes + k), _mm256_permutevar8x32_epi32(packed, order));
    }
#endif
    for (; k < count; k++) codes[k] = encode(bits[k], table);
}

#define MAX_BLOCK 4096

/* A block's moments decoded from their codes. With AVX-512 VBMI (Ice Lake, Zen 4 and later): a pass of byte
   permutes, a map's 256 values held as 4 planes of bytes (vpermi2b reads 128 of a plane's bytes by each code's low
   7 bits, its top bit picks the half), then unpacked into floats: 64 codes in 27 instructions, where the table
   reads that the compiler makes of values[code] are 5 an element (the 8-bit update in 0.88x the time with float32
   weights, 0.82x with bfloat16 + SR, Zen 4, 2026-12-07); the update's loop then reads the floats. Elsewhere the
   update's loop reads the table itself (as a pass of its own it cost more than it saved on Zen 3). */
#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__x86_64__)
#define BYTE_DECODE 1
#include <immintrin.h>
typedef struct { uint8_t plane[4][256]; } planes_t;  /* plane q: byte q of each value */

static void value_planes(const float *values, planes_t *out) {
    for (int k = 0; k < 256; k++)
        for (int q = 0; q < 4; q++) out->plane[q][k] = (uint8_t)(as_bits(values[k]) >> (8 * q));
}

__attribute__((noinline)) static void decode_block(const uint8_t *restrict codes, const planes_t *restrict p,
                                                   const float *restrict values, float *restrict out, int64_t count) {
    /* the codes' groups of 4 transposed, so that the unpacks below (within 128-bit lanes) leave the values in order */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    int64_t k = 0;
    for (; k + 64 <= count; k += 64) {
        __m512i c = _mm512_permutexvar_epi32(order, _mm512_loadu_si512(codes + k)), b[4];
        __mmask64 upper = _mm512_movepi8_mask(c);  /* codes 128 to 255 */
        for (int q = 0; q < 4; q++) {
            const __m512i *t = (const __m512i *)p->plane[q];
            __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t), c, _mm512_loadu_si512(t + 1));
            __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(t + 2), c, _mm512_loadu_si512(t + 3));
            b[q] = _mm512_mask_blend_epi8(upper, lo, hi);
        }
        __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
        __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
        _mm512_storeu_si512(out + k, _mm512_unpacklo_epi16(lo01, lo23));
        _mm512_storeu_si512(out + k + 16, _mm512_unpackhi_epi16(lo01, lo23));
        _mm512_storeu_si512(out + k + 32, _mm512_unpacklo_epi16(hi01, hi23));
        _mm512_storeu_si512(out + k + 48, _mm512_unpackhi_epi16(hi01, hi23));
    }
    for (; k < count; k++) out[k] = values[codes[k]];
}
#define DECODED(decoded, codes, values, k) (decoded)[k]
#else
#define DECODED(decoded, codes, values, k) (values)[(codes)[k]]
#endif

/* The larger of `most` and |x|'s bits: the block's absmax as the largest bit pattern of a non-negative float (which
   orders as the floats do, and puts any NaN above +inf: NaN propagates, as amax does); an integer maximum
   vectorises where a float one that keeps NaN does not. */
static inline uint32_t larger_bits(uint32_t most, float x) {
    uint32_t a = as_bits(x) & 0x7FFFFFFFu;
    return a > most ? a : most;
}

/* A block of float32 weights: its moments decoded and updated into m and v, the largest bits of |m| and v into
   most (restrict and not inlined, so that it vectorises). */
__attribute__((noinline)) static void adam8_float32(const hyper_t *restrict hp, float *restrict w,
                                                    const float *restrict grad, const uint8_t *restrict mi,
                                                    const uint8_t *restrict vi, const float *restrict m_values,
                                                    const float *restrict v_values, float ms, float vs,
                                                    float *restrict m, float *restrict v, uint32_t *restrict most,
                                                    int64_t count) {
    const hyper_t h = *hp;
    uint32_t mbits = 0, vbits = 0;
    for (int64_t k = 0; k < count; k++) {
        float mk = DECODED(m, mi, m_values, k) * ms, vk = DECODED(v, vi, v_values, k) * vs;
        w[k] = adam(&h, w[k], grad[k], &mk, &vk);
        m[k] = mk; v[k] = vk;
        mbits = larger_bits(mbits, mk);
        vbits = larger_bits(vbits, vk);
    }
    most[0] = mbits; most[1] = vbits;
}

/* adam8_float32 for bfloat16 weights rounded stochastically by consecutive counters from `low` (within one 2^32
   span, their high half `high`), with a float32 or bfloat16 gradient (grad_mode, a constant where it is inlined:
   a select between two loads in the loop is control flow that AVX2, without masked loads, does not vectorise):
   the general loop's arithmetic and bits, rounded in chunks (sr_bf16_chunk: 0.91x the time of rounding each
   element by sr_bf16 on Zen 4, with AVX-512 and without, 2026-12-07; chunks of 16 had been 1.13x on Zen 3). */
__attribute__((always_inline)) static inline void adam8_bf16_loop(
    const hyper_t *restrict hp, uint16_t *restrict w, const void *restrict grad, int grad_mode,
    const uint8_t *restrict mi, const uint8_t *restrict vi, const float *restrict m_values,
    const float *restrict v_values, float ms, float vs, float *restrict m, float *restrict v, uint32_t *restrict most,
    int64_t count, uint32_t low, uint32_t key, uint32_t high) {
    const hyper_t h = *hp;
    uint32_t mbits = 0, vbits = 0;
    const float *g32 = grad;
    const uint16_t *g16 = grad;
    int64_t k = 0;
    for (; k + SR_CHUNK <= count; k += SR_CHUNK) {
        uint32_t u[SR_CHUNK], large = 0;
        for (int c = 0; c < SR_CHUNK; c++) {
            int64_t i = k + c;
            float mk = DECODED(m, mi, m_values, i) * ms, vk = DECODED(v, vi, v_values, i) * vs;
            float g = grad_mode == W_FLOAT32 ? g32[i] : bf16_value(g16[i]);
            u[c] = as_bits(adam(&h, bf16_value(w[i]), g, &mk, &vk));
            large |= to_nearest(u[c]);
            m[i] = mk; v[i] = vk;
            mbits = larger_bits(mbits, mk);
            vbits = larger_bits(vbits, vk);
        }
        sr_bf16_chunk(w + k, u, large, low + (uint32_t)k, key, high);
    }
    for (; k < count; k++) {
        float mk = DECODED(m, mi, m_values, k) * ms, vk = DECODED(v, vi, v_values, k) * vs;
        float g = grad_mode == W_FLOAT32 ? g32[k] : bf16_value(g16[k]);
        w[k] = sr_bf16(adam(&h, bf16_value(w[k]), g, &mk, &vk), random_bits(low + (uint32_t)k, key, high));
        m[k] = mk; v[k] = vk;
        mbits = larger_bits(mbits, mk);
        vbits = larger_bits(vbits, vk);
    }
    most[0] = mbits; most[1] = vbits;
}

__attribute__((noinline)) static void adam8_bf16(const hyper_t *restrict hp, uint16_t *restrict w,
                                                 const void *restrict grad, int grad_mode, const uint8_t *restrict mi,
                                                 const uint8_t *restrict vi, const float *restrict m_values,
                                                 const float *restrict v_values, float ms, float vs,
                                                 float *restrict m, float *restrict v, uint32_t *restrict most,
                                                 int64_t count, uint32_t low, uint32_t key, uint32_t high) {
    if (grad_mode == W_FLOAT32)
        adam8_bf16_loop(hp, w, grad, W_FLOAT32, mi, vi, m_values, v_values, ms, vs, m, v, most, count, low, key, high);
    else
        adam8_bf16_loop(hp, w, grad, W_BFLOAT16_SR, mi, vi, m_values, v_values, ms, vs, m, v, most, count, low, key,
                        high);
}

static void *adamw8bit_range(void *arg) {
    const job_t *j = arg;
    const hyper_t h = *j->h;
    uint32_t high0 = mix32(j->key ^ 0x9E3779B9u);
    uint8_t *mc = j->m, *vc = j->v;
    union { float f[MAX_BLOCK]; uint32_t u[MAX_BLOCK]; } mb, vb;  /* a block's moments, read as bits to encode */
    float *m = mb.f, *v = vb.f;
    uint32_t high;
    int bf16_consecutive = j->mode == W_BFLOAT16_SR && consecutive_high(j, high0, &high);
#ifdef BYTE_DECODE
    planes_t mp, vp;
    value_planes(j->m_values, &mp);
    value_planes(j->v_values, &vp);
#endif
    for (int64_t start = j->lo; start < j->hi; start += j->block) {
        int64_t b = start / j->block, count = j->hi - start < j->block ? j->hi - start : j->block;
        float ms = j->m_absmax[b], vs = j->v_absmax[b], mmax, vmax;
        uint32_t most[2] = {0, 0};  /* the bits of the largest |m| and v (larger_bits; v is >= 0 or NaN) */
#ifdef BYTE_DECODE
        decode_block(mc + start, &mp, j->m_values, m, count);
        decode_block(vc + start, &vp, j->v_values, v, count);
#endif
        if (j->mode == W_FLOAT32 && j->grad_mode == W_FLOAT32) {  /* float32 weights: one loop that vectorises */
            adam8_float32(&h, (float *)j->weight + start, (const float *)j->grad + start, mc + start, vc + start,
                          j->m_values, j->v_values, ms, vs, m, v, most, count);
        } else if (bf16_consecutive) {
            adam8_bf16(&h, (uint16_t *)j->weight + start,
                       j->grad_mode == W_FLOAT32 ? (const void *)((const float *)j->grad + start)
                                                 : (const void *)((const uint16_t *)j->grad + start),
                       j->grad_mode, mc + start, vc + start, j->m_values, j->v_values, ms, vs, m, v, most, count,
                       (uint32_t)(j->first + start), j->key, high);
        } else {
            for (int64_t k = 0; k < count; k++) {
                int64_t i = start + k;
                float mk = DECODED(m, mc + start, j->m_values, k) * ms;
                float vk = DECODED(v, vc + start, j->v_values, k) * vs;
                float w = adam(&h, load(j->weight, j->mode, i), load(j->grad, j->grad_mode, i), &mk, &vk);
                store_weight(j, i, w, high0);
                m[k] = mk; v[k] = vk;
                most[0] = larger_bits(most[0], mk);
                most[1] = larger_bits(most[1], vk);
            }
        }
        memcpy(&mmax, &most[0], 4); memcpy(&vmax, &most[1], 4);
        j->m_absmax[b] = mmax; j->v_absmax[b] = vmax;
        float md = mmax > 0 ? mmax : 1.0f, vd = vmax > 0 ? vmax : 1.0f;
        for (int64_t k = 0; k < count; k++) { m[k] /= md; v[k] /= vd; }
        encode_block(mb.u, j->m_codes, mc + start, count);
        encode_block(vb.u, j->v_codes, vc + start, count);
    }
    return NULL;
}

/* Run fn over job's n elements in `threads` ranges, each a multiple of `unit` elements long but the last.
   Built with OpenMP, the ranges run on the process's OpenMP threads: torch's own (its libgomp.so.1, loaded
   first, is the one this library's calls bind to), which otherwise spin for milliseconds after each torch op and
   take the cores from threads of our own (on 2 cores, a [4096, 4096] float32 update ran at 1.6x torch's fused
   AdamW beside them and at 1.0x with OMP_WAIT_POLICY=PASSIVE). Without OpenMP, threads of our own. */
static int run(job_t *job, int threads, int64_t unit, void *(*fn)(void *)) {
    enum { MAX_THREADS = 256 };
    job_t jobs[MAX_THREADS];
    int64_t units = (job->n + unit - 1) / unit;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = (int)units;
    if (threads < 1) threads = 1;
    for (int t = 0; t < threads; t++) {
        jobs[t] = *job;
        jobs[t].lo = units * t / threads * unit;
        jobs[t].hi = units * (t + 1) / threads * unit;
        if (jobs[t].hi > job->n) jobs[t].hi = job->n;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) fn(&jobs[t]);
#else
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, fn, &jobs[t])) break;
        started = t;
    }
    for (int t = started + 1; t < threads; t++) fn(&jobs[t]);  /* threads that could not start */
    fn(&jobs[0]);
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
#endif
    return 0;
}

/* Whether the ranges run on OpenMP's threads (1) or threads of our own (0). */
int ipuft_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The bits of a bfloat16 NaN (see bf16_nan); called before any update. */
int ipuft_set_bf16_nan(uint32_t bits) {
    bf16_nan = (uint16_t)bits;
    return 0;
}

int ipuft_adamw(int64_t n, void *weight, int mode, const void *grad, int grad_mode, float *m, float *v,
                const hyper_t *h, uint32_t key, int64_t first, const int64_t *idx, int threads, int64_t grain) {
    job_t job = {.n = n, .weight = weight, .mode = mode, .grad = grad, .grad_mode = grad_mode, .m = m, .v = v,
                 .h = h, .key = key, .first = first, .idx = idx, .lo = 0, .hi = n};
    return run(&job, threads, grain, adamw_range);
}

/* The codes of n normalized floats by a map's table, as the 8-bit update encodes a block's (for tests). */
int ipuft_encode8(int64_t n, const float *x, uint8_t *codes, const uint32_t *table) {
    uint32_t bits[MAX_BLOCK];
    for (int64_t start = 0; start < n; start += MAX_BLOCK) {
        int64_t count = n - start < MAX_BLOCK ? n - start : MAX_BLOCK;
        memcpy(bits, x + start, (size_t)count * 4);
        encode_block(bits, table, codes + start, count);
    }
    return 0;
}

int ipuft_adamw8bit(int64_t n, void *weight, int mode, const void *grad, int grad_mode, uint8_t *m, uint8_t *v,
                    float *m_absmax, float *v_absmax, const float *m_values, const float *v_values,
                    const uint32_t *m_codes, const uint32_t *v_codes, int64_t block, const hyper_t *h,
                    uint32_t key, int64_t first, const int64_t *idx, int threads, int64_t grain) {
    if (block > MAX_BLOCK || block < 1) return -1;
    job_t job = {.n = n, .weight = weight, .mode = mode, .grad = grad, .grad_mode = grad_mode, .m = m, .v = v,
                 .m_absmax = m_absmax, .v_absmax = v_absmax, .m_values = m_values, .v_values = v_values,
                 .m_codes = m_codes, .v_codes = v_codes, .block = block, .h = h, .key = key,
                 .first = first, .idx = idx, .lo = 0, .hi = n};
    return run(&job, threads, grain < block ? block : grain / block * block, adamw8bit_range);
}
