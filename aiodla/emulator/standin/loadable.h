/* The emulator loadable parser of the GPU stand-in (host code).
 *
 * It accepts exactly what aiodla.emulator._format.parse_loadable accepts, and rejects
 * the rest with a sentence: the format is written out in that module's docstring. The
 * layout checks matter for more than agreement: the kernel writes every element at the
 * offset the strides give, so a descriptor whose elements reach past its `size` would
 * let a task write outside the registered buffer. Every size is checked against the
 * blob's length before it is read.
 */
#ifndef AIODLA_STANDIN_LOADABLE_H
#define AIODLA_STANDIN_LOADABLE_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <vector>

#include "cudla_abi.h"
#include "task_math.h"

namespace aiodla_standin {

constexpr size_t kHeaderSize = 64;
constexpr size_t kRecordSize = 168;
constexpr uint32_t kVersion = 1;
constexpr uint32_t kParamCount = 2;
constexpr double kMaxLatency = 3600.0;
constexpr uint64_t kMaxDim = 1ull << 16;
constexpr uint64_t kMaxTensorBytes = 1ull << 34;
constexpr size_t kNameMaxBytes = 80;

constexpr uint8_t kFormatNchw = 1;
constexpr uint8_t kFormatNhwc = 2;
constexpr uint8_t kFormatNcxhwx = 3;
constexpr uint8_t kCategoryImage = 0;

struct ParsedModule {
    ModuleTable table;
    double latency = 0.0;
    std::vector<cudlaModuleTensorDescriptor> inputs;
    std::vector<cudlaModuleTensorDescriptor> outputs;
};

inline uint32_t read_u32(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);  /* the stand-in only builds for little-endian hosts */
    return v;
}

