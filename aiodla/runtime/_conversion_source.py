"""The CUDA C++ source of the layout-conversion kernels, as strings, and the generation of
one program for an engine's tensors: a traits struct per tensor (shape, strides, scale
as compile-time constants) and one ``extern "C"`` kernel per (tensor, dtype) pair.

:mod:`aiodla.runtime._conversion_kernels` compiles and launches them. The element
conversions (:data:`CONVERSIONS`) compile as host C++ too, so the tests check them
against numpy on machines with no GPU; they are the rules of :mod:`aiodla._convert`,
written with integer bit manipulation where CUDA's own intrinsics differ from numpy
(NaN payloads, mostly).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from .._tensors import TensorSpec

__all__ = ["CONVERSIONS", "KIND_NAMES", "KernelPlan", "plan_program"]

BLOCK = 256  # threads per block, every kernel (__launch_bounds__ says so too)
_VEC = 16  # bytes a pack thread writes with one vector store
_TILE_ELEMENTS = 2048  # elements an unpack block transposes through shared memory
_TILE_SMEM_MAX = 40 * 1024  # beyond this (very wide nhwc), unpack reads without a tile

# numpy dtype -> the C++ kind constant (see CONVERSIONS' enum).
KIND_NAMES: dict[np.dtype[Any], str] = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.bool_): "BOOL",
}

CONVERSIONS = r"""
// ---- element conversions: host and device ------------------------------------------
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define AIODLA_FN __device__ __forceinline__
#else
#include <cstring>
#define AIODLA_FN static inline
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
AIODLA_FN u32 bits_f32(float x) { return __float_as_uint(x); }
AIODLA_FN float f32_bits(u32 b) { return __uint_as_float(b); }
AIODLA_FN u64 bits_f64(double x) { return (u64)__double_as_longlong(x); }
AIODLA_FN double f64_bits(u64 b) { return __longlong_as_double((i64)b); }
AIODLA_FN double round_even(double x) { return rint(x); }
AIODLA_FN float narrow_rn(double x) { return __double2float_rn(x); }
#else
AIODLA_FN u32 bits_f32(float x) { u32 b; std::memcpy(&b, &x, 4); return b; }
AIODLA_FN float f32_bits(u32 b) { float x; std::memcpy(&x, &b, 4); return x; }
AIODLA_FN u64 bits_f64(double x) { u64 b; std::memcpy(&b, &x, 8); return b; }
AIODLA_FN double f64_bits(u64 b) { double x; std::memcpy(&x, &b, 8); return x; }
AIODLA_FN double round_even(double x) { return __builtin_rint(x); }  // default mode: even
AIODLA_FN float narrow_rn(double x) { return (float)x; }
#endif

enum { K_F64, K_F32, K_F16, K_I8, K_U8, K_I16, K_U16, K_I32, K_U32, K_BOOL };
template <int K> struct Store;  // the type an element of kind K is stored as
template <> struct Store<K_F64> { typedef double T; };
template <> struct Store<K_F32> { typedef float T; };
template <> struct Store<K_F16> { typedef u16 T; };  // float16 travels as its bits
template <> struct Store<K_I8> { typedef i8 T; };
template <> struct Store<K_U8> { typedef u8 T; };
template <> struct Store<K_I16> { typedef i16 T; };
template <> struct Store<K_U16> { typedef u16 T; };
template <> struct Store<K_I32> { typedef i32 T; };
template <> struct Store<K_U32> { typedef u32 T; };
template <> struct Store<K_BOOL> { typedef u8 T; };

// Round to nearest even the value m * 2**-shift (m an integer significand), 0 < shift < 64.
AIODLA_FN u64 shift_round_even(u64 m, u32 shift) {
    const u64 q = m >> shift, rest = m & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    return q + ((rest > half || (rest == half && (q & 1))) ? 1 : 0);
}

