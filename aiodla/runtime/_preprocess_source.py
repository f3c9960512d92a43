"""The CUDA C++ source of the fused pre-processing kernels: camera frame in, a model
input's DLA buffer out, in one pass.

One kernel pair per (tensor, :class:`~aiodla.ImagePreprocess`): colour conversion,
bilinear sampling, letterbox, normalization, then the tensor's dtype and DLA layout,
bit for bit what ``spec.pack(pre.apply(frame, spec))`` gives. The arithmetic is the
one :mod:`aiodla._preprocess`'s docstring defines, step by step; the element types and
the layout walk are the conversion kernels' own (:data:`~._conversion_source.CONVERSIONS`,
``store_body`` and the traits struct of :mod:`._conversion_source`), so both paths
round and lay out values the same way. It compiles as host C++ too: the tests build
it with g++ and compare with numpy on machines with no GPU.

The sample tables are computed on the device, per output pixel (once, whatever its
lanes), from the frame size given at launch: the kernel stays stateless (no table
buffers to upload per frame size and stream) and a camera may change resolution between
frames. Their binary64 steps are done in integers, bit for bit (see ``tap``): FP64 runs
at 1/64 of the float32 rate on Orin's GPU, and would cost about as much as the memory
traffic there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._frame_plan import _ORDERS, _PACKED, _PLANAR, _RGB_AT, _YUV_COEFFICIENTS
from ._conversion_source import BLOCK, CONVERSIONS, KERNELS, KernelPlan, _traits

if TYPE_CHECKING:
    from .._frame_plan import Preprocessing
    from .._tensors import TensorSpec

__all__ = ["PARAMETERS", "PreprocessProgram", "plan_preprocess"]

_VEC = 16  # bytes a thread writes with one vector store, as the pack kernels

#: The kernels' arguments, in order; every one is 8 bytes (pointers, i64, double).
PARAMETERS = (
    "frame", "dst", "pitch", "frame_height", "frame_width", "top", "left", "rows",
    "columns", "sig_y", "exp_y", "sig_x", "exp_x",
)  # fmt: skip
_TYPES = {"frame": "const void*", "dst": "void*", "sig_y": "u64", "sig_x": "u64"}

PREPROCESS = r"""
// ---- pre-processing: host and device ---------------------------------------------------
// Every float operation rounded on its own, as numpy does it: never contracted into an FMA
// (the device build passes fma=false too; the host build -ffp-contract=off).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
AIODLA_FN float f_add(float a, float b) { return __fadd_rn(a, b); }
AIODLA_FN float f_sub(float a, float b) { return __fsub_rn(a, b); }
AIODLA_FN float f_mul(float a, float b) { return __fmul_rn(a, b); }
AIODLA_FN float f_div(float a, float b) { return __fdiv_rn(a, b); }
AIODLA_FN u64 mul_high(u64 a, u64 b) { return __umul64hi(a, b); }
AIODLA_FN int bit_length(u64 x) { return 64 - __clzll((i64)x); }
#else
AIODLA_FN float f_add(float a, float b) { return a + b; }
AIODLA_FN float f_sub(float a, float b) { return a - b; }
AIODLA_FN float f_mul(float a, float b) { return a * b; }
AIODLA_FN float f_div(float a, float b) { return a / b; }
AIODLA_FN u64 mul_high(u64 a, u64 b) { return (u64)(((unsigned __int128)a * b) >> 64); }
AIODLA_FN int bit_length(u64 x) { return x ? 64 - __builtin_clzll(x) : 0; }
#endif

// The frame and where it lands, per launch (sizes are at most 16384: i32 is enough; byte
// offsets go through i64 since a pitch may be anything).
struct Frame {
    const u8* data;
    i64 pitch;
    i32 height, width, top, left, rows, columns;
    // frame size / resized size, the host's binary64 quotient, as SIG * 2**EXP (SIG an
    // integer of 53 bits)
    u64 sig_y, sig_x;
    i32 exp_y, exp_x;
};

struct Tap { i32 i0, i1; float f; };

// 2**n as a float, -126 <= n <= 127.
AIODLA_FN float pow2(int n) { return f32_bits((u32)(127 + n) << 23); }

