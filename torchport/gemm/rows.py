"""C template of the row-streaming small-M GEMM driver: the decode GEMV's structure in the engine.

``C[M, N] = epilogue(A[M, K] @ B[K, N])`` for a few rows ``M`` (at most :data:`MAX_M`), with
``B`` packed as *rows*: ``B^T`` contiguous, ``[N, K]`` (``pack_b(b, 1)``: panels one column wide,
in 2 MiB pages from 4 MiB up, through the same packed-weight cache as the panel tiles). An
``nn.Linear`` weight is that layout already; the packed copy is what puts it in huge pages.

Structure (the GEMV's, :mod:`torchport.gemv.kernels`): each step reads four weight rows side by
side, four sequential streams per thread with a non-temporal software prefetch ``pf`` bytes ahead
of each (0: none), against ``MR`` rows of ``A`` (1 or 2, :data:`ROW_TILES`; more rows of ``A``
re-read the four weight rows from L1/L2); ``MR x 4`` vector accumulators, reduced horizontally
into four sums per row of ``A`` at the end of ``K``. Threads claim blocks of :data:`BLOCK` weight
rows dynamically (chunks as the panel driver's); a block's sums go to a stack buffer, then the
fused epilogue (``tp_epi_v``, the same one the panel tiles apply) runs over it vector by vector
and stores ``C``. ``A`` is float32 with unit column stride (the launcher widens bf16 ``A`` and
copies other strides); ``B`` float32 or bfloat16 (widened in registers).

Numerics: float32 accumulation over all of ``K`` as the panel tiles, but in ``VWIDTH`` partial
sums per output that are added at the end (a different summation order; the same error bound,
:func:`torchport.gemm.kernels.mm_reference` is the reference).
"""

from __future__ import annotations

from torchport.gemm import templates
from torchport.gemm.epilogue import EpilogueSpec

# rows of A per register block: MR x 4 accumulators + 4 weight vectors + 1 of A fit the 16 ymm
ROW_TILES = (1, 2)
# most rows of A the driver takes (its stack buffer holds MAX_M x BLOCK sums)
MAX_M = 8
# weight rows per block: the unit threads claim and the epilogue pass runs over
BLOCK = 64
WROWS = 4  # weight rows streamed side by side