// float32 bits -> float16 bits in one rounding, to nearest even (numpy's
// npy_floatbits_to_halfbits). NaN keeps its sign and the top 10 payload bits, made
// nonzero (0x7c01) if they are all zero; the quiet bit is NOT forced (numpy does not,
// CUDA's __float2half_rn returns one canonical NaN instead).
AIODLA_FN u16 half_from_f32_bits(u32 f) {
    const u32 sign = (f >> 16) & 0x8000u, a = f & 0x7fffffffu;
    if (a >= 0x7f800000u) {
        if (a == 0x7f800000u) return (u16)(sign | 0x7c00u);
        const u32 payload = (a & 0x7fffffu) >> 13;
        return (u16)(sign | 0x7c00u | (payload ? payload : 1u));
    }
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // >= 65520: ties up to 65536, inf
    if (a < 0x38800000u) {  // below 2**-14: a float16 subnormal (or zero), units of 2**-24
        const u32 e = a >> 23;
        if (e < 102) return (u16)sign;  // below 2**-25 (2**-25 itself ties to even: 0)
        const u64 m = (a & 0x7fffffu) | 0x800000u;  // value m * 2**(e - 150)
        return (u16)(sign | (u32)shift_round_even(m, 126 - e));
    }
    const u32 q = ((((a >> 23) - 112) << 10) | ((a & 0x7fffffu) >> 13));
    const u32 rest = a & 0x1fffu;  // a carry into the exponent is the right result
    return (u16)(sign | (q + ((rest > 0x1000u || (rest == 0x1000u && (q & 1))) ? 1 : 0)));
}

// float64 bits -> float16 bits in ONE rounding (numpy's npy_doublebits_to_halfbits; going
// through float32 would round twice). NaN: the top 10 of the 52 payload bits.
AIODLA_FN u16 half_from_f64_bits(u64 d) {
    const u32 sign = (u32)(d >> 48) & 0x8000u;
    const u64 a = d & 0x7fffffffffffffffull;
    if (a >= 0x7ff0000000000000ull) {
        if (a == 0x7ff0000000000000ull) return (u16)(sign | 0x7c00u);
        const u32 payload = (u32)((a & 0xfffffffffffffull) >> 42);
        return (u16)(sign | 0x7c00u | (payload ? payload : 1u));
    }
    if (a >= 0x40effe0000000000ull) return (u16)(sign | 0x7c00u);  // >= 65520
    if (a < 0x3f10000000000000ull) {  // below 2**-14
        const u32 e = (u32)(a >> 52);
        if (e < 998) return (u16)sign;  // below 2**-25
        const u64 m = (a & 0xfffffffffffffull) | (1ull << 52);  // m * 2**(e - 1075)
        return (u16)(sign | (u32)shift_round_even(m, 1051 - e));
    }
    const u64 m = a & 0xfffffffffffffull;
    const u32 q = ((u32)((a >> 52) - 1008) << 10) | (u32)(m >> 42);
    const u64 rest = m & 0x3ffffffffffull, half = 1ull << 41;
    return (u16)(sign | (q + ((rest > half || (rest == half && (q & 1))) ? 1 : 0)));
}

// float16 bits -> float32 bits, exact; NaN payload shifted up, quiet bit not forced
// (numpy's npy_halfbits_to_floatbits; F16C and CUDA would quiet a signaling NaN).
AIODLA_FN u32 f32_bits_from_half(u16 h) {
    const u32 sign = ((u32)h & 0x8000u) << 16, e = ((u32)h >> 10) & 0x1fu, m = (u32)h & 0x3ffu;
    if (e == 0x1fu) return sign | 0x7f800000u | (m << 13);
    if (e == 0) return sign | bits_f32((float)m * 5.9604644775390625e-8f);  // exact: m * 2**-24
    return sign | ((e + 112) << 23) | (m << 13);
}

// float16 bits -> float64 bits, exact (npy_halfbits_to_doublebits).
AIODLA_FN u64 f64_bits_from_half(u16 h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu))
        return ((u64)(h & 0x8000u) << 48) | 0x7ff0000000000000ull | ((u64)(h & 0x3ffu) << 42);
    return bits_f64((double)f32_bits(f32_bits_from_half(h)));
}

// float64 -> float32 bits as numpy's cast on x86-64 (cvtsd2ss): round to nearest even,
// subnormals kept; NaN quieted with the top 23 payload bits kept.
AIODLA_FN u32 f32_bits_from_f64(double x) {
    const u64 d = bits_f64(x);
    if ((d & 0x7fffffffffffffffull) > 0x7ff0000000000000ull)
        return ((u32)(d >> 32) & 0x80000000u) | 0x7fc00000u | (u32)((d >> 29) & 0x7fffffu);
    return bits_f32(narrow_rn(x));
}