// Step 2 for output index d of an axis resized from m pixels, the quotient m / n =
// sig * 2**e2: the binary64 steps reproduced bit for bit in integers, since FP64 runs at
// 1/64 rate on Orin's GPU. (d + 0.5) * (m / n) = (2d + 1) * sig * 2**(e2 - 1) is rounded
// once to 53 bits, P = p * 2**-k (k >= 24: P < 2**29). Subtracting 0.5 is then exact (for
// P > 0.5 the difference is a multiple of P's ulp, at most 2**-1, and smaller than P),
// and so are floor and the fraction; the fraction is rounded once to float32.
AIODLA_FN Tap tap(i32 d, i32 m, u64 sig, i32 e2) {
    const u64 a = 2 * (u64)d + 1;  // < 2**15: the product has at most 68 bits
    const u64 lo = a * sig, hi = mul_high(a, sig);
    const int bits = hi ? 64 + bit_length(hi) : bit_length(lo);
    const int s = bits > 53 ? bits - 53 : 0;
    u64 p = lo;
    if (s > 0) {  // round (hi, lo) >> s to nearest even; 1 <= s <= 15
        const u64 q = (lo >> s) | (hi << (64 - s)), rest = lo & ((1ull << s) - 1);
        const u64 half = 1ull << (s - 1);
        p = q + ((rest > half || (rest == half && (q & 1))) ? 1 : 0);
    }
    const int k = 1 - e2 - s;
    u64 i = 0, fraction = 0;  // src <= 0 (P <= 0.5): i < 0 clamps to 0, t to 0
    if (k - 1 < 64 && p > (1ull << (k - 1))) {
        const u64 src = p - (1ull << (k - 1));  // src * 2**-k = P - 0.5, exactly
        i = k < 64 ? src >> k : 0;
        fraction = k < 64 ? src & ((1ull << k) - 1) : src;
    }
    if (i >= (u64)(m - 1)) { i = m - 1; fraction = 0; }
    Tap r;
    r.i0 = (i32)i;
    r.i1 = r.i0 + 1 < m ? r.i0 + 1 : m - 1;
    // fraction * 2**-k to float32, rounded to nearest even: 24 significant bits, then an
    // exact scaling (the result is at least 2**-68, a normal float)
    const int b = bit_length(fraction);
    if (b <= 24) {
        r.f = f_mul((float)fraction, pow2(-k));
    } else {
        r.f = f_mul((float)shift_round_even(fraction, b - 24), pow2(b - 24 - k));
    }
    return r;
}

// Step 1: model channels 0, 1, 2 of frame pixel (y, x), as exact floats.
template <class P> AIODLA_FN void fetch(const Frame& f, i32 y, i32 x, float* out) {
    const u8* row = f.data + (i64)y * f.pitch;
    if constexpr (P::PLANAR != 0) {
        // The chroma rows follow the Y plane with the same pitch: one (H*3/2) x W array.
        i32 u, v;
        if constexpr (P::PLANAR == 1) {  // nv12: U, V side by side in one row
            const u8* uv = f.data + (i64)(f.height + y / 2) * f.pitch + (x & ~1);
            u = (i32)uv[0] - 128;
            v = (i32)uv[1] - 128;
        } else {  // i420: chroma row r of W/2 bytes at array row H + r/2, half (r & 1)
            const i32 half = f.width / 2, ru = y / 2, rv = f.height / 2 + y / 2;
            const u8* up = f.data + (i64)(f.height + ru / 2) * f.pitch + (ru & 1) * half;
            const u8* vp = f.data + (i64)(f.height + rv / 2) * f.pitch + (rv & 1) * half;
            u = (i32)up[x / 2] - 128;
            v = (i32)vp[x / 2] - 128;
        }
        const i32 luma = row[x];
        // The YUV range's coefficients (limited or full), in units of 2**-20.
        const i32 l = (luma > P::BLACK ? luma - P::BLACK : 0) * P::GAIN + (1 << 19);
        i32 rgb[3] = {(l + P::RV * v) >> 20, (l + P::GV * v + P::GU * u) >> 20,
                      (l + P::BU * u) >> 20};  // >> of a negative i32: arithmetic
#pragma unroll
        for (int k = 0; k < 3; ++k) rgb[k] = rgb[k] < 0 ? 0 : (rgb[k] > 255 ? 255 : rgb[k]);
        out[0] = (float)rgb[P::LANE0];
        out[1] = (float)rgb[P::LANE1];
        out[2] = (float)rgb[P::LANE2];
    } else {
        const u8* pixel = row + (i64)x * P::BPP;
        out[0] = (float)pixel[P::AT0];
        out[1] = (float)pixel[P::AT1];
        out[2] = (float)pixel[P::AT2];
    }
}