inline uint64_t read_u64(const uint8_t* p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

inline double read_f64(const uint8_t* p) {
    double v;
    memcpy(&v, p, sizeof v);
    return v;
}

inline uint32_t element_size(uint32_t type) {
    switch (type) {
        case kTypeFloat: return 4;
        case kTypeHalf: return 2;
        case kTypeInt16: return 2;
        case kTypeInt8: return 1;
        case kTypeUint8: return 1;
        case kTypeUint16: return 2;
        default: return 0;
    }
}

inline std::string describe(const char* format, ...) __attribute__((format(printf, 1, 2)));
inline std::string describe(const char* format, ...) {
    char buffer[256];
    va_list args;
    va_start(args, format);
    vsnprintf(buffer, sizeof buffer, format, args);
    va_end(args);
    return buffer;
}

/* Which element types the DLA accepts in which layout (aiodla._tensors' table). */
inline bool format_accepts(const char* format, uint32_t type) {
    if (!strcmp(format, "chw16")) return type == kTypeHalf;
    if (!strcmp(format, "chw32")) return type == kTypeInt8;
    if (!strcmp(format, "hwc4")) return type == kTypeInt8 || type == kTypeUint8 || type == kTypeHalf;
    return element_size(type) != 0;  /* nchw and nhwc take all six */
}

/* One record's layout, as TensorSpec.from_descriptor and TensorSpec.__post_init__ check it. */
inline bool check_layout(const cudlaModuleTensorDescriptor& d, TensorLayout* out,
                         std::string* why) {
    const uint32_t esize = element_size(d.dataType);
    if (!esize) {
        *why = describe("dataType %u is not a DLA element type", d.dataType);
        return false;
    }
    for (int i = 4; i < 8; ++i) {
        if (d.stride[i]) {
            *why = "stride[4:8] must be zero";
            return false;
        }
    }
    if (d.pixelMapping != 0) {
        *why = describe("pixelMapping %u (block linear) is not supported", d.pixelMapping);
        return false;
    }
    const uint64_t pixel = d.stride[0], line = d.stride[1], surface = d.stride[2],
                   batch = d.stride[3];
    const uint64_t lanes = pixel % esize == 0 ? pixel / esize : 0;
    const char* format;
    if (d.dataFormat == kFormatNchw) {
        format = "nchw";
    } else if (d.dataFormat == kFormatNhwc) {
        format = (d.dataCategory == kCategoryImage && lanes == 4) ? "hwc4" : "nhwc";
    } else if (d.dataFormat == kFormatNcxhwx) {
        if (lanes == 16) {
            format = "chw16";
        } else if (lanes == 32) {
            format = "chw32";
        } else {
            *why = describe("NCxHWx needs 16 or 32 lanes per pixel, stride[0]=%u", d.stride[0]);
            return false;
        }
    } else {
        *why = describe("dataFormat %u is unknown", d.dataFormat);
        return false;
    }
    if (d.n < 1 || d.c < 1 || d.h < 1 || d.w < 1) {
        *why = "shape must be four dimensions >= 1";
        return false;
    }
    if (!format_accepts(format, d.dataType)) {
        *why = describe("the DLA does not accept dataType %u in format %s", d.dataType, format);
        return false;
    }
    if (!strcmp(format, "hwc4") && d.c != 1 && d.c != 3 && d.c != 4) {
        *why = "hwc4 image input needs c in (1, 3, 4)";
        return false;
    }
    if (pixel < esize || pixel % esize) {
        *why = describe("pixel stride %u is not a multiple of %u bytes", d.stride[0], esize);
        return false;
    }
    const uint64_t want_lanes = !strcmp(format, "nchw")    ? 1
                                : !strcmp(format, "chw16") ? 16
                                : !strcmp(format, "chw32") ? 32
                                : !strcmp(format, "hwc4")  ? 4
                                                           : 0;
    if (want_lanes && lanes != want_lanes) {
        *why = describe("%s needs %llu lanes per pixel", format,
                        static_cast<unsigned long long>(want_lanes));
        return false;
    }
    if (!want_lanes && lanes < d.c) {
        *why = "NHWC needs stride[0] >= c * element size";
        return false;
    }
    const uint64_t groups = (d.c + lanes - 1) / lanes;
    if (line < d.w * pixel) {
        *why = "line stride < w * pixel stride";
        return false;
    }
    if (surface < d.h * line) {
        *why = "surface stride < h * line stride";
        return false;
    }
    if (batch < groups * surface) {
        *why = "batch stride < channel groups * surface stride";
        return false;
    }
    const uint64_t extent =
        (d.n - 1) * batch + (groups - 1) * surface + (d.h - 1) * line + d.w * pixel;
    if (d.size < extent) {
        *why = describe("size %llu bytes < the %llu bytes the layout spans",
                        static_cast<unsigned long long>(d.size),
                        static_cast<unsigned long long>(extent));
        return false;
    }
    out->size = d.size;
    out->n = static_cast<uint32_t>(d.n);
    out->c = static_cast<uint32_t>(d.c);
    out->h = static_cast<uint32_t>(d.h);
    out->w = static_cast<uint32_t>(d.w);
    out->pixel = d.stride[0];
    out->line = d.stride[1];
    out->surface = d.stride[2];
    out->batch = d.stride[3];
    out->lanes = static_cast<uint32_t>(lanes);
    out->type = d.dataType;
    out->esize = esize;
    out->reserved = 0;
    return true;
}

/* Parse `data`; on failure return false and say why. */
inline bool parse_loadable(const uint8_t* data, size_t size, ParsedModule* module,
                           std::string* why) {
    if (!data) {
        *why = "no loadable bytes";
        return false;
    }
    if (size < kHeaderSize) {
        *why = describe("%zu bytes is shorter than the 64-byte header", size);
        return false;
    }
    if (memcmp(data, "AIODLAEM", 8) != 0) {
        *why = "bad magic";
        return false;
    }
    const uint32_t version = read_u32(data + 8), header_size = read_u32(data + 12),
                   num_inputs = read_u32(data + 16), num_outputs = read_u32(data + 20),
                   op = read_u32(data + 24), param_count = read_u32(data + 28);
    const double latency = read_f64(data + 32);
    const uint64_t total_size = read_u64(data + 40);
    if (version != kVersion) {
        *why = describe("version %u is not supported", version);
        return false;
    }
    if (header_size != kHeaderSize) {
        *why = describe("header_size %u, expected 64", header_size);
        return false;
    }
    if (read_u64(data + 48) || read_u64(data + 56)) {
        *why = "reserved header fields must be zero";
        return false;
    }
    if (num_inputs < 1 || num_inputs > kMaxPairs || num_outputs < 1 || num_outputs > kMaxPairs) {
        *why = describe("tensor counts %u/%u must each be 1..64", num_inputs, num_outputs);
        return false;
    }
    if (op != kOpAffine && op != kOpMeanHw && op != kOpMix && op != kOpDetect) {
        *why = describe("op code %u is unknown", op);
        return false;
    }
    if (param_count != kParamCount) {
        *why = describe("param_count %u, expected 2", param_count);
        return false;
    }
    if (!(isfinite(latency) && latency >= 0.0 && latency <= kMaxLatency)) {
        *why = "latency must be seconds in [0, 3600]";
        return false;
    }
    const size_t records_at = kHeaderSize + 8 * kParamCount;
    const uint64_t expected = records_at + kRecordSize * (uint64_t(num_inputs) + num_outputs);
    if (total_size != expected) {
        *why = describe("total_size %llu does not match the %llu bytes its counts need",
                        static_cast<unsigned long long>(total_size),
                        static_cast<unsigned long long>(expected));
        return false;
    }
    if (size != expected) {
        *why = describe("%zu bytes, but the header describes %llu", size,
                        static_cast<unsigned long long>(expected));
        return false;
    }
    const double scale = read_f64(data + kHeaderSize), bias = read_f64(data + kHeaderSize + 8);
    if (!(isfinite(scale) && isfinite(bias))) {
        *why = "parameters scale and bias must be finite";
        return false;
    }
    const uint32_t count = num_inputs + num_outputs;
    std::vector<cudlaModuleTensorDescriptor> records(count);
    for (uint32_t i = 0; i < count; ++i) {
        cudlaModuleTensorDescriptor& d = records[i];
        memcpy(&d, data + records_at + kRecordSize * i, kRecordSize);
        const void* nul = memchr(d.name, 0, sizeof d.name);
        if (!nul) {
            *why = describe("tensor record %u: name is not NUL-terminated within 81 bytes", i);
            return false;
        }
        const size_t length = static_cast<const char*>(nul) - d.name;
        if (length == 0 || length > kNameMaxBytes) {
            *why = describe("tensor record %u: name must be 1-80 bytes", i);
            return false;
        }
        for (size_t b = 0; b < length; ++b) {
            const unsigned char ch = static_cast<unsigned char>(d.name[b]);
            if (ch <= 0x20 || ch >= 0x7f) {
                *why = describe("tensor record %u: name must be printable ASCII", i);
                return false;
            }
        }
    }
    for (uint32_t i = 0; i < count; ++i) {
        const cudlaModuleTensorDescriptor& d = records[i];
        if (d.n > kMaxDim || d.c > kMaxDim || d.h > kMaxDim || d.w > kMaxDim ||
            d.size > kMaxTensorBytes) {
            *why = describe("tensor %s: dimensions or size beyond any DLA tensor", d.name);
            return false;
        }
    }
    ModuleTable& table = module->table;
    memset(&table, 0, sizeof table);
    for (uint32_t i = 0; i < count; ++i) {
        TensorLayout* layout = i < num_inputs ? &table.inputs[i] : &table.outputs[i - num_inputs];
        std::string problem;
        if (!check_layout(records[i], layout, &problem)) {
            *why = describe("tensor %s: ", records[i].name) + problem;
            return false;
        }
    }
    const bool digest = op == kOpMix || op == kOpDetect; /* any shapes: outputs from a digest */
    if (!digest && num_inputs != num_outputs) {
        *why = "the op pairs input i with output i: counts differ";
        return false;
    }
    for (uint32_t i = 0; i < count; ++i) {
        for (uint32_t j = i + 1; j < count; ++j) {
            if (!strcmp(records[i].name, records[j].name)) {
                *why = describe("tensor name %s appears twice", records[i].name);
                return false;
            }
        }
    }
    for (uint32_t i = 0; op == kOpDetect && i < num_outputs; ++i) { /* detector heads */
        const TensorLayout& dst = table.outputs[i];
        const bool real = dst.type == kTypeHalf || dst.type == kTypeFloat;
        if (!real || dst.n != 1 || dst.c % kDetectAnchors || dst.c / kDetectAnchors < 6) {
            *why = describe("op detect: output %s must be a float16/float32 head of shape "
                            "(1, 3*(5+k), H, W) with k >= 1 classes",
                            records[num_inputs + i].name);
            return false;
        }
    }
    for (uint32_t i = 0; !digest && i < num_inputs; ++i) {
        const TensorLayout& src = table.inputs[i];
        const TensorLayout& dst = table.outputs[i];
        const bool mean = op == kOpMeanHw;
        if (dst.n != src.n || dst.c != src.c || dst.h != (mean ? 1u : src.h) ||
            dst.w != (mean ? 1u : src.w)) {
            *why = describe("output %s has the wrong shape for input %s",
                            records[num_inputs + i].name, records[i].name);
            return false;
        }
    }
    table.op = op;
    table.num_inputs = num_inputs;
    table.num_outputs = num_outputs;
    table.scale = scale;
    table.bias = bias;
    module->latency = latency;
    module->inputs.assign(records.begin(), records.begin() + num_inputs);
    module->outputs.assign(records.begin() + num_inputs, records.end());
    return true;
}

}  // namespace aiodla_standin

#endif /* AIODLA_STANDIN_LOADABLE_H */