// float32 -> float64 bits as numpy's cast on x86-64 (cvtss2sd): NaN quieted, payload kept.
AIODLA_FN u64 f64_bits_from_f32(u32 f) {
    if ((f & 0x7fffffffu) > 0x7f800000u)
        return ((u64)(f & 0x80000000u) << 32) | 0x7ff8000000000000ull
               | ((u64)(f & 0x7fffffu) << 29);
    return bits_f64((double)f32_bits(f));
}

template <int K> struct IsFloat {
    static constexpr bool value = K == K_F64 || K == K_F32 || K == K_F16;
};

template <int S> AIODLA_FN float int_to_f32(typename Store<S>::T v) {
    if constexpr (S == K_BOOL) return v != 0 ? 1.0f : 0.0f;
    else return (float)v;  // round to nearest even, as numpy's (float) cast
}

template <int S> AIODLA_FN double int_to_f64(typename Store<S>::T v) {
    if constexpr (S == K_BOOL) return v != 0 ? 1.0 : 0.0;
    else return (double)v;  // exact: at most 32 bits
}

// A source element stored as kind D, no scale involved.
template <int S, int D> AIODLA_FN typename Store<D>::T convert(typename Store<S>::T v) {
    typedef typename Store<D>::T Out;
    if constexpr (S == D) {
        return v;
    } else if constexpr (D == K_F16) {
        if constexpr (S == K_F32) return half_from_f32_bits(bits_f32(v));
        else if constexpr (S == K_F64) return half_from_f64_bits(bits_f64(v));
        // numpy goes through float32: exact below 2**24, and beyond 65520 is inf anyway
        else return half_from_f32_bits(bits_f32(int_to_f32<S>(v)));
    } else if constexpr (D == K_F32) {
        if constexpr (S == K_F16) return f32_bits(f32_bits_from_half(v));
        else if constexpr (S == K_F64) return f32_bits(f32_bits_from_f64(v));
        else return int_to_f32<S>(v);
    } else if constexpr (D == K_F64) {
        if constexpr (S == K_F16) return f64_bits(f64_bits_from_half(v));
        else if constexpr (S == K_F32) return f64_bits(f64_bits_from_f32(bits_f32(v)));
        else return int_to_f64<S>(v);
    } else {
        static_assert(!IsFloat<S>::value, "floats into an integer tensor need a scale");
        if constexpr (S == K_BOOL) return (Out)(v != 0);
        else return (Out)v;  // only safe integer casts are generated
    }
}

// The exact value of a float element as binary64 (NaN stays NaN).
template <int S> AIODLA_FN double float_value(typename Store<S>::T v) {
    if constexpr (S == K_F16) return f64_bits(f64_bits_from_half(v));
    else return (double)v;
}

// round_half_even(x / scale) saturated to [lo, hi], the quotient in binary64. With a
// power-of-two scale the caller passes its reciprocal and MUL: x * 2**-k is the same
// correctly rounded quotient. NaN (refused on the host before packing) becomes 0.
template <int S, int D, bool MUL>
AIODLA_FN typename Store<D>::T quantize(typename Store<S>::T v, double by, double lo, double hi) {
    const double x = float_value<S>(v);
    double q = round_even(MUL ? x * by : x / by);
    if (q != q) return 0;
    q = q < lo ? lo : (q > hi ? hi : q);
    return (typename Store<D>::T)q;
}

// float(scale * q), the product in binary64 rounded once to the result type.
template <int S, int D>
AIODLA_FN typename Store<D>::T dequantize(typename Store<S>::T q, double scale) {
    return convert<K_F64, D>(int_to_f64<S>(q) * scale);
}
"""

KERNELS = r"""
// ---- kernels -------------------------------------------------------------------------
struct alignas(16) Vec16 { u32 x, y, z, w; };

template <bool SMALL> struct IndexOf { typedef u32 T; };
template <> struct IndexOf<false> { typedef u64 T; };