// Step 3: a + f * (b - a), each operation rounded.
AIODLA_FN float lerp(float a, float b, float f) { return f_add(a, f_mul(f, f_sub(b, a))); }

// Steps 2-4: v of the three model channels at model pixel (h, w).
template <class P> AIODLA_FN void sample(const Frame& f, i32 h, i32 w, float* v) {
    const i32 dy = h - f.top, dx = w - f.left;
    if (dy < 0 || dy >= f.rows || dx < 0 || dx >= f.columns) {
        v[0] = v[1] = v[2] = (float)P::PAD;  // the letterbox canvas
        return;
    }
    const Tap ty = tap(dy, f.height, f.sig_y, f.exp_y), tx = tap(dx, f.width, f.sig_x, f.exp_x);
    float a[3], b[3], c[3], d[3];
    fetch<P>(f, ty.i0, tx.i0, a);
    fetch<P>(f, ty.i0, tx.i1, b);
    fetch<P>(f, ty.i1, tx.i0, c);
    fetch<P>(f, ty.i1, tx.i1, d);
#pragma unroll  // constant indices: a, b, c, d and v stay in registers
    for (int k = 0; k < 3; ++k)
        v[k] = lerp(lerp(a[k], b[k], tx.f), lerp(c[k], d[k], tx.f), ty.f);
}

// Step 5, then into the tensor's type exactly as packing a float32 array does.
template <class T, class P> AIODLA_FN typename Store<T::KIND>::T finish(float v, i32 k) {
    const u32 mean = k == 0 ? P::MEAN0 : (k == 1 ? P::MEAN1 : P::MEAN2);
    const u32 sd = k == 0 ? P::STD0 : (k == 1 ? P::STD1 : P::STD2);
    const float y = f_div(f_sub(f_mul(v, f32_bits(P::SCALE)), f32_bits(mean)), f32_bits(sd));
    if constexpr (IsFloat<T::KIND>::value) return convert<K_F32, T::KIND>(y);
    else return quantize<K_F32, T::KIND, T::MUL>(y, T::BY, T::QLO, T::QHI);
}

// The lanes of one pixel come one after another in store_body's loop: sample the pixel
// once (taps, four fetches, three interpolations) and take each lane from it. A functor
// for the reason SourceLoad is one.
template <class T, class P> struct PixelLoad {
    const Frame& f;
    mutable i32 at_h, at_w;
    mutable float v[3];
    template <class N, class C, class H, class W>
    __device__ __forceinline__ typename Store<T::KIND>::T operator()(N, C c, H h, W w) const {
        if ((i32)h != at_h || (i32)w != at_w) {
            sample<P>(f, (i32)h, (i32)w, v);
            at_h = (i32)h;
            at_w = (i32)w;
        }
        const i32 k = (i32)c;
        return finish<T, P>(k == 0 ? v[0] : (k == 1 ? v[1] : v[2]), k);
    }
};

