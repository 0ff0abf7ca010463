/* The block-wise int8 state codec of zero_strategy/engine/lowp.py, one pass per tensor on the CPU.
 *
 * Compiled at run time by zero_strategy/kernels/cpu_codec.py (the system's C compiler, -O3 for the
 * machine it runs on, no fast-math and no floating-point contraction) and called through ctypes.
 * Each function gives exactly the bits of the torch code it stands for (Int8State.decode_range and
 * Int8State.encode_range_): the same fp32 operations (a multiply; a maximum, a divide) in the same
 * order per element, each correctly rounded, and the same integer arithmetic on the same code table
 * ([Note: the code table] in lowp.py). tests/test_lowp_codec.py compares the two on random and
 * adversarial tensors. Only the NaN a block's scale becomes may differ in its bits (torch's vectorised
 * maximum makes its own NaN); the codes do not.
 */
#include <stdint.h>

#define TABLE_SHIFT 14
#define LOW_BITS ((1 << TABLE_SHIFT) - 1)
#define HALF (1 << (31 - TABLE_SHIFT))

/* fp32 bits as int32 and back: a union is C's way to reinterpret, and the loops still vectorise */
typedef union {
    float f;
    int32_t i;
} word_t;

/* Whole blocks (or, for the rounding, chunks of positions) per thread: [lo, hi) of part p of parts. The
 * serial loops stay in functions of their own, outside the OpenMP region, where gcc vectorises them
 * (inside it, it leaves the table lookups scalar). */
static inline void part_bounds(int64_t units, int64_t unit, int64_t n, int p, int parts, int64_t *lo, int64_t *hi) {
    const int64_t per = (units + parts - 1) / parts;
    *lo = p * per * unit < n ? p * per * unit : n;
    *hi = (p + 1) * per * unit < n ? (p + 1) * per * unit : n;
}

/* values[i] = map[codes[i]] * scales[i / block] for i in [0, n): the codes of whole blocks from the
 * range's first one, whose scale is scales[0]. */
static void decode_serial(const uint8_t *restrict codes, const float *restrict scales, const float *restrict map,
                          float *restrict values, int64_t n, int64_t block) {
    for (int64_t lo = 0; lo < n; lo += block) {
        const int64_t len = n - lo < block ? n - lo : block;
        const float scale = scales[lo / block];
        const uint8_t *c = codes + lo;
        float *out = values + lo;
        for (int64_t i = 0; i < len; i++)
            out[i] = map[c[i]] * scale;
    }
}

void zs_int8_decode(const uint8_t *codes, const float *scales, const float *map, float *values, int64_t n,
                    int64_t block, int threads) {
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int p = 0; p < threads; p++) {
        int64_t lo, hi;
        part_bounds(blocks, block, n, p, threads, &lo, &hi);
        if (hi > lo)
            decode_serial(codes + lo, scales + lo / block, map, values + lo, hi - lo, block);
    }
}

/* The codes and scales of x[0, n) (whole blocks from x[0]; the last may be short, as if padded with
 * zeros). scales[b]: the block's largest magnitude (signed map) or largest value (unsigned map), a zero
 * one as +0.0; codes: the table's nearest code of each x over its block's scale (1.0 for a zero scale).
 *
 * The maximum is taken over the bits as int32, which order like the values for everything at or above
 * +0.0 (a magnitude's bits, an unsigned map's values): the same value as torch's maximum, and a loop
 * that vectorises (a float maximum, with its NaN and signed-zero rules, does not). A NaN is found from
 * its bits: above infinity's once the sign bit is cleared. */