// A source element (n, c, h, w) of the tensor T, stored as T's kind.
template <class T, int S>
AIODLA_FN typename Store<T::KIND>::T load_source(const typename Store<S>::T* src, i64 n, i64 c,
                                                 i64 h, i64 w, i64 sn, i64 sc, i64 sh, i64 sw) {
    const typename Store<S>::T v = src[n * sn + c * sc + h * sh + w * sw];
    if constexpr (!IsFloat<T::KIND>::value && IsFloat<S>::value)
        return quantize<S, T::KIND, T::MUL>(v, T::BY, T::QLO, T::QHI);
    else
        return convert<S, T::KIND>(v);
}

// One thread per VEC bytes of the DLA buffer, every byte of it written: element lanes
// with load(n, c, h, w) (T's stored type), padding (lanes beyond c, rows, surfaces,
// batches, tail) with 0. Coalesced stores. The pre-processing kernels share it.
template <class T, int VEC, class Load>
__device__ __forceinline__ void store_body(u8* __restrict__ dst, const Load& load) {
    typedef typename Store<T::KIND>::T D;
    typedef typename IndexOf<T::SMALL>::T I;
    constexpr int PER = VEC / T::ESIZE;
    const I base = ((I)blockIdx.x * (I)BLOCK + (I)threadIdx.x) * (I)VEC;
    if (base >= (I)T::SIZE) return;
    union { Vec16 v; D e[PER > 0 ? PER : 1]; u8 b[VEC]; } out;
    const I n = base / (I)T::BATCH;
    I r = base - n * (I)T::BATCH;
    const I g = r / (I)T::SURFACE;
    r -= g * (I)T::SURFACE;
    const I h = r / (I)T::LINE;
    r -= h * (I)T::LINE;
    const bool row = n < (I)T::N && g < (I)T::GROUPS && h < (I)T::H;
    constexpr bool ALIGNED = T::LINE % VEC == 0 && T::SURFACE % VEC == 0 && T::BATCH % VEC == 0;
    if constexpr (ALIGNED && T::PIXEL % VEC == 0) {  // the VEC bytes lie in one pixel
        const I w = r / (I)T::PIXEL;
        const I c0 = g * (I)T::LANES + (r - w * (I)T::PIXEL) / (I)T::ESIZE;
        const bool ok = row && w < (I)T::W;
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const I c = c0 + (I)k;
            out.e[k] = ok && c < (I)T::C ? load(n, c, h, w) : (D)0;
        }
    } else if constexpr (ALIGNED) {  // in one line
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const I at = r + (I)(k * T::ESIZE), w = at / (I)T::PIXEL;
            const I c = g * (I)T::LANES + (at - w * (I)T::PIXEL) / (I)T::ESIZE;
            const bool ok = row && w < (I)T::W && c < (I)T::C;
            out.e[k] = ok ? load(n, c, h, w) : (D)0;
        }
    } else {
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const I at = base + (I)(k * T::ESIZE), n1 = at / (I)T::BATCH;
            I q = at - n1 * (I)T::BATCH;
            const I g1 = q / (I)T::SURFACE;
            q -= g1 * (I)T::SURFACE;
            const I h1 = q / (I)T::LINE;
            q -= h1 * (I)T::LINE;
            const I w1 = q / (I)T::PIXEL;
            const I c = g1 * (I)T::LANES + (q - w1 * (I)T::PIXEL) / (I)T::ESIZE;
            const bool ok = n1 < (I)T::N && g1 < (I)T::GROUPS && h1 < (I)T::H && w1 < (I)T::W
                            && c < (I)T::C;
            out.e[k] = ok ? load(n1, c, h1, w1) : (D)0;
        }
    }
    if (base + (I)VEC <= (I)T::SIZE) {
        if constexpr (VEC == 16) *reinterpret_cast<Vec16*>(dst + base) = out.v;
        else *reinterpret_cast<D*>(dst + base) = out.e[0];
    } else {  // the buffer's last bytes
        for (int i = 0; i < VEC; ++i)
            if (base + (I)i < (I)T::SIZE) dst[base + i] = out.b[i];
    }
}

