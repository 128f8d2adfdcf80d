"""Native quantize/dequantize kernels for FP8, NVFP4 and MX, bit-exact with the references.

The C here mirrors the plain-torch references in :mod:`torchport.lowp.fp8`, ``nvfp4`` and ``mx``
step by step in float32 (same operations, same order, IEEE division where the reference divides),
so results match bit for bit; tests compare them over shape grids and random bit patterns.
Rows are independent and split over threads. Every kernel returns 1 (and writes garbage-free
partial output the caller discards) if it meets a non-finite input.
"""

from __future__ import annotations

import functools

import torch

from torchport import native
from torchport.native import FloatArg, IntArg, Kernel, TensorArg

_SOURCE = r"""
/* ---- element casts (inputs already clamped to the format's range and finite) ---- */
TP_INLINE uint32_t tp_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
TP_INLINE float tp_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

TP_INLINE uint8_t tp_f32_to_e4m3(float x) {
    uint32_t u = tp_bits(x), sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    if (u < 0x3c800000u) {                 /* below 2^-6: subnormal steps of 2^-9 */
        float m = nearbyintf(tp_float(u) * 512.0f);
        return (uint8_t)(sign | (uint32_t)m);
    }
    uint32_t r = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20;   /* RNE to 3 mantissa bits */
    r -= 120u << 3;                        /* rebias exponent 127 -> 7 */
    if (r > 0x7eu) r = 0x7eu;              /* saturate at 448 */
    return (uint8_t)(sign | r);
}

TP_INLINE uint8_t tp_f32_to_e5m2(float x) {
    uint32_t u = tp_bits(x), sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    if (u < 0x38800000u) {                 /* below 2^-14: subnormal steps of 2^-16 */
        float m = nearbyintf(tp_float(u) * 65536.0f);
        return (uint8_t)(sign | (uint32_t)m);
    }
    uint32_t r = (u + 0xfffffu + ((u >> 21) & 1u)) >> 21;   /* RNE to 2 mantissa bits */
    r -= 112u << 2;                        /* rebias exponent 127 -> 15 */
    if (r > 0x7bu) r = 0x7bu;              /* saturate at 57344 */
    return (uint8_t)(sign | r);
}

TP_INLINE float tp_e4m3_to_f32(uint8_t b) {
    uint32_t e = (b >> 3) & 15u, m = b & 7u;
    float v = e ? tp_float(((e + 120u) << 23) | (m << 20)) : (float)m * (1.0f / 512.0f);
    return (b & 0x80u) ? -v : v;
}

TP_INLINE float tp_e5m2_to_f32(uint8_t b) {
    uint32_t e = (b >> 2) & 31u, m = b & 3u;
    float v = e ? tp_float(((e + 112u) << 23) | (m << 21)) : (float)m * (1.0f / 65536.0f);
    return (b & 0x80u) ? -v : v;
}

/* E2M1 code: RNE with ties to the even code, saturating at 6, sign of zero kept */
TP_INLINE uint8_t tp_f32_to_e2m1(float x) {
    float a = fabsf(x);
    uint8_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return (uint8_t)(c | ((tp_bits(x) >> 28) & 8u));
}
static const float TP_E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

TP_INLINE float tp_e8m0_to_f32(uint8_t e) {
    if (e == 255) return NAN;
    return e ? tp_float((uint32_t)e << 23) : tp_float(0x00400000u);
}

TP_INLINE float tp_clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

${load_macro}

/* ---- NVFP4 (torchao nvfp4_quantize): per 16-block amax/6 -> E4M3 scale, data / scale -> E2M1 ---- */
TP_EXPORT int tp_nvfp4_quant(const IN_T *x, uint8_t *q, uint8_t *scales, int64_t rows, int64_t k,
                             double pts_d, int64_t has_pts, int64_t nthreads) {
    const float pts = (float)pts_d;
    const int64_t nb = k / 16;
    int bad = 0;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static) reduction(|:bad)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const IN_T *src = x + r * k + b * 16;
            float v[16], amax = 0.0f;
            for (int i = 0; i < 16; ++i) {
                v[i] = LOAD_IN(src + i);
                if (!isfinite(v[i])) bad = 1;
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            float bs = amax / 6.0f, total;
            uint8_t s8;
            if (has_pts) {
                s8 = tp_f32_to_e4m3(tp_clampf(bs / pts, 0.015625f, 448.0f));
                total = pts * tp_e4m3_to_f32(s8);
            } else {
                s8 = tp_f32_to_e4m3(tp_clampf(bs, 0.015625f, 448.0f));
                total = tp_e4m3_to_f32(s8);
            }
            scales[r * nb + b] = s8;
            uint8_t *dst = q + r * (k / 2) + b * 8;
            for (int i = 0; i < 8; ++i) {
                uint8_t lo = tp_f32_to_e2m1(tp_clampf(v[2 * i] / total, -6.0f, 6.0f));
                uint8_t hi = tp_f32_to_e2m1(tp_clampf(v[2 * i + 1] / total, -6.0f, 6.0f));
                dst[i] = (uint8_t)(lo | (hi << 4));
            }
        }
    }
    return bad;
}

/* ---- MX (OCP MX v1.0, torchao to_mx FLOOR): E8M0 = floor(log2 amax) - emax(elem), data * 2^-scale ---- */
/* elem: 0 = FP4 E2M1 (packed), 1 = FP8 E4M3FN, 2 = FP8 E5M2 */
TP_EXPORT int tp_mx_quant(const IN_T *x, uint8_t *q, uint8_t *scales, int64_t rows, int64_t k,
                          int64_t elem, int64_t nthreads) {
    const int64_t nb = k / 32;
    const int target = elem == 0 ? 2 : (elem == 1 ? 8 : 15);
    const float maxpos = elem == 0 ? 6.0f : (elem == 1 ? 448.0f : 57344.0f);
    int bad = 0;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static) reduction(|:bad)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const IN_T *src = x + r * k + b * 32;
            float v[32], amax = 0.0f;
            for (int i = 0; i < 32; ++i) {
                v[i] = LOAD_IN(src + i);
                if (!isfinite(v[i])) bad = 1;
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            int e = (int)((tp_bits(amax) >> 23) & 0xffu) - 127 - target;
            e = e < -127 ? -127 : (e > 128 ? 128 : e);
            uint8_t s = (uint8_t)(e + 127);
            scales[r * nb + b] = s;
            uint8_t rb = (uint8_t)(254 - (int)s);
            float inv = rb ? tp_float((uint32_t)rb << 23) : tp_float(0x00400000u);
            if (elem == 0) {
                uint8_t *dst = q + r * (k / 2) + b * 16;
                for (int i = 0; i < 16; ++i) {
                    uint8_t lo = tp_f32_to_e2m1(v[2 * i] * inv), hi = tp_f32_to_e2m1(v[2 * i + 1] * inv);
                    dst[i] = (uint8_t)(lo | (hi << 4));
                }
            } else {
                uint8_t *dst = q + r * k + b * 32;
                for (int i = 0; i < 32; ++i) {
                    float y = tp_clampf(v[i] * inv, -maxpos, maxpos);
                    dst[i] = elem == 1 ? tp_f32_to_e4m3(y) : tp_f32_to_e5m2(y);
                }
            }
        }
    }
    return bad;
}

/* ---- FP8 per row (torchao float8 recipe): s = max(amax, lb) / max, q = clamp(x / s) ---- */
/* rowwise = 0: one scale for the whole tensor, given in scale[0] (computed by the caller) */
TP_EXPORT int tp_fp8_quant(const IN_T *x, uint8_t *q, float *scale, int64_t rows, int64_t k,
                           int64_t e5m2, int64_t rowwise, int64_t nthreads) {
    const float maxpos = e5m2 ? 57344.0f : 448.0f;
    int bad = 0;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static) reduction(|:bad)
    for (int64_t r = 0; r < rows; ++r) {
        const IN_T *src = x + r * k;
        float s;
        if (rowwise) {
            float amax = 0.0f;
            for (int64_t i = 0; i < k; ++i) {
                float v = LOAD_IN(src + i);
                if (!isfinite(v)) bad = 1;
                float a = fabsf(v);
                amax = a > amax ? a : amax;
            }
            s = (amax > 1e-12f ? amax : 1e-12f) / maxpos;
            scale[r] = s;
        } else {
            s = scale[0];
        }
        for (int64_t i = 0; i < k; ++i) {
            float y = tp_clampf(LOAD_IN(src + i) / s, -maxpos, maxpos);
            q[r * k + i] = e5m2 ? tp_f32_to_e5m2(y) : tp_f32_to_e4m3(y);
        }
    }
    return bad;
}

/* ---- dequantize to float32 ---- */
/* fmt: 0 = NVFP4 (E4M3 scales / 16, times pts), 1 = MXFP4, 2 = MX E4M3, 3 = MX E5M2 (E8M0 / 32) */
TP_EXPORT int tp_block_dequant(const uint8_t *q, const uint8_t *scales, float *out, int64_t rows,
                               int64_t k, int64_t fmt, double pts_d, int64_t nthreads) {
    const float pts = (float)pts_d;
    const int64_t bl = fmt == 0 ? 16 : 32, nb = k / bl;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t sb = scales[r * nb + b];
            float s = fmt == 0 ? pts * tp_e4m3_to_f32(sb) : tp_e8m0_to_f32(sb);
            float *o = out + r * k + b * bl;
            if (fmt <= 1) {
                const uint8_t *p = q + r * (k / 2) + b * (bl / 2);
                for (int i = 0; i < bl / 2; ++i) {
                    o[2 * i] = TP_E2M1[p[i] & 15] * s;
                    o[2 * i + 1] = TP_E2M1[p[i] >> 4] * s;
                }
            } else {
                const uint8_t *p = q + r * k + b * bl;
                for (int i = 0; i < bl; ++i) o[i] = (fmt == 2 ? tp_e4m3_to_f32(p[i]) : tp_e5m2_to_f32(p[i])) * s;
            }
        }
    }
    return 0;
}
"""

