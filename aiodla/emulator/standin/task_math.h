/* The arithmetic of one emulator-loadable task, shared by the GPU kernel and the host.
 *
 * Everything here is __host__ __device__ so the very same code runs in the stand-in's
 * kernel and in aiodlaStandinRunOnHost, which CI compares with the emulated runtime's
 * bytes on machines without a GPU. The rules are aiodla/emulator/_format.py's:
 *
 * - stored values are read as IEEE binary64 (exact for every element type);
 * - affine:  y = (scale * x) + bias, two roundings, never a fused multiply-add;
 * - mean_hw: s = x[0,0] + x[0,1] + ... in row-major (h, then w) order, sequentially;
 *            m = s / (h * w); y = (scale * m) + bias;
 * - float outputs round to nearest even straight from binary64 (never via float32 for
 *   half, which would round twice); integer outputs rint (half to even), saturate, and
 *   store 0 for NaN;
 * - mix: a digest of every input element's bits (an order-free uint64 sum, so any
 *   split of the work gives the same number), then per output element a SplitMix64
 *   draw whose top 16 bits pick its value; see mix_partial_sum and mix_store;
 * - detect: mix's digest over the input elements on an 8 x 8 grid of (h, w), then raw
 *   detector heads with a few objects each: per cell one draw decides whether it holds
 *   an object and what, and input 0 whether the cell lies in the picture (detect_store);
 * - element (n, c, h, w) lives at n*s3 + (c/L)*s2 + h*s1 + w*s0 + (c%L)*E, and every
 *   byte of an output buffer is written: padding lanes, rows, surfaces and tail are 0.
 *
 * The sum starts from the first element rather than from +0.0: that is what numpy's
 * cumsum in aiodla/emulator/_ops.py does, and it differs from "0.0 + ..." only in the
 * sign of an all-negative-zero sum.
 *
 * Elements are read and written byte by byte: strides are byte counts that need not be
 * multiples of the element size, and a misaligned wide access would be a sticky CUDA
 * error that kills the whole process's context.
 */
#ifndef AIODLA_STANDIN_TASK_MATH_H
#define AIODLA_STANDIN_TASK_MATH_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef __CUDACC__
#define AIODLA_HD __host__ __device__
#else
#define AIODLA_HD
#endif