// store_body's loader for a logical array. A functor, not a lambda: NVRTC 13.0 (CUDA 13.0,
// JetPack 7's) takes an unannotated lambda for host code, even inside a device function.
template <class T, int S> struct SourceLoad {
    const typename Store<S>::T* src;
    i64 sn, sc, sh, sw;
    template <class N, class C, class H, class W>
    __device__ __forceinline__ typename Store<T::KIND>::T operator()(N n, C c, H h, W w) const {
        return load_source<T, S>(src, n, c, h, w, sn, sc, sh, sw);
    }
};

// Packing a logical array: a warp's loads of one channel are consecutive w when sw == 1.
template <class T, int S, int VEC>
__device__ __forceinline__ void pack_body(const typename Store<S>::T* __restrict__ src,
                                          u8* __restrict__ dst, i64 sn, i64 sc, i64 sh, i64 sw) {
    store_body<T, VEC>(dst, SourceLoad<T, S>{src, sn, sc, sh, sw});
}

// A stored element as the result kind R: dequantized for an integer tensor with a scale
// read as floats, else converted (R == stored: the bits as they are).
template <class T, int R> AIODLA_FN typename Store<R>::T read_value(typename Store<T::KIND>::T v) {
    if constexpr (T::HAS_SCALE && IsFloat<R>::value && !IsFloat<T::KIND>::value)
        return dequantize<T::KIND, R>(v, T::SCALE);
    else
        return convert<T::KIND, R>(v);
}

// One thread per element of the dense NCHW result (nchw tensors: reads are coalesced).
template <class T, int R>
__device__ __forceinline__ void unpack_direct(const u8* __restrict__ src,
                                              typename Store<R>::T* __restrict__ dst) {
    typedef typename Store<T::KIND>::T D;
    typedef typename IndexOf<T::SMALL>::T I;
    const I i = (I)blockIdx.x * (I)BLOCK + (I)threadIdx.x;
    if (i >= (I)T::COUNT) return;
    const I w = i % (I)T::W, t = i / (I)T::W, h = t % (I)T::H, t2 = t / (I)T::H;
    const I c = t2 % (I)T::C, n = t2 / (I)T::C;
    const I at = n * (I)T::BATCH + (c / (I)T::LANES) * (I)T::SURFACE + h * (I)T::LINE
                 + w * (I)T::PIXEL + (c % (I)T::LANES) * (I)T::ESIZE;
    dst[i] = read_value<T, R>(*reinterpret_cast<const D*>(src + at));
}