_LOAD = {
    torch.float32: "#define IN_T float\n#define LOAD_IN(p) (*(p))",
    torch.bfloat16: "#define IN_T uint16_t\n#define LOAD_IN(p) tp_bf16_to_f32(*(p))",
}
_TAG = {torch.float32: "f32", torch.bfloat16: "bf16"}
IN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def library(dtype: torch.dtype) -> object:
    """The compiled quantization library for input ``dtype`` (raises NativeError if unbuildable)."""
    src = native.render(_SOURCE, load_macro=_LOAD[dtype])
    return native.build(src, name=f"lowp_quant_{_TAG[dtype]}")


@functools.cache
def kernel(name: str, dtype: torch.dtype = torch.float32) -> Kernel:
    """One bound kernel of the quantization library for input ``dtype``."""
    lib = library(dtype)
    u8, f32 = (torch.uint8,), (torch.float32,)
    x = TensorArg("x", (dtype,))
    specs: dict[str, list[native.launch.ArgSpec]] = {
        "tp_nvfp4_quant": [
            x,
            TensorArg("q", u8),
            TensorArg("scales", u8),
            IntArg("rows"),
            IntArg("k"),
            FloatArg("pts"),
            IntArg("has_pts"),
            IntArg("nthreads"),
        ],
        "tp_mx_quant": [
            x,
            TensorArg("q", u8),
            TensorArg("scales", u8),
            IntArg("rows"),
            IntArg("k"),
            IntArg("elem"),
            IntArg("nthreads"),
        ],
        "tp_fp8_quant": [
            x,
            TensorArg("q", u8),
            TensorArg("scale", f32),
            IntArg("rows"),
            IntArg("k"),
            IntArg("e5m2"),
            IntArg("rowwise"),
            IntArg("nthreads"),
        ],
        "tp_block_dequant": [
            TensorArg("q", u8),
            TensorArg("scales", u8),
            TensorArg("out", f32),
            IntArg("rows"),
            IntArg("k"),
            IntArg("fmt"),
            FloatArg("pts"),
            IntArg("nthreads"),
        ],
    }
    return Kernel(lib, name, specs[name])  # type: ignore[arg-type]


def run(name: str, dtype: torch.dtype, *args: object) -> int:
    """Call a kernel without raising on status (status 1 = non-finite input)."""
    k = kernel(name, dtype)
    raw: list[object] = []
    for spec, v in zip(k.args, args):
        if isinstance(spec, TensorArg):
            assert isinstance(v, torch.Tensor)
            native.check_tensor(spec, v, k.name)
            raw.append(v.data_ptr())
        else:
            raw.append(v)
    return k.call_unchecked(*raw)