template <class T, class P, int VEC>
__device__ __forceinline__ void preprocess_body(const Frame& f, u8* __restrict__ dst) {
    store_body<T, VEC>(dst, PixelLoad<T, P>{f, -1, -1, {0, 0, 0}});
}
"""


def _bits(value: float) -> str:
    """float32(value), round to nearest even, as its bits (an infinity stays exact)."""
    with np.errstate(over="ignore"):
        return f"{int(np.float32(value).view(np.uint32)):#010x}u"


def _constants(index: int, pre: Preprocessing) -> str:
    """The struct P<index>: the frame format and normalization of one target."""
    lanes = _ORDERS[pre.order]
    # 0: packed, 1: nv12, 2: i420
    planar = _PLANAR.index(pre.source) + 1 if pre.source in _PLANAR else 0
    at = (0, 0, 0) if planar else tuple(_RGB_AT[pre.source][k] for k in lanes)
    bpp = 1 if planar else _PACKED[pre.source]
    # __post_init__ made mean and std three floats each
    mean = [_bits(value) for value in pre.mean]  # type: ignore[union-attr]
    std = [_bits(value) for value in pre.std]  # type: ignore[union-attr]
    black, gain, rv, gv, gu, bu = _YUV_COEFFICIENTS[pre.color_range]
    return f"""
struct P{index} {{  // {pre.source} ({pre.color_range} range), {pre.order}, {pre.resize}
    static constexpr int PLANAR = {planar};  // 0 packed, 1 nv12, 2 i420
    static constexpr i32 BLACK = {black}, GAIN = {gain};
    static constexpr i32 RV = {rv}, GV = {gv}, GU = {gu}, BU = {bu};
    static constexpr int BPP = {bpp}, AT0 = {at[0]}, AT1 = {at[1]}, AT2 = {at[2]};
    static constexpr int LANE0 = {lanes[0]}, LANE1 = {lanes[1]}, LANE2 = {lanes[2]};
    static constexpr int PAD = {pre.pad_value};
    static constexpr u32 SCALE = {_bits(pre.scale)};
    static constexpr u32 MEAN0 = {mean[0]}, MEAN1 = {mean[1]}, MEAN2 = {mean[2]};
    static constexpr u32 STD0 = {std[0]}, STD1 = {std[1]}, STD2 = {std[2]};
}};
"""


class PreprocessProgram(NamedTuple):
    source: str
    # per tensor: 16-byte vector stores (a 16-byte aligned buffer), element stores
    kernels: dict[TensorSpec, tuple[KernelPlan, KernelPlan]]
    preprocess: dict[TensorSpec, Preprocessing]


def plan_preprocess(targets: Sequence[tuple[TensorSpec, Preprocessing]]) -> PreprocessProgram:
    """The source of one program with a kernel pair per target, and their plans.

    ConfigurationError for a tensor the frames cannot feed (``check_target``);
    ValueError for one tensor given two different pre-processings, or strides a GPU
    load cannot follow.
    """
    parts = [CONVERSIONS, f"#define BLOCK {BLOCK}\n", KERNELS, PREPROCESS]
    kernels: dict[TensorSpec, tuple[KernelPlan, KernelPlan]] = {}
    chosen: dict[TensorSpec, Preprocessing] = {}
    arguments = ", ".join(f"{_TYPES.get(name, 'i64')} {name}" for name in PARAMETERS)
    for spec, pre in targets:
        if spec in chosen:
            if chosen[spec] != pre:
                raise ValueError(f"tensor {spec.name!r} is given two different ImagePreprocess")
            continue
        pre.check_target(spec)
        index = len(chosen)
        chosen[spec] = pre
        traits, _, _ = _traits(index, spec)
        parts += [traits, _constants(index, pre)]
        plans = []
        for vec in (_VEC, spec.numpy_dtype.itemsize):
            name = f"aiodla_preprocess_t{index}_v{vec}"
            grid = math.ceil(math.ceil(spec.size / vec) / BLOCK)
            parts.append(
                f'extern "C" __global__ void __launch_bounds__(BLOCK) {name}({arguments}) {{\n'
                "    const Frame f = {(const u8*)frame, pitch, (i32)frame_height, "
                "(i32)frame_width, (i32)top,\n"
                "                     (i32)left, (i32)rows, (i32)columns, sig_y, sig_x, "
                "(i32)exp_y, (i32)exp_x};\n"
                f"    preprocess_body<T{index}, P{index}, {vec}>(f, (u8*)dst);\n}}\n"
            )
            plans.append(KernelPlan(name, grid, vec == _VEC))
        kernels[spec] = (plans[0], plans[1])
    return PreprocessProgram("".join(parts), kernels, chosen)