// Lane formats: a block moves TP positions (pixels) of one channel group through shared
// memory, reading the pixels' lanes contiguously and writing each channel's run of
// positions contiguously. A position is a pixel of one row, or of the whole surface
// when rows are unpadded (FLAT). Shared rows are padded so that reading one lane of
// consecutive pixels hits distinct banks.
template <class T, int R>
__device__ __forceinline__ void unpack_tiled(const u8* __restrict__ src,
                                             typename Store<R>::T* __restrict__ dst) {
    typedef typename Store<T::KIND>::T D;
    typedef typename IndexOf<T::SMALL>::T I;
    constexpr bool FLAT = T::LINE == T::W * T::PIXEL;
    constexpr I ROWS = FLAT ? 1 : T::H, LEN = FLAT ? T::H * T::W : T::W, TP = T::TP;
    constexpr I TILES = (LEN + TP - 1) / TP, SPE = T::SPE;
    __shared__ D tile[TP * SPE];
    I b = blockIdx.x;
    const I t = b % TILES;
    b /= TILES;
    const I r = b % ROWS;
    b /= ROWS;
    const I g = b % (I)T::GROUPS, n = b / (I)T::GROUPS;
    const I p0 = t * TP, tp = LEN - p0 < TP ? LEN - p0 : TP;
    const I first = g * (I)T::LANES;
    const I valid = (I)T::C - first < (I)T::LANES ? (I)T::C - first : (I)T::LANES;
    const D* in = reinterpret_cast<const D*>(
        src + n * (I)T::BATCH + g * (I)T::SURFACE + r * (I)T::LINE + p0 * (I)T::PIXEL);
#pragma unroll 4
    for (I i = threadIdx.x; i < tp * (I)T::LANES; i += BLOCK) {
        const I p = i / (I)T::LANES, lane = i - p * (I)T::LANES;
        if (lane < valid) tile[p * SPE + lane] = in[i];
    }
    __syncthreads();
    typename Store<R>::T* out = dst + ((n * (I)T::C + first) * ROWS + r) * LEN + p0;
#pragma unroll 4
    for (I j = threadIdx.x; j < valid * TP; j += BLOCK) {
        const I lane = j / TP, p = j - lane * TP;
        if (p < tp) out[lane * ROWS * LEN + p] = read_value<T, R>(tile[p * SPE + lane]);
    }
}
"""


class KernelPlan(NamedTuple):
    """One kernel of the program: its name and how it is launched."""

    name: str
    grid: int  # blocks (of BLOCK threads)
    vector: bool  # pack: writes 16-byte vectors (the destination must be 16-byte aligned)


def _literal(value: float) -> str:
    """An exact C++17 double literal (hex float): the scale as the host has it, bit for bit."""
    return float.hex(float(value))


def _traits(index: int, spec: TensorSpec) -> tuple[str, bool, int]:
    """The traits struct of one tensor; also whether unpack tiles, and its tile blocks."""
    assert spec.strides is not None
    pixel, line, surface, batch = spec.strides
    n, c, h, w = spec.shape
    esize, lanes, groups = spec.numpy_dtype.itemsize, spec.lanes, spec.groups
    if any(stride % esize for stride in spec.strides):
        # Unaligned elements: a GPU load of one would fault. check_layout allows it, the
        # kernels do not; the engine converts such a tensor on the host.
        raise ValueError(
            f"tensor {spec.name!r}: strides {spec.strides} are not multiples of its "
            f"{esize}-byte elements; no kernel is generated for it"
        )
    count = n * c * h * w
    small = max(spec.size, count * 8) < 2**31
    flat = line == w * pixel
    length = h * w if flat else w
    tile = max(1, min(length, _TILE_ELEMENTS // lanes))
    spe = (pixel + (4 if pixel % 8 == 0 else 0)) // esize
    tiled = lanes > 1 and tile * spe * esize <= _TILE_SMEM_MAX
    tiles = n * groups * (1 if flat else h) * math.ceil(length / tile)
    kind = KIND_NAMES[spec.numpy_dtype]
    scale = spec.scale if spec.is_integer and spec.scale is not None else None
    # A power-of-two scale divides exactly as a product with its reciprocal (the same
    # correctly rounded quotient), and a product is cheaper than a binary64 division.
    mul = scale is not None and math.frexp(scale)[0] == 0.5 and 2.0**-1000 <= scale <= 2.0**1000
    by = 1.0 if scale is None else (1.0 / scale if mul else scale)
    qlo = qhi = 0.0
    if spec.is_integer:
        info = np.iinfo(spec.numpy_dtype)
        qlo, qhi = float(info.min), float(info.max)
    flags = {"SMALL": small, "HAS_SCALE": scale is not None, "MUL": mul}
    bools = ", ".join(f"{key} = {str(value).lower()}" for key, value in flags.items())
    # The name goes into a // comment: no character may end or continue that line.
    about = re.sub(r"[^A-Za-z0-9 _.:,x-]", "?", spec.describe())
    text = f"""