namespace aiodla_standin {

constexpr uint32_t kMaxPairs = 64;
constexpr uint32_t kOpAffine = 1;
constexpr uint32_t kOpMeanHw = 2;
constexpr uint32_t kOpMix = 3;
constexpr uint32_t kOpDetect = 4; /* mix's digest, then detector heads (emulator/_detector.py) */

/* cudla.h dataType values. */
constexpr uint32_t kTypeFloat = 1;
constexpr uint32_t kTypeHalf = 2;
constexpr uint32_t kTypeInt16 = 3;
constexpr uint32_t kTypeInt8 = 4;
constexpr uint32_t kTypeUint8 = 5;
constexpr uint32_t kTypeUint16 = 6;

/* One tensor's layout, already validated by the loadable parser. */
struct TensorLayout {
    uint64_t size;  /* bytes of the buffer the layout spans, tail included */
    uint32_t n, c, h, w;
    uint32_t pixel, line, surface, batch;  /* stride[0..3] in bytes */
    uint32_t lanes;                        /* pixel / esize */
    uint32_t type;                         /* cudla dataType */
    uint32_t esize;                        /* element size in bytes */
    uint32_t reserved;
};

/* What the kernel needs of a module: lives in device memory while the module is loaded. */
struct ModuleTable {
    uint32_t op;
    uint32_t num_inputs;  /* affine and mean_hw: equal to num_outputs (pair i) */
    uint32_t num_outputs;
    uint32_t reserved;
    double scale;
    double bias;
    TensorLayout inputs[kMaxPairs];
    TensorLayout outputs[kMaxPairs];
};

AIODLA_HD inline uint64_t element_offset(const TensorLayout& t, uint64_t n, uint64_t c,
                                         uint64_t h, uint64_t w) {
    return n * t.batch + (c / t.lanes) * t.surface + h * t.line + w * t.pixel +
           (c % t.lanes) * t.esize;
}

AIODLA_HD inline double dmul(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;  /* built with -ffp-contract=off, so never fused */
#endif
}

AIODLA_HD inline double dadd(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}

AIODLA_HD inline double ddiv(double a, double b) {
#ifdef __CUDA_ARCH__
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}

/* Bit casts, one per type and direction, spelled out on purpose: std::bit_cast is not
 * usable in device code with every nvcc this builds with, and memcpy is what both the
 * host compiler and nvcc turn into a plain register move. */
AIODLA_HD inline uint64_t double_bits(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

AIODLA_HD inline double bits_double(uint64_t bits) {
    double x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

AIODLA_HD inline float bits_float(uint32_t bits) {
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

AIODLA_HD inline uint32_t float_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

/* IEEE binary16 bits to binary64, exactly. */
AIODLA_HD inline double half_to_double(uint16_t h) {
    const uint64_t sign = static_cast<uint64_t>(h >> 15) << 63;
    const uint32_t exponent = (h >> 10) & 0x1f;
    const uint64_t mantissa = h & 0x3ff;
    if (exponent == 0x1f) {  /* inf or NaN: keep the payload's top bits, as numpy does */
        return bits_double(sign | (0x7ffull << 52) | (mantissa << 42));
    }
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24, exact in binary64 */
        const double magnitude = static_cast<double>(mantissa) * 5.9604644775390625e-08;
        return sign ? -magnitude : magnitude;
    }
    return bits_double(sign | (static_cast<uint64_t>(exponent - 15 + 1023) << 52) |
                       (mantissa << 42));
}

/* binary64 to binary16 bits, one rounding to nearest even (no detour through float). */
AIODLA_HD inline uint16_t double_to_half(double x) {
    const uint64_t bits = double_bits(x);
    const uint16_t sign = static_cast<uint16_t>((bits >> 48) & 0x8000);
    const uint32_t exponent = static_cast<uint32_t>((bits >> 52) & 0x7ff);
    const uint64_t mantissa = bits & ((1ull << 52) - 1);
    if (exponent == 0x7ff) {
        if (mantissa == 0) return sign | 0x7c00;
        /* NaN: keep the payload's top bits and never let it become inf (numpy's rule). */
        const uint16_t payload = static_cast<uint16_t>(mantissa >> 42);
        return sign | 0x7c00 | (payload ? payload : 1);
    }
    if (exponent == 0) return sign;  /* zero or binary64 subnormal: far below half's range */
    const int e = static_cast<int>(exponent) - 1023;
    if (e > 15) return sign | 0x7c00;
    if (e >= -14) {
        uint64_t kept = mantissa >> 42;
        const uint64_t rest = mantissa & ((1ull << 42) - 1);
        const uint64_t halfway = 1ull << 41;
        if (rest > halfway || (rest == halfway && (kept & 1))) kept += 1;
        /* A carry out of the mantissa bumps the exponent, reaching inf exactly at 65520. */
        return sign | static_cast<uint16_t>((static_cast<uint64_t>(e + 15) << 10) + kept);
    }
    /* Half subnormal: the value is m * 2^(e-52) with m the 53-bit significand, and the
     * result counts units of 2^-24, so shift m right by 28 - e (>= 43) bits. */
    const uint64_t significand = mantissa | (1ull << 52);
    const int shift = 28 - e;
    if (shift > 53) return sign;  /* below half the smallest subnormal */
    uint64_t kept = significand >> shift;
    const uint64_t rest = significand & ((1ull << shift) - 1);
    const uint64_t halfway = 1ull << (shift - 1);
    if (rest > halfway || (rest == halfway && (kept & 1))) kept += 1;
    return sign | static_cast<uint16_t>(kept);  /* kept == 0x400 is the smallest normal */
}

AIODLA_HD inline float double_to_float(double x) {
#ifdef __CUDA_ARCH__
    return __double2float_rn(x);
#else
    return static_cast<float>(x);
#endif
}

AIODLA_HD inline double round_half_even(double x) {
    return rint(x);
}

/* Little-endian bytes at p, element type `type`, to binary64. */
AIODLA_HD inline double load_element(const uint8_t* p, uint32_t type) {
    switch (type) {
        case kTypeFloat: {
            const uint32_t bits = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                                  (static_cast<uint32_t>(p[2]) << 16) |
                                  (static_cast<uint32_t>(p[3]) << 24);
            return static_cast<double>(bits_float(bits));
        }
        case kTypeHalf:
            return half_to_double(static_cast<uint16_t>(p[0] | (p[1] << 8)));
        case kTypeInt16:
            return static_cast<double>(static_cast<int16_t>(static_cast<uint16_t>(p[0] | (p[1] << 8))));
        case kTypeInt8:
            return static_cast<double>(static_cast<int8_t>(p[0]));
        case kTypeUint8:
            return static_cast<double>(p[0]);
        default: /* kTypeUint16 */
            return static_cast<double>(static_cast<uint16_t>(p[0] | (p[1] << 8)));
    }
}

AIODLA_HD inline int64_t saturate(double x, double low, double high) {
    if (x != x) return 0;  /* NaN stores 0 */
    const double r = round_half_even(x);
    if (r <= low) return static_cast<int64_t>(low);
    if (r >= high) return static_cast<int64_t>(high);
    return static_cast<int64_t>(r);
}

/* binary64 to the element type's bytes at p, by the format's rounding rules. */
AIODLA_HD inline void store_element(uint8_t* p, uint32_t type, double y) {
    switch (type) {
        case kTypeFloat: {
            const uint32_t bits = float_bits(double_to_float(y));
            p[0] = static_cast<uint8_t>(bits);
            p[1] = static_cast<uint8_t>(bits >> 8);
            p[2] = static_cast<uint8_t>(bits >> 16);
            p[3] = static_cast<uint8_t>(bits >> 24);
            return;
        }
        case kTypeHalf: {
            const uint16_t bits = double_to_half(y);
            p[0] = static_cast<uint8_t>(bits);
            p[1] = static_cast<uint8_t>(bits >> 8);
            return;
        }
        case kTypeInt16: {
            const uint16_t v = static_cast<uint16_t>(static_cast<int16_t>(saturate(y, -32768.0, 32767.0)));
            p[0] = static_cast<uint8_t>(v);
            p[1] = static_cast<uint8_t>(v >> 8);
            return;
        }
        case kTypeInt8:
            p[0] = static_cast<uint8_t>(static_cast<int8_t>(saturate(y, -128.0, 127.0)));
            return;
        case kTypeUint8:
            p[0] = static_cast<uint8_t>(saturate(y, 0.0, 255.0));
            return;
        default: { /* kTypeUint16 */
            const uint16_t v = static_cast<uint16_t>(saturate(y, 0.0, 65535.0));
            p[0] = static_cast<uint8_t>(v);
            p[1] = static_cast<uint8_t>(v >> 8);
            return;
        }
    }
}

/* Zero the whole output buffer; worker `index` of `count` takes every count-th chunk.
 * Registered buffers are 32-byte aligned, so 16-byte stores are safe for the body. */
AIODLA_HD inline void zero_buffer(uint8_t* out, uint64_t size, uint32_t index, uint32_t count) {
    const uint64_t chunks = size / 16;
    const bool aligned = (reinterpret_cast<uintptr_t>(out) % 16) == 0;
    if (aligned) {
        for (uint64_t i = index; i < chunks; i += count) {
            uint64_t* q = reinterpret_cast<uint64_t*>(out + 16 * i);
            q[0] = 0;
            q[1] = 0;
        }
    } else {
        for (uint64_t i = index; i < chunks; i += count) {
            for (int b = 0; b < 16; ++b) out[16 * i + b] = 0;
        }
    }
    for (uint64_t i = chunks * 16 + index; i < size; i += count) out[i] = 0;
}

/* One input/output pair's elements; call after zero_buffer(out) has finished everywhere. */
AIODLA_HD inline void compute_pair(const ModuleTable& table, uint32_t pair, const uint8_t* in,
                                   uint8_t* out, uint32_t index, uint32_t count) {
    const TensorLayout& src = table.inputs[pair];
    const TensorLayout& dst = table.outputs[pair];
    const uint64_t C = src.c, H = src.h, W = src.w;
    if (table.op == kOpMeanHw) {
        const uint64_t planes = static_cast<uint64_t>(src.n) * C;
        const double area = static_cast<double>(H * W);
        for (uint64_t item = index; item < planes; item += count) {
            const uint64_t n = item / C, c = item % C;
            double sum = 0.0;
            bool first = true;
            for (uint64_t h = 0; h < H; ++h) {
                for (uint64_t w = 0; w < W; ++w) {
                    const double x = load_element(in + element_offset(src, n, c, h, w), src.type);
                    sum = first ? x : dadd(sum, x);
                    first = false;
                }
            }
            const double y = dadd(dmul(ddiv(sum, area), table.scale), table.bias);
            store_element(out + element_offset(dst, n, c, 0, 0), dst.type, y);
        }
        return;
    }
    const uint64_t total = static_cast<uint64_t>(src.n) * C * H * W;
    for (uint64_t item = index; item < total; item += count) {
        const uint64_t w = item % W;
        const uint64_t h = (item / W) % H;
        const uint64_t c = (item / (W * H)) % C;
        const uint64_t n = item / (W * H * C);
        const double x = load_element(in + element_offset(src, n, c, h, w), src.type);
        const double y = dadd(dmul(x, table.scale), table.bias);
        store_element(out + element_offset(dst, n, c, h, w), dst.type, y);
    }
}

/* -- mix ---------------------------------------------------------------------------- */

constexpr uint64_t kMixGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMixOutputStep = 0xD1B54A32D192ED03ull;
constexpr uint64_t kMixInputSeed = 0x41494F444C41ull; /* "AIODLA" */
/* detect's digest reads the input elements whose h and w are multiples of this (one in
 * 64 for images): the emulated runtime then reads a frame's grid, not the whole frame. */
constexpr uint32_t kDetectGrid = 8;

/* The digest's grid of a digest op (mix, detect): see mix_partial_sum. */
AIODLA_HD inline uint32_t digest_grid(uint32_t op) {
    return op == kOpDetect ? kDetectGrid : 1;
}

/* SplitMix64's finalizer. */
AIODLA_HD inline uint64_t mix_finalize(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The element's stored bits as an unsigned integer of its width (little-endian). */
AIODLA_HD inline uint64_t load_bits(const uint8_t* p, uint32_t esize) {
    uint64_t bits = 0;
    for (uint32_t b = 0; b < esize; ++b) bits |= static_cast<uint64_t>(p[b]) << (8 * b);
    return bits;
}

/* The part of S[t] = sum of b[t, j] * w[t, j] (mod 2^64) that worker `index` of `count`
 * owns; the parts add up, in any order, to S[t]. The sum runs over the elements whose
 * h and w are multiples of `grid` (1 for mix: every element; kDetectGrid for detect),
 * j staying the element's row-major index in the whole tensor. */
AIODLA_HD inline uint64_t mix_partial_sum(const TensorLayout& src, uint32_t t, const uint8_t* in,
                                          uint32_t grid, uint32_t index, uint32_t count) {
    const uint64_t C = src.c, H = src.h, W = src.w;
    const uint64_t rows = (H + grid - 1) / grid, columns = (W + grid - 1) / grid;
    const uint64_t total = static_cast<uint64_t>(src.n) * C * rows * columns;
    const uint64_t seed = mix_finalize(kMixInputSeed + t);
    uint64_t sum = 0;
    for (uint64_t e = index; e < total; e += count) {
        const uint64_t w = (e % columns) * grid;
        const uint64_t h = ((e / columns) % rows) * grid;
        const uint64_t c = (e / (columns * rows)) % C;
        const uint64_t n = e / (columns * rows * C);
        const uint64_t j = ((n * C + c) * H + h) * W + w;
        const uint64_t weight = mix_finalize(seed + (j + 1) * kMixGolden) | 1ull;
        sum += load_bits(in + element_offset(src, n, c, h, w), src.esize) * weight;
    }
    return sum;
}

/* D from every input's S[t], in input order. */
AIODLA_HD inline uint64_t mix_digest(const uint64_t* sums, uint32_t inputs) {
    uint64_t digest = 0;
    for (uint32_t t = 0; t < inputs; ++t) digest = mix_finalize(digest + sums[t] + kMixGolden);
    return digest;
}

/* The value of draw r before scale and bias: its top 16 bits k, read by type. */
AIODLA_HD inline double mix_value(uint64_t r, uint32_t type) {
    const uint64_t k = r >> 48;
    switch (type) {
        case kTypeFloat:
        case kTypeHalf:
            return dadd(dmul(static_cast<double>(k), 3.0517578125e-05), -1.0); /* k*2^-15 - 1, exact */
        case kTypeInt8:
            return static_cast<double>(static_cast<int64_t>(k >> 8) - 128);
        case kTypeUint8:
            return static_cast<double>(k >> 8);
        case kTypeInt16:
            return static_cast<double>(static_cast<int64_t>(k) - 32768);
        default: /* kTypeUint16 */
            return static_cast<double>(k);
    }
}

/* Output o's elements that worker `index` of `count` owns, from the digest D; call after
 * zero_buffer(out) has finished everywhere. */
AIODLA_HD inline void mix_store(const ModuleTable& table, uint32_t o, uint64_t digest,
                                uint8_t* out, uint32_t index, uint32_t count) {
    const TensorLayout& dst = table.outputs[o];
    const uint64_t C = dst.c, H = dst.h, W = dst.w;
    const uint64_t total = static_cast<uint64_t>(dst.n) * C * H * W;
    const uint64_t key = mix_finalize(digest + (static_cast<uint64_t>(o) + 1) * kMixOutputStep);
    /* float outputs are clamped to the type's finite range: mix never stores inf */
    const double limit = dst.type == kTypeHalf    ? 65504.0
                         : dst.type == kTypeFloat ? 3.4028234663852886e+38
                                                  : 0.0;
    for (uint64_t i = index; i < total; i += count) {
        const uint64_t w = i % W;
        const uint64_t h = (i / W) % H;
        const uint64_t c = (i / (W * H)) % C;
        const uint64_t n = i / (W * H * C);
        const uint64_t r = mix_finalize(key + (i + 1) * kMixGolden);
        double y = dadd(dmul(mix_value(r, dst.type), table.scale), table.bias);
        if (limit != 0.0) y = y > limit ? limit : (y < -limit ? -limit : y);
        store_element(out + element_offset(dst, n, c, h, w), dst.type, y);
    }
}

/* -- detect ------------------------------------------------------------------------- */

constexpr uint64_t kDetectObjects = 16; /* expected objects per output */
constexpr uint64_t kDetectAnchors = 3;

/* Whether pixel (y, x) of batch 0 of input `src` differs from pixel (0, 0) in the
 * stored bits of some channel. */
AIODLA_HD inline bool differs_from_corner(const TensorLayout& src, const uint8_t* in, uint64_t y,
                                          uint64_t x) {
    for (uint64_t c = 0; c < src.c; ++c) {
        if (load_bits(in + element_offset(src, 0, c, y, x), src.esize) !=
            load_bits(in + element_offset(src, 0, c, 0, 0), src.esize)) {
            return true;
        }
    }
    return false;
}

/* Whether cell (y, x) of an H x W output lies in the picture of input `src` (h x w): its
 * first pixel (y*h / H, x*w / W) and its last ((y+1)*h - 1) / H, ((x+1)*w - 1) / W) both
 * differ from pixel (0, 0). A letterbox's padding is uniform and includes pixel (0, 0).
 * No input: every cell. */
AIODLA_HD inline bool in_picture(const TensorLayout* src, const uint8_t* in, uint64_t y,
                                 uint64_t x, uint64_t H, uint64_t W) {
    if (src == nullptr) return true;
    const uint64_t h = src->h, w = src->w;
    return differs_from_corner(*src, in, y * h / H, x * w / W) &&
           differs_from_corner(*src, in, ((y + 1) * h - 1) / H, ((x + 1) * w - 1) / W);
}

/* The value of channel c (of `per`) of a cell with draw r at (h, w) of an H x W output:
 * see detect_store. */
AIODLA_HD inline double detect_value(uint64_t r, uint64_t threshold, uint64_t c, uint64_t per,
                                     const TensorLayout* src, const uint8_t* in, uint64_t h,
                                     uint64_t w, uint64_t H, uint64_t W) {
    double y;
    if ((r >> 48) >= threshold || !in_picture(src, in, h, w, H, W)) {
        y = c == 4 ? -8.0 : 0.0;
    } else if (c < 4) {
        const uint32_t shift = c < 2 ? 8 * static_cast<uint32_t>(c) : 32 + 8 * (c - 2);
        y = static_cast<double>((r >> shift) & 255) / 128.0 - 1.0;
    } else if (c == 4) {
        y = 4.0;
    } else {
        y = (c - 5 == (r >> 16) % (per - 5)) ? 4.0 : -4.0;
    }
    return y;
}

/* Output o of op detect, from the digest D and input 0 (`in`, laid out as `src`; both
 * null without inputs): three anchors of (5 + k) channels. Cell i = (a*H + y)*W + x has
 * draw r = F(K[o] + (i + 1) * G) and holds an object when r >> 48 < max(1, floor(16 *
 * 2^16 / (3*H*W))) and the cell lies in the picture (in_picture); channel c of anchor a
 * at (y, x), as logits: without an object 0, objectness -8; with one, x, y, w, h =
 * ((r >> s) & 255) / 128 - 1 for s = 0, 8, 32, 40, objectness 4, class (r >> 16) % k 4,
 * others -4. Every value is exact in float16. Call after zero_buffer(out) has finished. */
AIODLA_HD inline void detect_store(const ModuleTable& table, uint32_t o, uint64_t digest,
                                   const TensorLayout* src, const uint8_t* in, uint8_t* out,
                                   uint32_t index, uint32_t count) {
    const TensorLayout& dst = table.outputs[o];
    const uint64_t C = dst.c, H = dst.h, W = dst.w;
    const uint64_t per = C / kDetectAnchors, plane = H * W;
    const uint64_t total = static_cast<uint64_t>(dst.n) * C * plane;
    const uint64_t key = mix_finalize(digest + (static_cast<uint64_t>(o) + 1) * kMixOutputStep);
    uint64_t threshold = (kDetectObjects << 16) / (kDetectAnchors * plane);
    if (threshold < 1) threshold = 1;
    /* The index arithmetic in 32 bits where every extent fits (a detector's heads always
     * do): the same quotients, at a fraction of the GPU's 64-bit division cost, which
     * dominated a 640x640 detector's task (6.8 ms for 3.8 ms stated on an H100). */
    if (total <= 0xFFFFFFFFull) {
        const uint32_t w32 = static_cast<uint32_t>(W), h32 = static_cast<uint32_t>(H);
        const uint32_t c32 = static_cast<uint32_t>(C), per32 = static_cast<uint32_t>(per);
        const uint32_t plane32 = static_cast<uint32_t>(plane), lanes = dst.lanes;
        for (uint64_t e64 = index; e64 < total; e64 += count) {
            const uint32_t e = static_cast<uint32_t>(e64);
            const uint32_t w = e % w32;
            const uint32_t h = (e / w32) % h32;
            const uint32_t channel = (e / plane32) % c32;
            const uint32_t a = channel / per32, c = channel % per32;
            const uint64_t cell = static_cast<uint64_t>(a) * plane + h * W + w;
            const uint64_t r = mix_finalize(key + (cell + 1) * kMixGolden);
            const double y = detect_value(r, threshold, c, per, src, in, h, w, H, W);
            const uint64_t offset = static_cast<uint64_t>(channel / lanes) * dst.surface +
                                    static_cast<uint64_t>(h) * dst.line +
                                    static_cast<uint64_t>(w) * dst.pixel +
                                    static_cast<uint64_t>(channel % lanes) * dst.esize;
            store_element(out + offset, dst.type, y);
        }
        return;
    }
    for (uint64_t e = index; e < total; e += count) {
        const uint64_t w = e % W;
        const uint64_t h = (e / W) % H;
        const uint64_t channel = (e / plane) % C;
        const uint64_t a = channel / per, c = channel % per;
        const uint64_t cell = a * plane + h * W + w;
        const uint64_t r = mix_finalize(key + (cell + 1) * kMixGolden);
        const double y = detect_value(r, threshold, c, per, src, in, h, w, H, W);
        store_element(out + element_offset(dst, 0, channel, h, w), dst.type, y);
    }
}

/* Output o of a digest op (mix, detect); `in` is input 0's buffer (detect reads it). */
AIODLA_HD inline void digest_store(const ModuleTable& table, uint32_t o, uint64_t digest,
                                   const uint8_t* in, uint8_t* out, uint32_t index,
                                   uint32_t count) {
    if (table.op == kOpDetect) {
        const TensorLayout* src = table.num_inputs ? &table.inputs[0] : nullptr;
        detect_store(table, o, digest, src, in, out, index, count);
    } else {
        mix_store(table, o, digest, out, index, count);
    }
}

/* One whole task on one thread (the host builds): every output zeroed, then computed. */
inline void run_task_serially(const ModuleTable& table, const uint8_t* const* inputs,
                              uint8_t* const* outputs) {
    for (uint32_t o = 0; o < table.num_outputs; ++o) {
        zero_buffer(outputs[o], table.outputs[o].size, 0, 1);
    }
    if (table.op == kOpMix || table.op == kOpDetect) {
        uint64_t sums[kMaxPairs];
        for (uint32_t t = 0; t < table.num_inputs; ++t) {
            sums[t] = mix_partial_sum(table.inputs[t], t, inputs[t], digest_grid(table.op), 0, 1);
        }
        const uint64_t digest = mix_digest(sums, table.num_inputs);
        for (uint32_t o = 0; o < table.num_outputs; ++o) {
            digest_store(table, o, digest, table.num_inputs ? inputs[0] : nullptr, outputs[o], 0,
                         1);
        }
        return;
    }
    for (uint32_t p = 0; p < table.num_inputs; ++p) compute_pair(table, p, inputs[p], outputs[p], 0, 1);
}

}  // namespace aiodla_standin

#endif /* AIODLA_STANDIN_TASK_MATH_H */