def _rtile(mr: int, wr: int, vw: int, btag: str, esize: int) -> str:
    """``mr`` rows of ``A`` against ``wr`` (4 or 1) weight rows over all of ``K``: the sums go to
    ``S[r * lds + q]``."""
    lines = max(1, 2 * vw * esize // 64)  # 64-byte lines per weight row per step of 2 vectors

    def step(h: int) -> list[str]:
        out = [f"            VEC b{q}_{h} = VLOAD_{btag}(w{q} + k + {h * vw});" for q in range(wr)]
        for r in range(mr):
            out.append(f"            {{ VEC a = VLOAD_f32(A + {r} * lda + k + {h * vw});")
            out += [f"              acc{r}_{q} = VFMA(a, b{q}_{h}, acc{r}_{q});" for q in range(wr)]
            out.append("            }")
        return out

    pf = [
        f"            _mm_prefetch((const char *)(w{q} + k) + pf + {64 * c}, _MM_HINT_NTA);"
        for q in range(wr)
        for c in range(lines)
    ]
    body = step(0) + step(1)
    head = [
        f"static void rtile_{mr}x{wr}(const float *A, int64_t lda, const btype_t *W, int64_t ldw,",
        "        int64_t K, int64_t pf, float *S, int64_t lds) {",
        *[f"    const btype_t *w{q} = W + {q} * ldw;" for q in range(wr)],
        *[f"    VEC acc{r}_{q} = VZERO();" for r in range(mr) for q in range(wr)],
        "    int64_t k = 0;",
        "    if (pf) {",
        f"        for (; k + {2 * vw} <= K; k += {2 * vw}) {{",
        *pf,
        *body,
        "        }",
        "    } else {",
        f"        for (; k + {2 * vw} <= K; k += {2 * vw}) {{",
        *body,
        "        }",
        "    }",
        f"    for (; k + {vw} <= K; k += {vw}) {{",
        *step(0),
        "    }",
    ]
    tail = []
    for r in range(mr):
        if wr == 4:
            sums = ", ".join(f"acc{r}_{q}" for q in range(4))
            tail.append(f"    _mm_storeu_ps(S + {r} * lds, tp_rsum4({sums}));")
        else:
            tail.append(f"    S[{r} * lds] = tp_rsum1(acc{r}_0);")
    tail += [
        "    for (; k < K; ++k)",
        f"        for (int r = 0; r < {mr}; ++r) {{",
        "            const float a = A[r * lda + k];",
        *[f"            S[r * lds + {q}] += a * SLOAD_{btag}(w{q} + k);" for q in range(wr)],
        "        }",
        "}",
    ]
    return "\n".join(head + tail)


_REDUCE = r"""
/* 256-bit halves of a vector added (AVX-512), the vector itself (AVX2) */
#if VWIDTH == 16
TP_INLINE __m256 tp_r_half(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
#define tp_r_half(v) (v)
#endif
/* [sum a0, sum a1, sum a2, sum a3] */
TP_INLINE __m128 tp_rsum4(VEC a0, VEC a1, VEC a2, VEC a3) {
    __m256 t0 = _mm256_hadd_ps(tp_r_half(a0), tp_r_half(a1));
    __m256 t1 = _mm256_hadd_ps(tp_r_half(a2), tp_r_half(a3));
    __m256 t = _mm256_hadd_ps(t0, t1);
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
TP_INLINE float tp_rsum1(VEC a) {
    __m256 h = tp_r_half(a);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
"""


def _driver(mr: int) -> str:
    return f"""
/* C[M, N] (row stride ldc) = epilogue(A[M, K] (row stride lda, unit column stride) @ W^T), W the
   [N, K] weight rows (row stride ldw); M <= {MAX_M}. Returns 1 for a larger M. */
TP_EXPORT int tp_gemm_rows_{mr}(otype_t *C, int64_t ldc, const float *A, int64_t lda,
        const btype_t *W, int64_t ldw, int64_t M, int64_t N, int64_t K, int64_t pf,
        const void *const *ep, const int64_t *eld, int64_t nthreads) {{
    if (M <= 0 || N <= 0) return 0;
    if (M > {MAX_M} || pf < 0) return 1;
    const int64_t nb = (N + {BLOCK} - 1) / {BLOCK};
    int64_t nt = TP_MIN(TP_MAX(nthreads, 1), nb);
    if ((double)M * (double)N * (double)K < 65536.0) nt = 1;
    const int64_t nch = nt > 1 ? TP_MIN(nb, nt * TP_CHUNKS_PER_THREAD) : 1;
    #pragma omp parallel num_threads(nt)
    {{
        float S[{MAX_M} * {BLOCK}];
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t ch = 0; ch < nch; ++ch) {{
            for (int64_t blk = nb * ch / nch; blk < nb * (ch + 1) / nch; ++blk) {{
                const int64_t j0 = blk * {BLOCK}, w = TP_MIN(N - j0, {BLOCK});
                /* the epilogue's operands of the block, fetched while its weights stream */
                for (int64_t i = 0; i < M; ++i) tp_epi_pf(i, j0, w, ep, eld);
                int64_t q = 0;
                for (; q + {WROWS} <= w; q += {WROWS}) {{
                    const btype_t *wp = W + (j0 + q) * ldw;
                    int64_t i = 0;
                    for (; i + {mr} <= M; i += {mr})
                        rtile_{mr}x{WROWS}(A + i * lda, lda, wp, ldw, K, pf, S + i * {BLOCK} + q, {BLOCK});
                    for (; i < M; ++i)
                        rtile_1x{WROWS}(A + i * lda, lda, wp, ldw, K, pf, S + i * {BLOCK} + q, {BLOCK});
                }}
                for (; q < w; ++q)
                    for (int64_t i = 0; i < M; ++i)
                        rtile_1x1(A + i * lda, lda, W + (j0 + q) * ldw, ldw, K, pf,
                            S + i * {BLOCK} + q, {BLOCK});
                for (int64_t i = 0; i < M; ++i) {{
                    otype_t *c = C + i * ldc + j0;
                    const float *x = S + i * {BLOCK};
                    int64_t jj = 0;
                    for (; jj + VWIDTH <= w; jj += VWIDTH)
                        VSTORE_OTAG(c + jj, tp_epi_v(VLOAD_f32(x + jj), i, j0 + jj, ep, eld));
                    for (; jj < w; ++jj) SSTORE_OTAG(c + jj, tp_epi_s(x[jj], i, j0 + jj, ep, eld));
                }}
            }}
        }}
    }}
    return 0;
}}
"""


def render_source(spec: EpilogueSpec, btag: str, otag: str, isa: str, mr: int) -> str:
    """Body (before :func:`torchport.native.render`) of the row-streaming driver
    ``tp_gemm_rows_{mr}`` for this epilogue, ``B`` dtype tag and output dtype tag (AVX2 or
    AVX-512 builds)."""
    if isa not in ("avx2", "avx512"):
        raise ValueError(f"the row-streaming driver needs isa avx2 or avx512, got {isa}")
    if mr not in ROW_TILES:
        raise ValueError(f"row-streaming tile MR must be one of {ROW_TILES}, got {mr}")
    vw, esize = templates.VW[isa], 4 if btag == "f32" else 2
    # the shared preamble: vocabulary, dtypes and the spec's epilogue functions (no panel tiles)
    parts = [templates.render_source(spec, btag, otag, isa, ()), _REDUCE]
    tiles = sorted({(1, 1), (1, WROWS), (mr, WROWS)})
    parts += [_rtile(r, w, vw, btag, esize) for r, w in tiles]
    parts.append(_driver(mr))
    return "\n".join(parts)


__all__ = ["BLOCK", "MAX_M", "ROW_TILES", "WROWS", "render_source"]