struct T{index} {{  // {about}, strides {spec.strides}, {spec.size} bytes
    static constexpr int KIND = K_{kind}, ESIZE = {esize};
    static constexpr u64 N = {n}, C = {c}, H = {h}, W = {w}, LANES = {lanes}, GROUPS = {groups};
    static constexpr u64 PIXEL = {pixel}, LINE = {line}, SURFACE = {surface}, BATCH = {batch};
    static constexpr u64 SIZE = {spec.size}, COUNT = {count}, TP = {tile}, SPE = {spe};
    static constexpr bool {bools};
    static constexpr double SCALE = {_literal(1.0 if scale is None else scale)};
    static constexpr double BY = {_literal(by)}, QLO = {_literal(qlo)}, QHI = {_literal(qhi)};
}};
"""
    return text, tiled, tiles


def _check_pack(spec: TensorSpec, source: np.dtype[Any]) -> None:
    target = spec.numpy_dtype
    if source not in KIND_NAMES:
        raise ValueError(f"tensor {spec.name!r}: no pack kernel reads {source} arrays")
    if spec.is_integer and source.kind == "f" and spec.scale is None:
        raise ValueError(f"tensor {spec.name!r}: {source} into {target} needs a scale")
    if spec.is_integer and source.kind != "f" and not np.can_cast(source, target, "safe"):
        raise ValueError(f"tensor {spec.name!r}: {source} does not cast safely to {target}")


def _check_unpack(spec: TensorSpec, result: np.dtype[Any]) -> None:
    stored = spec.numpy_dtype
    if result not in KIND_NAMES or result == np.dtype(np.bool_):
        raise ValueError(f"tensor {spec.name!r}: no unpack kernel writes {result}")
    dequantized = spec.is_integer and spec.scale is not None and result.kind == "f"
    if not dequantized and not np.can_cast(stored, result, "safe"):
        raise ValueError(f"tensor {spec.name!r}: stored {stored} does not cast safely to {result}")


class Program(NamedTuple):
    source: str
    packs: dict[tuple[TensorSpec, np.dtype[Any]], tuple[KernelPlan, KernelPlan]]
    unpacks: dict[tuple[TensorSpec, np.dtype[Any]], KernelPlan]


def plan_program(
    packs: Sequence[tuple[TensorSpec, Any]], unpacks: Sequence[tuple[TensorSpec, Any]]
) -> Program:
    """The source of one program holding every requested kernel, and each kernel's plan.

    Each pack pair gets two kernels, 16-byte vector stores and element stores (for a
    destination not 16-byte aligned). Raises ValueError for a pair with no kernel.
    """
    indices: dict[TensorSpec, int] = {}
    parts = [CONVERSIONS, f"#define BLOCK {BLOCK}\n", KERNELS]
    tiling: dict[TensorSpec, tuple[bool, int]] = {}

    def tensor(spec: TensorSpec) -> int:
        if spec not in indices:
            indices[spec] = len(indices)
            text, tiled, tiles = _traits(indices[spec], spec)
            parts.append(text)
            tiling[spec] = (tiled, tiles)
        return indices[spec]

    pack_plans: dict[tuple[TensorSpec, np.dtype[Any]], tuple[KernelPlan, KernelPlan]] = {}
    for spec, dtype in packs:
        source = np.dtype(dtype)
        _check_pack(spec, source)
        if (spec, source) in pack_plans:
            continue
        k, kind = tensor(spec), KIND_NAMES[source]
        plans = []
        for vec in (_VEC, spec.numpy_dtype.itemsize):
            name = f"aiodla_pack_t{k}_{kind.lower()}_v{vec}"
            grid = math.ceil(math.ceil(spec.size / vec) / BLOCK)
            parts.append(
                f'extern "C" __global__ void __launch_bounds__(BLOCK) {name}(const void* src, '
                f"void* dst, i64 sn, i64 sc, i64 sh, i64 sw) {{\n    pack_body<T{k}, K_{kind}, "
                f"{vec}>((const Store<K_{kind}>::T*)src, (u8*)dst, sn, sc, sh, sw);\n}}\n"
            )
            plans.append(KernelPlan(name, grid, vec == _VEC))
        pack_plans[(spec, source)] = (plans[0], plans[1])
    unpack_plans: dict[tuple[TensorSpec, np.dtype[Any]], KernelPlan] = {}
    for spec, dtype in unpacks:
        result = np.dtype(dtype)
        _check_unpack(spec, result)
        if (spec, result) in unpack_plans:
            continue
        k, kind = tensor(spec), KIND_NAMES[result]
        tiled, tiles = tiling[spec]
        name = f"aiodla_unpack_t{k}_{kind.lower()}"
        body = "unpack_tiled" if tiled else "unpack_direct"
        grid = tiles if tiled else math.ceil(math.prod(spec.shape) / BLOCK)
        parts.append(
            f'extern "C" __global__ void __launch_bounds__(BLOCK) {name}(const void* src, '
            f"void* dst) {{\n    {body}<T{k}, K_{kind}>((const u8*)src, "
            f"(Store<K_{kind}>::T*)dst);\n}}\n"
        )
        unpack_plans[(spec, result)] = KernelPlan(name, grid, False)
    return Program("".join(parts), pack_plans, unpack_plans)