static void encode_serial(const float *restrict x, int64_t n, int64_t block, int is_signed,
                          const int32_t *restrict table, float *restrict scales, uint8_t *restrict codes) {
    const word_t *bits = (const word_t *)x;
    for (int64_t lo = 0; lo < n; lo += block) {
        const int64_t len = n - lo < block ? n - lo : block;
        const word_t *v = bits + lo;
        int32_t largest = 0, nan = 0; /* a short block's padding is zeros (+0.0: bits 0) */
        for (int64_t i = 0; i < len; i++) {
            const int32_t magnitude = v[i].i & 0x7FFFFFFF;
            const int32_t key = is_signed ? magnitude : v[i].i; /* -0.0 is below +0.0 as an int32 */
            largest = key > largest ? key : largest;
            nan |= magnitude > 0x7F800000;
        }
        word_t scale = {.i = largest};
        if (nan)
            scale.f = __builtin_nanf("");
        scales[lo / block] = scale.f;
        const float safe = scale.f > 0.0f ? scale.f : 1.0f;
        const float *values = x + lo;
        uint8_t *out = codes + lo;
        for (int64_t i = 0; i < len; i++) {
            word_t normal = {.f = values[i] / safe};
            int32_t key = normal.i;
            if (is_signed)
                key ^= (key >> 31) & 0x7FFFFFFF;
            const int32_t packed = table[(key >> TABLE_SHIFT) + HALF];
            const int32_t above = ((packed >> 8) - (key & LOW_BITS)) >> 31; /* -1: above the bin's midpoint */
            out[i] = (uint8_t)((packed & 0xFF) - above);
        }
    }
}

static int any_negative(const float *restrict x, int64_t n) {
    int negative = 0;
    for (int64_t i = 0; i < n; i++)
        negative |= x[i] < 0.0f;
    return negative;
}

/* Returns 0, or 1 when the map is unsigned and a value is below zero (nothing is written then). */
int zs_int8_encode(const float *x, int64_t n, int64_t block, int is_signed, const int32_t *table, float *scales,
                   uint8_t *codes, int threads) {
    const int64_t blocks = (n + block - 1) / block;
    int negative = 0;
    if (!is_signed) {
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : negative) if (threads > 1)
        for (int p = 0; p < threads; p++) {
            int64_t lo, hi;
            part_bounds(blocks, block, n, p, threads, &lo, &hi);
            negative |= hi > lo && any_negative(x + lo, hi - lo);
        }
    }
    if (negative)
        return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int p = 0; p < threads; p++) {
        int64_t lo, hi;
        part_bounds(blocks, block, n, p, threads, &lo, &hi);
        if (hi > lo)
            encode_serial(x + lo, hi - lo, block, is_signed, table, scales + lo / block, codes + lo);
    }
    return 0;
}

/* bf16 with stochastic rounding ([Note: stochastic rounding] in lowp.py; round_to_bf16 there):
 * out[i] = x[i] rounded to bf16 after adding 16 random bits below its top 16: bits 40...55 of splitmix64
 * of z = i * golden + offset (the caller's offset holds the tensor's first position and the step's base),
 * without splitmix64's last step, which does not change those bits. Where x or the rounded value is not
 * finite, x rounded to nearest even instead (a NaN's bits may differ from torch's NaN). */
static void stochastic_serial(const float *restrict x, int64_t n, uint64_t offset, uint16_t *restrict out) {
    const word_t *bits = (const word_t *)x;
    for (int64_t i = 0; i < n; i++) {
        uint64_t z = (uint64_t)i * 0x9E3779B97F4A7C15ull + offset;
        z ^= z >> 30;
        z *= 0xBF58476D1CE4E5B9ull;
        z ^= z >> 27;
        z *= 0x94D049BB133111EBull;
        const uint32_t random = (uint32_t)(z >> 40) & 0xFFFFu;
        const uint32_t b = (uint32_t)bits[i].i;
        const uint32_t noisy = b + random;
        const uint32_t nearest = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
        const int finite = (b & 0x7F800000u) != 0x7F800000u && (noisy & 0x7F800000u) != 0x7F800000u;
        const int nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
        out[i] = (uint16_t)(finite ? noisy >> 16 : nan ? 0x7FC0u : nearest);
    }
}

void zs_bf16_stochastic(const float *x, int64_t n, uint64_t offset, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int p = 0; p < threads; p++) {
        int64_t lo, hi;
        part_bounds(n, 1, n, p, threads, &lo, &hi);
        if (hi > lo)
            stochastic_serial(x + lo, hi - lo, offset + (uint64_t)lo * 0x9E3779B97F4A7C15ull, out + lo);
    }
}
