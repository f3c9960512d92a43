"""The CUDA C++ source of the detector post-processing kernels (:class:`~aiodla.Detect`):
the raw heads in their DLA buffers in, the kept detections out, on the slot's stream.

Five kernels a frame, each following :mod:`aiodla._detect_math`'s definition step by
step (every float operation rounded on its own: ``__fadd_rn`` and friends on the
device, ``-ffp-contract=off`` in the host build the tests compare with numpy):

1. ``reset``: the candidate counter and the two drop counters to 0.
2. ``decode``: one thread per cell of every head (steps 2-4), reading the heads' DLA
   layout directly (the conversion kernels' traits and element rules, so no unpack
   runs); a cell that passes takes a slot with an atomic counter, one dropped by step
   4 (not finite; with a frame, nothing inside it) adds one to its drop counter
   instead. The candidate list
   has a slot for every cell, so the counter can never pass its end: the cap of step
   5 is applied by rank, not by arrival order (which is not deterministic).
3. ``rank``: one thread per candidate counts the candidates ahead of it (score, then
   candidate index: a total order) and writes itself to that rank when it is below
   ``max_candidates``. O(n^2) in the candidates that passed ``conf``: a few hundred in
   practice; every cell at worst.
4. ``mask``: one thread per (sorted candidate i, 64-bit word w) sets bit b when
   candidate ``64 w + b`` after i overlaps it past ``iou`` (step 6), as torchvision's
   CUDA NMS builds its mask.
5. ``select``: one block runs the greedy pass over the sorted candidates, ORing each
   kept one's mask row into a removed set in shared memory, and writes the kept ones,
   mapped into the frame (step 7) when asked, to the output: ``count`` and the two
   drop counts (int32, padded to 16 bytes), then ``max_det`` boxes (4 float32), scores
   (float32), classes (int32).
   The host copies the output only.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._detect_math import CLAMP, LN2_HI, LN2_LO, LOG2E, POLY, iou_threshold32
from ._conversion_source import BLOCK, CONVERSIONS, KERNELS, _traits
from ._detect_output import output_layout

if TYPE_CHECKING:
    from .._detect import DetectPlan

__all__ = ["CANDIDATE_BYTES", "DetectProgram", "plan_detect"]

CANDIDATE_BYTES = 32  # struct Cand
_HEADER = 16  # the three counters, padded so that what follows stays 16-byte aligned
_KINDS = {"yolov5": 0, "yolov8": 1, "yolox": 2, "boxes": 3}

#: The decode kernel's arguments after ``work``, and the select kernel's after ``work``
#: and ``out``, every one 8 bytes: the geometry as float32 bits (left, top, scale_x,
#: scale_y), the frame's width and height, and whether there is a frame (0: boxes stay
#: in model-input pixels, none is dropped as outside).
SELECT_PARAMETERS = ("left", "top", "scale_x", "scale_y", "width", "height", "mapped")


def _bits(value: float) -> str:
    return f"{int(np.float32(value).view(np.uint32)):#010x}u"


DETECT = r"""
// ---- detector post-processing: host and device -----------------------------------------
namespace det {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
AIODLA_FN float add(float a, float b) { return __fadd_rn(a, b); }
AIODLA_FN float sub(float a, float b) { return __fsub_rn(a, b); }
AIODLA_FN float mul(float a, float b) { return __fmul_rn(a, b); }
AIODLA_FN float div(float a, float b) { return __fdiv_rn(a, b); }
AIODLA_FN float round_even(float x) { return rintf(x); }
AIODLA_FN u32 take_slot(u32* counter) { return atomicAdd(counter, 1u); }
#else
AIODLA_FN float add(float a, float b) { return a + b; }
AIODLA_FN float sub(float a, float b) { return a - b; }
AIODLA_FN float mul(float a, float b) { return a * b; }
AIODLA_FN float div(float a, float b) { return a / b; }
AIODLA_FN float round_even(float x) { return __builtin_rintf(x); }
AIODLA_FN u32 take_slot(u32* counter) { return __atomic_fetch_add(counter, 1u, __ATOMIC_RELAXED); }
#endif

AIODLA_FN float f(u32 bits) { return f32_bits(bits); }
AIODLA_FN bool finite(float x) { return (bits_f32(x) & 0x7f800000u) != 0x7f800000u; }

// Step 1.
AIODLA_FN float exp32(float x) {
    if (x != x) return x;
    x = x < -f(CLAMP) ? -f(CLAMP) : (x > f(CLAMP) ? f(CLAMP) : x);
    const float n = round_even(mul(x, f(LOG2E)));
    const float r = sub(sub(x, mul(n, f(LN2_HI))), mul(n, f(LN2_LO)));
    float p = f(P0);
    p = add(mul(p, r), f(P1));
    p = add(mul(p, r), f(P2));
    p = add(mul(p, r), f(P3));
    p = add(mul(p, r), f(P4));
    p = add(mul(p, r), f(P5));
    const float y = add(add(mul(p, mul(r, r)), r), 1.0f);
    return mul(y, f((u32)((i32)n + 127) << 23));
}
AIODLA_FN float sigmoid32(float x) { return div(1.0f, add(1.0f, exp32(-x))); }

struct Cand { float x1, y1, x2, y2, score; i32 cls; u32 id, pad; };

// Element (channel c, row y, column x) of batch 0 of a head in its DLA layout.
template <class T> AIODLA_FN float value(const u8* src, u64 c, u64 y, u64 x) {
    typedef typename Store<T::KIND>::T D;
    const u64 at = (c / T::LANES) * T::SURFACE + y * T::LINE + x * T::PIXEL
                   + (c % T::LANES) * T::ESIZE;
    return read_value<T, K_F32>(*reinterpret_cast<const D*>(src + at));
}

// Value k of candidate n of a "boxes" head H, the logical array read as a matrix (step
// 2): element k * N + n of it in C order (columns) or n * PER + k (rows).
template <class T, class H> AIODLA_FN float box_value(const u8* src, u64 n, u64 k) {
    const u64 i = H::ROWS ? n * H::PER + k : k * H::CANDIDATES + n;
    return value<T>(src, i / (H::TH * H::TW), (i / H::TW) % H::TH, i % H::TW);
}

// Step 3's class: the first largest of classes read(0) .. read(classes - 1) (NaN never
// wins).
template <class R> AIODLA_FN i32 best_class(R read, u32 classes, float* best) {
    i32 cls = 0;
    float top = f32_bits(0xff800000u);  // -inf
    for (u32 c = 0; c < classes; ++c) {
        const float v = read(c);
        if (v > top) { top = v; cls = (i32)c; }
    }
    *best = top;
    return cls;
}

struct Frame { float left, top, scale_x, scale_y, width, height; bool mapped; };

// Step 7 on one coordinate.
AIODLA_FN float to_frame(float v, float origin, float scale, float limit) {
    const float m = div(sub(v, origin), scale);
    return m < 0.0f ? 0.0f : (m > limit ? limit : m);
}

// Step 4's last rule: the box keeps an area once mapped into the frame and clipped.
AIODLA_FN bool inside(const float* b, const Frame& fr) {
    return to_frame(b[2], fr.left, fr.scale_x, fr.width) > to_frame(b[0], fr.left, fr.scale_x,
                                                                     fr.width)
           && to_frame(b[3], fr.top, fr.scale_y, fr.height) > to_frame(b[1], fr.top, fr.scale_y,
                                                                       fr.height);
}

// Steps 2-4 for cell `local` of head H (tensor traits T); a passing cell takes a slot.
template <class T, class H>
AIODLA_FN void decode_cell(const u8* src, u32 local, u8* work, const Frame& fr) {
    const u32 plane = H::HEIGHT * H::WIDTH;
    const u32 a = local / plane, rest = local % plane;
    const u64 y = rest / H::WIDTH, x = rest % H::WIDTH;
    const u64 base = (u64)a * H::PER;
    const float gx = (float)x, gy = (float)y, stride = f(H::STRIDE), conf = f(CONF);
    float best, score, b[4];
    i32 cls;
    if constexpr (H::KIND == 0) {  // yolov5
        const float objectness = sigmoid32(value<T>(src, base + 4, y, x));
        if (!(objectness > conf)) return;
        cls = best_class([&](u32 c) { return value<T>(src, base + 5 + c, y, x); }, H::CLASSES,
                         &best);
        score = mul(objectness, sigmoid32(best));
        if (!(score > conf)) return;
        float s[4];
        for (int k = 0; k < 4; ++k) s[k] = sigmoid32(value<T>(src, base + k, y, x));
        const float cx = mul(add(sub(mul(s[0], 2.0f), 0.5f), gx), stride);
        const float cy = mul(add(sub(mul(s[1], 2.0f), 0.5f), gy), stride);
        const float w = mul(mul(mul(s[2], 2.0f), mul(s[2], 2.0f)), H::aw(a));
        const float h = mul(mul(mul(s[3], 2.0f), mul(s[3], 2.0f)), H::ah(a));
        b[0] = sub(cx, mul(w, 0.5f)); b[1] = sub(cy, mul(h, 0.5f));
        b[2] = add(cx, mul(w, 0.5f)); b[3] = add(cy, mul(h, 0.5f));
    } else if constexpr (H::KIND == 1) {  // yolov8
        cls = best_class([&](u32 c) { return value<T>(src, 4 * H::REG + c, y, x); },
                         H::CLASSES, &best);
        score = sigmoid32(best);
        if (!(score > conf)) return;
        float d[4];
        for (u32 k = 0; k < 4; ++k) {
            float m = value<T>(src, k * H::REG, y, x);
            for (u32 j = 1; j < H::REG; ++j) {
                const float v = value<T>(src, k * H::REG + j, y, x);
                m = v > m ? v : m;
            }
            float total = 0.0f, moment = 0.0f;
            for (u32 j = 0; j < H::REG; ++j) {
                const float e = exp32(sub(value<T>(src, k * H::REG + j, y, x), m));
                total = add(total, e);
                moment = add(moment, mul(e, (float)j));
            }
            d[k] = div(moment, total);
        }
        const float ax = add(gx, 0.5f), ay = add(gy, 0.5f);
        b[0] = mul(sub(ax, d[0]), stride); b[1] = mul(sub(ay, d[1]), stride);
        b[2] = mul(add(ax, d[2]), stride); b[3] = mul(add(ay, d[3]), stride);
    } else if constexpr (H::KIND == 2) {  // yolox
        const float objectness = value<T>(src, base + 4, y, x);
        if (!(objectness > conf)) return;
        cls = best_class([&](u32 c) { return value<T>(src, base + 5 + c, y, x); }, H::CLASSES,
                         &best);
        score = mul(objectness, best);
        if (!(score > conf)) return;
        const float cx = mul(add(value<T>(src, base, y, x), gx), stride);
        const float cy = mul(add(value<T>(src, base + 1, y, x), gy), stride);
        const float w = mul(exp32(value<T>(src, base + 2, y, x)), stride);
        const float h = mul(exp32(value<T>(src, base + 3, y, x)), stride);
        b[0] = sub(cx, mul(w, 0.5f)); b[1] = sub(cy, mul(h, 0.5f));
        b[2] = add(cx, mul(w, 0.5f)); b[3] = add(cy, mul(h, 0.5f));
    } else {  // boxes: candidate `local`, whatever the layout
        cls = best_class([&](u32 c) { return box_value<T, H>(src, local, 4 + c); }, H::CLASSES,
                         &best);
        score = best;
        if (!(score > conf)) return;
        const float cx = box_value<T, H>(src, local, 0), cy = box_value<T, H>(src, local, 1);
        const float w = box_value<T, H>(src, local, 2), h = box_value<T, H>(src, local, 3);
        b[0] = sub(cx, mul(w, 0.5f)); b[1] = sub(cy, mul(h, 0.5f));
        b[2] = add(cx, mul(w, 0.5f)); b[3] = add(cy, mul(h, 0.5f));
    }
    u32* counters = reinterpret_cast<u32*>(work);  // passed, outside, not finite
    if (!(finite(score) && finite(b[0]) && finite(b[1]) && finite(b[2]) && finite(b[3]))) {
        take_slot(counters + 2);
        return;
    }
    // Before ranking and NMS: a box in the padding is no object of the frame, and must
    // neither take a place under the cap nor suppress a box that reaches into the frame.
    if (fr.mapped && !inside(b, fr)) {
        take_slot(counters + 1);
        return;
    }
    const u32 slot = take_slot(counters);
    if (slot >= CELLS) return;  // cannot happen (a slot per cell); never write past the list
    Cand* out = reinterpret_cast<Cand*>(work + CANDIDATES) + slot;
    *out = Cand{b[0], b[1], b[2], b[3], score, cls, H::OFFSET + local, 0u};
}

AIODLA_FN u32 passed(const u8* work) {
    const u32 count = *reinterpret_cast<const u32*>(work);
    return count < CELLS ? count : CELLS;
}

// Step 5: candidate i goes to its rank in (score descending, id ascending) if below CAP.
AIODLA_FN void rank_one(u8* work, u32 i) {
    const u32 n = passed(work);
    if (i >= n) return;
    const Cand* all = reinterpret_cast<const Cand*>(work + CANDIDATES);
    const Cand me = all[i];
    u32 rank = 0;
    for (u32 j = 0; j < n; ++j) {
        const Cand o = all[j];
        rank += (o.score > me.score || (o.score == me.score && o.id < me.id)) ? 1u : 0u;
    }
    if (rank < CAP) reinterpret_cast<Cand*>(work + SORTED)[rank] = me;
}

// Step 6's IoU of two boxes, in the stated order.
AIODLA_FN float iou(const Cand& a, const Cand& b) {
    const float area_a = mul(sub(a.x2, a.x1), sub(a.y2, a.y1));
    const float area_b = mul(sub(b.x2, b.x1), sub(b.y2, b.y1));
    float iw = sub(a.x2 < b.x2 ? a.x2 : b.x2, a.x1 > b.x1 ? a.x1 : b.x1);
    float ih = sub(a.y2 < b.y2 ? a.y2 : b.y2, a.y1 > b.y1 ? a.y1 : b.y1);
    iw = iw > 0.0f ? iw : 0.0f;
    ih = ih > 0.0f ? ih : 0.0f;
    const float inter = mul(iw, ih);
    return div(inter, sub(add(area_a, area_b), inter));
}

// Step 6's bitmask: word w of row i (candidates 64 w .. 64 w + 63 that i suppresses).
AIODLA_FN void mask_word(u8* work, u32 t) {
    const u32 i = t / WORDS, w = t % WORDS;
    const u32 count = passed(work), n = count < CAP ? count : CAP;
    if (i >= n) return;
    const Cand* sorted = reinterpret_cast<const Cand*>(work + SORTED);
    const Cand me = sorted[i];
    u64 bits = 0;
    for (u32 k = 0; k < 64; ++k) {
        const u32 j = w * 64 + k;
        if (j <= i || j >= n) continue;
        const Cand o = sorted[j];
        if ((AGNOSTIC || o.cls == me.cls) && iou(me, o) > f(IOU)) bits |= 1ull << k;
    }
    reinterpret_cast<u64*>(work + MASK)[(u64)i * WORDS + w] = bits;
}

// Steps 6 (the greedy pass) and 7, by one block: removed[] lives in shared memory. Every
// thread walks the same candidates; `gone` is read between the same barriers by all of
// them, so they agree on which are kept and meet at the same __syncthreads.
__device__ __forceinline__ void select_body(const u8* work, u8* out, const Frame& fr) {
    __shared__ u64 removed[WORDS];
    const u32 t = threadIdx.x;
    for (u32 w = t; w < WORDS; w += BLOCK) removed[w] = 0;
    __syncthreads();
    const u32 count = passed(work), n = count < CAP ? count : CAP;
    const Cand* sorted = reinterpret_cast<const Cand*>(work + SORTED);
    const u64* mask = reinterpret_cast<const u64*>(work + MASK);
    float* boxes = reinterpret_cast<float*>(out + OUT_BOXES);
    float* scores = reinterpret_cast<float*>(out + OUT_SCORES);
    i32* classes = reinterpret_cast<i32*>(out + OUT_CLASSES);
    u32 kept = 0;
    for (u32 i = 0; i < n && kept < MAX_DET; ++i) {
        if ((removed[i / 64] >> (i % 64)) & 1ull) continue;
        __syncthreads();  // every thread has read removed[] up to i
        for (u32 w = i / 64 + t; w < WORDS; w += BLOCK) removed[w] |= mask[(u64)i * WORDS + w];
        if (t == 0) {
            const Cand c = sorted[i];
            float b[4] = {c.x1, c.y1, c.x2, c.y2};
            if (fr.mapped) {
                b[0] = to_frame(b[0], fr.left, fr.scale_x, fr.width);
                b[1] = to_frame(b[1], fr.top, fr.scale_y, fr.height);
                b[2] = to_frame(b[2], fr.left, fr.scale_x, fr.width);
                b[3] = to_frame(b[3], fr.top, fr.scale_y, fr.height);
            }
            for (int k = 0; k < 4; ++k) boxes[kept * 4 + k] = b[k];
            scores[kept] = c.score;
            classes[kept] = c.cls;
        }
        ++kept;
        __syncthreads();  // the ORs are done before anyone reads removed[] again
    }
    if (t == 0) {
        i32* header = reinterpret_cast<i32*>(out);
        const u32* counters = reinterpret_cast<const u32*>(work);
        header[1] = (i32)counters[1];  // dropped outside the frame
        header[2] = (i32)counters[2];  // dropped as not finite
        header[0] = (i32)kept;
    }
}
}  // namespace det
"""


class DetectProgram(NamedTuple):
    source: str
    heads: int  # the decode kernel's head pointers, in the plan's order
    cells: int  # threads of the decode kernel
    work_bytes: int  # the scratch buffer a slot needs (16-byte aligned)
    out_bytes: int  # the output the host copies back
    grids: dict[str, int]  # kernel name -> blocks of BLOCK threads


def plan_detect(plan: DetectPlan) -> DetectProgram:
    """The source of one program for a matched :class:`~aiodla.Detect`, and its sizes.

    ValueError for a head tensor whose strides a GPU load cannot follow."""
    detect = plan.detect
    cells = plan.cells
    cap = detect.max_candidates
    words = math.ceil(cap / 64)
    candidates = _HEADER
    sorted_at = candidates + cells * CANDIDATE_BYTES
    mask_at = sorted_at + cap * CANDIDATE_BYTES
    work_bytes = mask_at + cap * words * 8
    max_det = detect.max_det
    out = output_layout(max_det)
    boxes_at, scores_at, classes_at, out_bytes = out.boxes, out.scores, out.classes, out.size
    constants = {
        "CLAMP": _bits(CLAMP), "LOG2E": _bits(LOG2E), "LN2_HI": _bits(LN2_HI),
        "LN2_LO": _bits(LN2_LO), **{f"P{k}": _bits(c) for k, c in enumerate(POLY)},
        "CONF": _bits(detect.conf), "IOU": _bits(float(iou_threshold32(detect.iou))),
        "CELLS": f"{cells}u", "CAP": f"{cap}u", "WORDS": f"{words}u", "MAX_DET": f"{max_det}u",
        "CANDIDATES": f"{candidates}u", "SORTED": f"{sorted_at}u", "MASK": f"{mask_at}u",
        "OUT_BOXES": f"{boxes_at}u", "OUT_SCORES": f"{scores_at}u",
        "OUT_CLASSES": f"{classes_at}u", "AGNOSTIC": str(detect.class_agnostic).lower(),
    }  # fmt: skip
    header = "namespace det {\n" + "".join(
        f"constexpr {'bool' if name == 'AGNOSTIC' else 'u32'} {name} = {value};\n"
        for name, value in constants.items()
    ) + "}\n"  # fmt: skip
    parts = [CONVERSIONS, f"#define BLOCK {BLOCK}\n", KERNELS, header, DETECT]
    branches = []
    for index, (spec, layout) in enumerate(zip(plan.specs, plan.layouts, strict=True)):
        traits, _, _ = _traits(index, spec)
        parts.append(traits)
        per = layout.classes + 4 if layout.kind == "boxes" else spec.shape[1] // len(layout.anchors)
        about = re.sub(r"[^A-Za-z0-9 _.:,x-]", "?", f"{layout.kind} head {spec.name}")
        parts.append(
            f"struct H{index} {{  // {about}\n"
            f"    static constexpr int KIND = {_KINDS[layout.kind]};\n"
            f"    static constexpr u32 HEIGHT = {layout.height}, WIDTH = {layout.width}, "
            f"PER = {per}, CLASSES = {layout.classes}, REG = {layout.reg_max};\n"
            f"    static constexpr u64 CANDIDATES = {layout.cells}, TH = {spec.shape[2]}, "
            f"TW = {spec.shape[3]};  // the tensor's height and width\n"
            f"    static constexpr bool ROWS = {str(layout.rows).lower()};\n"
            f"    static constexpr u32 OFFSET = {layout.offset}u, "
            f"STRIDE = {_bits(layout.stride)};\n"
            f"    {_anchor('aw', layout.anchors, 0)}\n    {_anchor('ah', layout.anchors, 1)}\n"
            "};\n"
        )
        first = layout.offset
        last = layout.offset + layout.cells
        branches.append(
            f"    if (i >= {first}u && i < {last}u) "
            f"det::decode_cell<T{index}, H{index}>((const u8*)h{index}, i - {first}u, (u8*)work, "
            "fr);\n"
        )
    heads = ", ".join(f"const void* h{index}" for index in range(len(plan.specs)))
    kernel = 'extern "C" __global__ void __launch_bounds__(BLOCK) '
    frame_parameters = (
        "u64 left, u64 top, u64 scale_x, u64 scale_y, u64 width, u64 height, u64 mapped"
    )
    frame = (
        "    const det::Frame fr = {f32_bits((u32)left), f32_bits((u32)top), "
        "f32_bits((u32)scale_x),\n"
        "                          f32_bits((u32)scale_y), f32_bits((u32)width), "
        "f32_bits((u32)height), mapped != 0};\n"
    )
    parts += [
        f"{kernel}aiodla_detect_reset(void* work) {{\n"
        "    if (blockIdx.x == 0 && threadIdx.x == 0) {\n"
        "        u32* counters = (u32*)work;  // passed, outside, not finite\n"
        "        counters[0] = counters[1] = counters[2] = 0;\n    }\n}\n",
        f"{kernel}aiodla_detect_decode({heads}, void* work, {frame_parameters}) {{\n"
        + frame
        + "    const u32 i = blockIdx.x * BLOCK + threadIdx.x;\n"
        + "".join(branches)
        + "}\n",
        f"{kernel}aiodla_detect_rank(void* work) {{\n"
        "    det::rank_one((u8*)work, blockIdx.x * BLOCK + threadIdx.x);\n}\n",
        f"{kernel}aiodla_detect_mask(void* work) {{\n"
        "    det::mask_word((u8*)work, blockIdx.x * BLOCK + threadIdx.x);\n}\n",
        f"{kernel}aiodla_detect_select(const void* work, void* out, {frame_parameters}) {{\n"
        + frame
        + "    det::select_body((const u8*)work, (u8*)out, fr);\n}\n",
    ]
    grids = {
        "aiodla_detect_reset": 1,
        "aiodla_detect_decode": math.ceil(cells / BLOCK),
        "aiodla_detect_rank": math.ceil(cells / BLOCK),
        "aiodla_detect_mask": math.ceil(cap * words / BLOCK),
        "aiodla_detect_select": 1,
    }
    work_bytes += -work_bytes % 16
    return DetectProgram("".join(parts), len(plan.specs), cells, work_bytes, out_bytes, grids)


def _anchor(name: str, anchors: tuple[tuple[float, float], ...], axis: int) -> str:
    """A member function returning one side (0: w, 1: h) of anchor ``a`` as a float32:
    a chain of comparisons, since a constexpr array is not readable from device code."""
    cases = " ".join(
        f"if (a == {k}) return det::f({_bits(pair[axis])});" for k, pair in enumerate(anchors)
    )
    return f"static __device__ __forceinline__ float {name}(u32 a) {{ {cases} return 0.0f; }}"
