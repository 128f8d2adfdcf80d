"""Native kernels of the shared-memory transport: step barrier, copies and reductions.

One call of ``tp_shm_step`` performs a whole collective step for the calling rank; it waits
only for the ranks it reads from, not for the whole group:

1. prewait: wait until every rank arrived at the previous step (so every reader of this
   rank's half from two steps ago is done with it) and check their previous signatures;
   this lags one step behind and rarely blocks;
2. copy the published segments into this rank's slot (half ``epoch & 1`` of its double buffer),
   write the step signature and arrive (``__atomic`` release store of ``epoch``);
3. for each read: wait until its source arrived (acquire loads; bounded spin with ``pause``,
   then ``sched_yield`` for 0.2 ms, then a futex sleep woken by the next arrival), watching
   the group's abort word, the source's *gone* word and a deadline; check the source's
   signature (mismatch -> error code, offending rank); copy or reduce ``len`` bytes from its
   slot into a destination.
   Copies run in the order their sources arrive, folds in rank order;
4. a rank that reads from no other rank waits for every rank and checks every signature.

Arriving at step e means "finished every read of step e - 1", so the prewait is exactly the
condition for reusing a half: no slot or signature is rewritten before all its readers
consumed it. A mismatch is reported within its step by every rank that reads from a
disagreeing rank or reads from nobody, and by the others at their next step's prewait.
The fused allreduce (``tp_shm_allreduce``) runs after the same prewait; a large one is one
full barrier, a pipeline of blocks whose readers and writers wait on per-rank counters
(published, folded, copied out) instead of barriers, and an arrival.

A rank that left the job (a peer read its goodbye, which it sends after its last step) has
its *gone* word set (``tp_mark_gone``), after its last arrival: a wait for a word of it that is
still short of its target then ends with ``GONE`` at once (naming the rank) instead of at the
deadline, while a wait it already satisfied (a collective it finished before it left) is
unaffected.

Reductions fold ``dst = dst (op) src`` element-wise. fp16/bf16 compute in fp32 and round to
nearest-even per fold, exactly like torch's eager ``a + b`` in that dtype; integers wrap
(``-fwrapv``); MIN/MAX propagate NaN like ``torch.minimum``/``torch.maximum``; bool maps
SUM/MAX/BOR to OR, PRODUCT/MIN/BAND to AND, BXOR to XOR; complex supports SUM and PRODUCT.
FMA contraction is off so results are bitwise those of the reference.
"""

from __future__ import annotations

import ctypes
import functools

from torchport import native

# Status codes returned by tp_shm_step.
OK, TIMEOUT, ABORTED, MISMATCH, BAD_ARG = 0, 1, 2, 3, 4
SIZES_LEFT = 5  # tp_shm_alltoall_packed: the caller goes on from the exchanged sizes
GONE = 6  # a rank waited for left the group (its gone word is set); ``bad[0]`` names it

# Header layout (bytes).
HDR_MAGIC = 0x5450534D33  # "TPSM3"
LINE = 256  # per-rank control line: arrive (8) + pad + two signature halves
GONE_WORD = 3  # the pad word (of 7) that says the rank left the group (0..2: pipeline counters)
SIG_WORDS = 8
CTRL_OFF = 256  # lines start here; offset 64 holds the abort word
DATA_ALIGN = 4096
YIELD_NS = 200_000  # after this long a waiting rank sleeps on the futex instead of yielding
# ... and after this long on an engine thread, whose process is busy with other work (DDP's
# backward pass) that a yielding waiter would slow down.
BACKGROUND_YIELD_NS = 20_000
# ... and at most this long when the arena has more ranks than the host has cores: a yielding
# waiter then takes CPU time from the very rank it waits for (offset 80 of the header).
OVERSUBSCRIBED_YIELD_NS = 20_000
YIELD_CAP_OFF = 80
PIPE_BLOCK = 65536  # bytes per block of the allreduce pipeline (per part)
RING_MAGIC = 0x5450524E47  # "TPRNG": a point-to-point byte ring (transport_shm.ShmRing)
RING_DATA = 4096  # its data starts here, after the header's words
RING_HEAD_OFF = 128  # the writer's published position (bytes written)
RING_TAIL_OFF = 192  # the reader's (bytes read)
RING_MAPPED_OFF = 256  # the reader sets this word once it mapped the ring
RING_CORRUPT = -2  # tp_ring_move: the peer's word is out of bounds

_SOURCE = r"""
#include <sched.h>
#include <time.h>
#include <limits.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <complex.h>

#define SIG_WORDS ${sig_words}
#define LINE ${line}
#define CTRL_OFF ${ctrl_off}
#define TP_GONE ${gone_word}  /* pad word: the rank left the group (tp_mark_gone) */
#define TP_ST_GONE 6

typedef struct { int64_t arrive; int64_t pad[7]; int64_t sig[2][SIG_WORDS]; } tp_line_t;

static inline int64_t tp_now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline float tp_h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) u = s;
        else { e = 127 - 15 + 1; while (!(m & 0x400)) { m <<= 1; e--; } m &= 0x3ff; u = s | (e << 23) | (m << 13); }
    } else if (e == 31) u = s | 0x7f800000u | (m << 13);
    else u = s | ((e + 127 - 15) << 23) | (m << 13);
    float f; memcpy(&f, &u, 4); return f;
#endif
}
static inline uint16_t tp_f2h(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000; int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15; uint32_t m = u & 0x7fffff;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(s | 0x7c00 | (m ? 0x200 : 0));
    if (e >= 31) return (uint16_t)(s | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)s;
        m |= 0x800000; uint32_t shift = (uint32_t)(14 - e); uint32_t hm = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (hm & 1))) hm++;
        return (uint16_t)(s | hm);
    }
    uint32_t hm = m >> 13, rem = m & 0x1fff;
    uint32_t r = (uint32_t)(s | ((uint32_t)e << 10) | hm);
    if (rem > 0x1000 || (rem == 0x1000 && (hm & 1))) r++;
    return (uint16_t)r;
#endif
}

#define MINF(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b))
#define MAXF(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))
#define MAXI(a, b) ((a) > (b) ? (a) : (b))

/* Three-operand folds: d[i] = a[i] (op) b[i]; d may alias a or b element for element. */
#define FOLD(T, EXPR) { T *d = (T *)dst; const T *x = (const T *)pa, *y = (const T *)pb; \
    for (int64_t i = 0; i < n; i++) { T a = x[i], b = y[i]; d[i] = (EXPR); } return 0; }
#define FOLD16(CONV_IN, CONV_OUT, EXPR) { uint16_t *d = (uint16_t *)dst; \
    const uint16_t *x = (const uint16_t *)pa, *y = (const uint16_t *)pb; \
    for (int64_t i = 0; i < n; i++) { float a = CONV_IN(x[i]), b = CONV_IN(y[i]); d[i] = CONV_OUT(EXPR); } return 0; }

#define FLOAT_OPS(T) switch (op) { case 0: FOLD(T, a + b) case 1: FOLD(T, a * b) \
    case 2: FOLD(T, MINF(a, b)) case 3: FOLD(T, MAXF(a, b)) default: return -1; }
#define INT_OPS(T) switch (op) { case 0: FOLD(T, a + b) case 1: FOLD(T, a * b) \
    case 2: FOLD(T, MINI(a, b)) case 3: FOLD(T, MAXI(a, b)) case 4: FOLD(T, a & b) \
    case 5: FOLD(T, a | b) case 6: FOLD(T, a ^ b) default: return -1; }
#define HALF_OPS(IN, OUT) switch (op) { case 0: FOLD16(IN, OUT, a + b) case 1: FOLD16(IN, OUT, a * b) \
    case 2: FOLD16(IN, OUT, MINF(a, b)) case 3: FOLD16(IN, OUT, MAXF(a, b)) default: return -1; }

#if defined(__AVX2__)
static void tp_sum_f32_avx2(float *d, const float *x, const float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_loadu_ps(x + i), a1 = _mm256_loadu_ps(x + i + 8);
        __m256 b0 = _mm256_loadu_ps(y + i), b1 = _mm256_loadu_ps(y + i + 8);
        _mm256_storeu_ps(d + i, _mm256_add_ps(a0, b0));
        _mm256_storeu_ps(d + i + 8, _mm256_add_ps(a1, b1));
    }
    for (; i < n; i++) d[i] = x[i] + y[i];
}
/* d[i] = e[i] = x[i] + y[i]: the world-2 owner's fold writing its result and publishing it in
   one pass (no re-read of the block). */
static void tp_sum_f32_pub_avx2(float *d, float *e, const float *x, const float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i));
        __m256 a1 = _mm256_add_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8));
        _mm256_storeu_ps(d + i, a0); _mm256_storeu_ps(d + i + 8, a1);
        _mm256_storeu_ps(e + i, a0); _mm256_storeu_ps(e + i + 8, a1);
    }
    for (; i < n; i++) { d[i] = x[i] + y[i]; e[i] = d[i]; }
}
static void tp_sum_bf16_avx2(uint16_t *d, const uint16_t *x, const uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        tp_f32x8_to_bf16(d + i, _mm256_add_ps(tp_bf16x8_to_f32(x + i), tp_bf16x8_to_f32(y + i)));
    for (; i < n; i++) d[i] = tp_f32_to_bf16(tp_bf16_to_f32(x[i]) + tp_bf16_to_f32(y[i]));
}
#endif
#if defined(__AVX2__) && defined(__F16C__)
static void tp_sum_f16_avx2(uint16_t *d, const uint16_t *x, const uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(y + i)));
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_add_ps(a, b), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) d[i] = tp_f2h(tp_h2f(x[i]) + tp_h2f(y[i]));
}
#endif

/* dtype: 0 f32, 1 f64, 2 f16, 3 bf16, 4 i8, 5 u8, 6 i16, 7 i32, 8 i64, 9 bool, 10 c64, 11 c128
   op: 0 SUM, 1 PRODUCT, 2 MIN, 3 MAX, 4 BAND, 5 BOR, 6 BXOR.  dst = pa (op) pb, n elements. */
TP_EXPORT int tp_fold3(void *dst, const void *pa, const void *pb, int64_t n, int64_t dtype, int64_t op) {
    switch (dtype) {
    case 0:
#if defined(__AVX2__)
        if (op == 0) { tp_sum_f32_avx2((float *)dst, (const float *)pa, (const float *)pb, n); return 0; }
#endif
        FLOAT_OPS(float)
    case 1: FLOAT_OPS(double)
    case 2:
#if defined(__AVX2__) && defined(__F16C__)
        if (op == 0) { tp_sum_f16_avx2((uint16_t *)dst, (const uint16_t *)pa, (const uint16_t *)pb, n); return 0; }
#endif
        HALF_OPS(tp_h2f, tp_f2h)
    case 3:
#if defined(__AVX2__)
        if (op == 0) { tp_sum_bf16_avx2((uint16_t *)dst, (const uint16_t *)pa, (const uint16_t *)pb, n); return 0; }
#endif
        HALF_OPS(tp_bf16_to_f32, tp_f32_to_bf16)
    case 4: INT_OPS(int8_t)
    case 5: INT_OPS(uint8_t)
    case 6: INT_OPS(int16_t)
    case 7: INT_OPS(int32_t)
    case 8: INT_OPS(int64_t)
    case 9: switch (op) {
        case 0: case 3: case 5: FOLD(uint8_t, (uint8_t)((a | b) != 0))
        case 1: case 2: case 4: FOLD(uint8_t, (uint8_t)((a != 0) & (b != 0)))
        case 6: FOLD(uint8_t, (uint8_t)((a != 0) ^ (b != 0)))
        default: return -1; }
    case 10: switch (op) {
        case 0: FOLD(float _Complex, a + b)
        case 1: { float *d = (float *)dst; const float *x = (const float *)pa, *y = (const float *)pb;
            for (int64_t i = 0; i < n; i++) { float ar = x[2*i], ai = x[2*i+1], br = y[2*i], bi = y[2*i+1];
                d[2*i] = ar * br - ai * bi; d[2*i+1] = ar * bi + ai * br; } return 0; }
        default: return -1; }
    case 11: switch (op) {
        case 0: FOLD(double _Complex, a + b)
        case 1: { double *d = (double *)dst; const double *x = (const double *)pa, *y = (const double *)pb;
            for (int64_t i = 0; i < n; i++) { double ar = x[2*i], ai = x[2*i+1], br = y[2*i], bi = y[2*i+1];
                d[2*i] = ar * br - ai * bi; d[2*i+1] = ar * bi + ai * br; } return 0; }
        default: return -1; }
    default: return -1;
    }
}

TP_EXPORT int tp_fold(void *dst, const void *src, int64_t n, int64_t dtype, int64_t op) {
    return tp_fold3(dst, dst, src, n, dtype, op);
}

static const int64_t tp_esize[12] = {4, 8, 2, 2, 1, 1, 2, 4, 8, 1, 8, 16};

/* Copy n bytes into a large collective's output, which this rank does not read again before
   the op ends: non-temporal stores write each destination line without first reading it
   (a cached store's read-for-ownership is a third of a copy's memory traffic) and leave the
   caches to the slots still in flight. A store fence at the end orders them before whatever
   this thread publishes next. Without AVX, or under a page, a plain memcpy. */
static void tp_copy_stream(char *dst, const char *src, int64_t n) {
#if defined(__AVX__)
    if (n >= 4096) {
        int64_t head = (int64_t)((64 - ((uintptr_t)dst & 63)) & 63);
        memcpy(dst, src, (size_t)head);
        dst += head; src += head; n -= head;
        int64_t body = n & ~(int64_t)127;
        for (int64_t i = 0; i < body; i += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
            __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
            _mm256_stream_si256((__m256i *)(dst + i), a);
            _mm256_stream_si256((__m256i *)(dst + i + 32), b);
            _mm256_stream_si256((__m256i *)(dst + i + 64), c);
            _mm256_stream_si256((__m256i *)(dst + i + 96), d);
        }
        memcpy(dst + body, src + body, (size_t)(n - body));
        _mm_sfence();
        return;
    }
#endif
    memcpy(dst, src, (size_t)n);
}

/* A read's mode: 0 copy, 1 fold, 2 copy with streaming stores (tp_copy_stream). */
static inline int tp_read(char *dst, const char *src, int64_t len, int64_t mode, int64_t dtype, int64_t op) {
    if (mode == 0) memcpy(dst, src, (size_t)len);
    else if (mode == 2) tp_copy_stream(dst, src, len);
    else if (mode == 1 && dtype >= 0 && dtype <= 11) return tp_fold(dst, src, len / tp_esize[dtype], dtype, op);
    else return -1;
    return 0;
}

/* Apply reads: each is 5 int64 (peer, offset, dst pointer, length, mode: see tp_read),
   sources are bases[peer] + offset. */
TP_EXPORT int tp_apply(const int64_t *bases, const int64_t *reads, int64_t nreads,
                       int64_t dtype, int64_t op) {
    for (int64_t k = 0; k < nreads; k++) {
        const int64_t *r = reads + 5 * k;
        const char *src = (const char *)(intptr_t)bases[r[0]] + r[1];
        char *dst = (char *)(intptr_t)r[2];
        int64_t len = r[3];
        if (len <= 0) continue;
        if (tp_read(dst, src, len, r[4], dtype, op) != 0) return -1;
    }
    return 0;
}

static inline tp_line_t *tp_line(char *hdr, int64_t r) { return (tp_line_t *)(hdr + CTRL_OFF + r * LINE); }

/* How long a waiting rank yields before it sleeps on the futex; per thread, so an engine
   thread running an op in the background (while its process computes) can give up the CPU
   sooner than a caller that waits inline. */
static __thread int64_t tp_yield_ns = ${yield_ns};
TP_EXPORT void tp_set_yield(int64_t ns) { tp_yield_ns = ns < 0 ? 0 : ns; }

/* Futex word (offset 72) bumped on every arrival and abort; sleeper count at offset 76. */
static inline int32_t *tp_gen(char *hdr) { return (int32_t *)(hdr + 72); }
static inline int32_t *tp_sleepers(char *hdr) { return (int32_t *)(hdr + 76); }

static void tp_bump(char *hdr) {
    __atomic_add_fetch(tp_gen(hdr), 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(tp_sleepers(hdr), __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, tp_gen(hdr), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Waiting state of one step: spins, then yields for tp_yield_ns, then futex sleeps. */
typedef struct { int64_t spins, t0, deadline; } tp_wait_t;

/* The rank whose gone word ended this thread's last wait (status TP_ST_GONE), for the
   entry points to report. */
static __thread int64_t tp_gone_rank = -1;

/* Wait until *word >= target (a word of rank q's line: its arrive epoch or a pipeline counter;
   q < 0: a ring's word, no rank); 0 ok, 1 timeout, 2 aborted, 6 (TP_ST_GONE) rank q left with
   the word short of the target (its gone word is set after its last store: re-read, the word
   is final). Spins briefly, yields for up to tp_yield_ns (per thread, default ${yield_ns} ns),
   then sleeps on the futex (1 ms cap, so deadlines, aborts and departures are seen promptly
   even without a wake-up). */
static int tp_wait_word(char *hdr, const int64_t *word, int64_t target, tp_wait_t *w, int64_t q) {
    int64_t *abort_word = (int64_t *)(hdr + 64);
    const int64_t *gone = q >= 0 ? &tp_line(hdr, q)->pad[TP_GONE] : NULL;
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < target) {
        if (__atomic_load_n(abort_word, __ATOMIC_ACQUIRE) != 0) return 2;
        if (gone && __atomic_load_n(gone, __ATOMIC_ACQUIRE) &&
            __atomic_load_n(word, __ATOMIC_ACQUIRE) < target) {
            tp_gone_rank = q;
            return TP_ST_GONE;
        }
        w->spins++;
        if (w->spins < 128) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
            continue;
        }
        int64_t now = tp_now_ns();
        if (w->t0 == 0) w->t0 = now;
        if (now > w->deadline) return 1;
        int64_t cap = *(volatile int64_t *)(hdr + ${yield_cap_off});
        int64_t yield_ns = cap > 0 && cap < tp_yield_ns ? cap : tp_yield_ns;
        if (now - w->t0 < yield_ns) { sched_yield(); continue; }
        __atomic_add_fetch(tp_sleepers(hdr), 1, __ATOMIC_SEQ_CST);
        int32_t g = __atomic_load_n(tp_gen(hdr), __ATOMIC_SEQ_CST);
        if (__atomic_load_n(word, __ATOMIC_SEQ_CST) < target &&
            __atomic_load_n(abort_word, __ATOMIC_SEQ_CST) == 0) {
            struct timespec ts = {0, 1000000};
            syscall(SYS_futex, tp_gen(hdr), FUTEX_WAIT, g, &ts, NULL, 0);
        }
        __atomic_sub_fetch(tp_sleepers(hdr), 1, __ATOMIC_SEQ_CST);
    }
    return 0;
}

static int tp_wait_rank(char *hdr, int64_t q, int64_t epoch, tp_wait_t *w) {
    return tp_wait_word(hdr, &tp_line(hdr, q)->arrive, epoch, w, q);
}

static int tp_wait_all(char *hdr, int64_t world, int64_t epoch, int64_t deadline) {
    tp_wait_t w = {0, 0, deadline};
    for (int64_t q = 0; q < world; q++) {
        int st = tp_wait_rank(hdr, q, epoch, &w);
        if (st != 0) return st;
    }
    return 0;
}

/* Compare rank q's signature for the step in ``half`` with ``sig``; 3 on mismatch. */
static int tp_check_sig(char *hdr, int64_t q, int64_t half, const int64_t *sig, int64_t *bad) {
    tp_line_t *l = tp_line(hdr, q);
    for (int w = 0; w < SIG_WORDS; w++)
        if (l->sig[half][w] != sig[w]) { bad[0] = q; bad[1] = w; bad[2] = l->sig[half][w]; return 3; }
    return 0;
}

/* Before writing its half of step ``epoch`` (last used at epoch - 2), a rank waits until every
   rank arrived at epoch - 1, i.e. finished reading step epoch - 2: no slot or signature half is
   reused before all its readers consumed it. The wait lags one step behind, so it rarely
   blocks. While every rank's epoch - 1 signature is still in place (nobody rewrites it before
   this rank arrives at ``epoch``), it is checked against ours: a mismatch that a rank reading
   only from agreeing peers could not see in its own step is reported here at the latest. */
static int tp_prewait(char *hdr, int64_t world, int64_t rank, int64_t epoch, int64_t deadline,
                      int64_t *bad) {
    if (epoch < 2) return 0;
    int st = tp_wait_all(hdr, world, epoch - 1, deadline);
    if (st != 0) return st;
    int64_t half = (epoch - 1) & 1;
    const int64_t *mine = tp_line(hdr, rank)->sig[half];
    for (int64_t q = 0; q < world; q++)
        if (q != rank && (st = tp_check_sig(hdr, q, half, mine, bad)) != 0) return st;
    return 0;
}

/* Arrive at step ``epoch`` with signature ``sig``, wait for every rank, compare signatures.
   0 ok, 1 timeout, 2 aborted, 3 mismatch (bad = rank, word, their value). */
static int tp_sync(char *hdr, int64_t world, int64_t rank, int64_t epoch, const int64_t *sig,
                   int64_t deadline, int64_t *bad) {
    int64_t half = epoch & 1;
    tp_line_t *me = tp_line(hdr, rank);
    for (int w = 0; w < SIG_WORDS; w++) me->sig[half][w] = sig[w];
    __atomic_store_n(&me->arrive, epoch, __ATOMIC_SEQ_CST);
    tp_bump(hdr);
    int st = tp_wait_all(hdr, world, epoch, deadline);
    if (st != 0) return st;
    for (int64_t q = 0; q < world; q++)
        if ((st = tp_check_sig(hdr, q, half, sig, bad)) != 0) return st;
    return 0;
}

/* One collective step (see module docstring). pubs: 2 int64 per segment (pointer, length).

   Waits only for the ranks it reads from: after publishing and arriving, each read waits for
   its source's arrival and checks the source's signature. Copies are applied in whatever order
   their sources arrive (a rank descheduled on a busy host delays only the copies from it);
   folds keep rank order (the results must be bitwise those of the reference). A rank that
   reads from no other rank (a broadcast root, a gather sender) waits for every rank's arrival
   and checks every signature, so each rank sees a mismatch within the step that has one or,
   for a reader whose own sources agree with it, at its next step's prewait. */
TP_EXPORT int tp_shm_step(char *hdr, char *data, int64_t world, int64_t rank, int64_t slot,
                          int64_t epoch, const int64_t *sig,
                          const int64_t *pubs, int64_t npubs,
                          const int64_t *reads, int64_t nreads,
                          int64_t dtype, int64_t op, int64_t timeout_ns, int64_t *bad) {
    int64_t half = epoch & 1, deadline = tp_now_ns() + timeout_ns;
    char *mine = data + (rank * 2 + half) * slot;
    int64_t off = 0;
    if (world > 256 || rank < 0 || rank >= world || nreads < 0 || nreads > 4096) return 4;
    for (int64_t k = 0; k < npubs; k++) {
        int64_t len = pubs[2 * k + 1];
        if (len < 0 || off + len > slot) return 4;
        off += len;
    }
    int any_other = 0, any_fold = 0;
    for (int64_t k = 0; k < nreads; k++) {
        const int64_t *r = reads + 5 * k;
        if (r[0] < 0 || r[0] >= world || r[1] < 0 || r[3] < 0 || r[1] + r[3] > slot) return 4;
        if (r[4] < 0 || r[4] > 2 || (r[4] == 1 && (dtype < 0 || dtype > 11))) return 4;
        if (r[0] != rank) any_other = 1;
        if (r[4] == 1) any_fold = 1;
    }
    int st = tp_prewait(hdr, world, rank, epoch, deadline, bad);
    if (st != 0) return st;
    off = 0;
    for (int64_t k = 0; k < npubs; k++) {
        int64_t len = pubs[2 * k + 1];
        if (len > 0) memcpy(mine + off, (const void *)(intptr_t)pubs[2 * k], (size_t)len);
        off += len;
    }
    tp_line_t *me = tp_line(hdr, rank);
    for (int w = 0; w < SIG_WORDS; w++) me->sig[half][w] = sig[w];
    __atomic_store_n(&me->arrive, epoch, __ATOMIC_SEQ_CST);
    tp_bump(hdr);
    tp_wait_t w = {0, 0, deadline};
    if (!any_other) {
        if ((st = tp_wait_all(hdr, world, epoch, deadline)) != 0) return st;
        for (int64_t q = 0; q < world; q++)
            if ((st = tp_check_sig(hdr, q, half, sig, bad)) != 0) return st;
    }
    unsigned char checked[256] = {0}, done[4096];
    memset(done, 0, (size_t)nreads);
    int64_t left = nreads;
    while (left > 0) {
        int progress = 0;
        for (int64_t k = 0; k < nreads; k++) {
            if (done[k]) continue;
            const int64_t *r = reads + 5 * k;
            int64_t q = r[0];
            if (any_fold) {  /* rank order: block on this source */
                if ((st = tp_wait_rank(hdr, q, epoch, &w)) != 0) return st;
            } else if (__atomic_load_n(&tp_line(hdr, q)->arrive, __ATOMIC_ACQUIRE) < epoch) {
                continue;
            }
            if (!checked[q]) {
                if ((st = tp_check_sig(hdr, q, half, sig, bad)) != 0) return st;
                checked[q] = 1;
            }
            const char *src = data + (q * 2 + half) * slot + r[1];
            char *dst = (char *)(intptr_t)r[2];
            if (r[3] > 0 && tp_read(dst, src, r[3], r[4], dtype, op) != 0) return 4;
            done[k] = 1; left--; progress = 1;
        }
        if (!progress && left > 0) {  /* sleep on the first source still missing */
            for (int64_t k = 0; k < nreads; k++)
                if (!done[k]) { if ((st = tp_wait_rank(hdr, reads[5 * k], epoch, &w)) != 0) return st; break; }
        }
    }
    return 0;
}

/* Pipeline counters of rank q (words of its control line's pad, beside its arrive word): how
   many blocks it has published, folded and copied out in the current allreduce. */
enum { TP_PUB = 0, TP_RES = 1, TP_OUT = 2 };
static inline int64_t *tp_ctr(char *hdr, int64_t q, int k) { return &tp_line(hdr, q)->pad[k]; }

/* Store a counter and wake futex sleepers, if any (a waiter counts itself a sleeper before it
   rechecks the word, so one of the two sees the other: no lost wake-up). */
static void tp_post(char *hdr, int64_t *word, int64_t v) {
    __atomic_store_n(word, v, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(tp_sleepers(hdr), __ATOMIC_SEQ_CST) > 0) {
        __atomic_add_fetch(tp_gen(hdr), 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, tp_gen(hdr), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

/* Wait until counter k of every rank but ``rank`` reaches ``target``. Each wait spins and
   yields afresh (a waiting state carried over from earlier blocks would send every later wait
   straight to the futex). */
static int tp_wait_peers(char *hdr, int64_t world, int64_t rank, int k, int64_t target, int64_t deadline) {
    tp_wait_t w = {0, 0, deadline};
    for (int64_t q = 0; q < world; q++) {
        if (q == rank) continue;
        int st = tp_wait_word(hdr, tp_ctr(hdr, q, k), target, &w, q);
        if (st != 0) return st;
    }
    return 0;
}

/* The block pipeline of the two-step allreduce (see tp_shm_allreduce), run after a full
   barrier of the call's first step: every rank has finished every read of earlier steps, so
   both halves of every rank's slots are free and every counter has been reset.

   Rank q owns part q (contiguous, the first ``total % world`` parts one element longer), cut
   into blocks of ``be`` elements; block j of every part moves through entry j % R of a ring in
   each rank's two slot halves. An entry holds ``world`` input blocks (input block p: the block
   of part p that rank p folds) and one result block. Iteration i runs three operations, each
   lagging the previous one so that what it waits for is normally done:
     copy-in(i):   block i of every other part (and of its own, rank >= 2) into the entry; PUB;
     fold(i - d1): block i - d1 of its own part from every rank's input block, in rank order,
                   into its buffer and the entry's result block; RES;
     copy-out(i - d2): every other rank's result block into its buffer; OUT.
   Waits: fold(j) needs every peer's PUB > j (their input) and OUT > j - R (they read the result
   block it overwrites); copy-out(j) needs each peer's RES > j; copy-in(i) needs each peer's
   RES > i - R (they read the input block it overwrites). Each wait is for an operation of a
   strictly earlier iteration-and-phase (R > d1 and d2 < R + d1), so the pipeline cannot
   deadlock, and every wait is bounded by the deadline and the abort word. */
static int tp_allreduce_pipe(char *hdr, char *data, int64_t world, int64_t rank, int64_t slot,
                             char *buf, int64_t total, int64_t esize, int64_t dtype, int64_t op,
                             int64_t deadline) {
    int64_t pq = total / world, extra = total % world;
    #define PART_LO(q) ((q) * pq + ((q) < extra ? (q) : extra))
    #define PART_N(q) (pq + ((q) < extra ? 1 : 0))
    #define BLK_N(q, j) (PART_N(q) - (j) * be < be ? (PART_N(q) - (j) * be > 0 ? PART_N(q) - (j) * be : 0) : be)
    /* block: ${pipe_block} bytes, smaller when the ring would have fewer than 4 entries */
    int64_t be = ${pipe_block} / esize;
    if (4 * (world + 1) * be * esize > 2 * slot) be = 2 * slot / (4 * (world + 1) * esize);
    if (be < 1) be = 1;
    int64_t bb = be * esize, ent = (world + 1) * bb, ring = 2 * slot / ent;
    int64_t nblk = (PART_N(0) + be - 1) / be;
    int64_t d1 = ring >= 3 ? 1 : 0, d2 = d1 + (ring - 1 < 2 ? ring - 1 : 2);
    #define ENTRY(q, j) (data + (q) * 2 * slot + ((j) % ring) * ent)
    int64_t sub = 16384 / esize > 0 ? 16384 / esize : 1;  /* fold sub-block: stays in L1 */
    int st;
    for (int64_t i = 0; i < nblk + d2; i++) {
        if (i < nblk) {  /* copy-in(i) */
            if (i >= ring && (st = tp_wait_peers(hdr, world, rank, TP_RES, i - ring + 1, deadline)) != 0) return st;
            char *e = ENTRY(rank, i);
            for (int64_t q = 0; q < world; q++) {
                if (q == rank && rank < 2) continue;
                int64_t n = BLK_N(q, i);
                if (n) memcpy(e + q * bb, buf + (PART_LO(q) + i * be) * esize, (size_t)(n * esize));
            }
            tp_post(hdr, tp_ctr(hdr, rank, TP_PUB), i + 1);
        }
        int64_t j = i - d1;
        if (j >= 0 && j < nblk) {  /* fold(j) */
            if (j >= ring && (st = tp_wait_peers(hdr, world, rank, TP_OUT, j - ring + 1, deadline)) != 0) return st;
            if ((st = tp_wait_peers(hdr, world, rank, TP_PUB, j + 1, deadline)) != 0) return st;
            int64_t n = BLK_N(rank, j);
            char *dst = buf + (PART_LO(rank) + j * be) * esize, *res = ENTRY(rank, j) + world * bb;
            #define SRC(q) ((q) == rank && rank < 2 ? (const char *)dst : ENTRY(q, j) + rank * bb)
            for (int64_t b = 0; b < n; b += sub) {  /* publish each sub-block while in L1 */
                int64_t kb = n - b < sub ? n - b : sub, ob = b * esize;
#if defined(__AVX2__)
                if (world == 2 && dtype == 0 && op == 0) {
                    tp_sum_f32_pub_avx2((float *)(dst + ob), (float *)(res + ob),
                                        (const float *)(SRC(0) + ob), (const float *)(SRC(1) + ob), kb);
                    continue;
                }
#endif
                if (tp_fold3(dst + ob, SRC(0) + ob, SRC(1) + ob, kb, dtype, op) != 0) return 4;
                for (int64_t q = 2; q < world; q++)
                    if (tp_fold3(dst + ob, dst + ob, SRC(q) + ob, kb, dtype, op) != 0) return 4;
                memcpy(res + ob, dst + ob, (size_t)(kb * esize));
            }
            #undef SRC
            tp_post(hdr, tp_ctr(hdr, rank, TP_RES), j + 1);
        }
        j = i - d2;
        if (j >= 0 && j < nblk) {  /* copy-out(j) */
            for (int64_t q = 0; q < world; q++) {
                if (q == rank) continue;
                tp_wait_t w = {0, 0, deadline};
                if ((st = tp_wait_word(hdr, tp_ctr(hdr, q, TP_RES), j + 1, &w, q)) != 0) return st;
                int64_t n = BLK_N(q, j);
                if (n) memcpy(buf + (PART_LO(q) + j * be) * esize, ENTRY(q, j) + world * bb, (size_t)(n * esize));
            }
            tp_post(hdr, tp_ctr(hdr, rank, TP_OUT), j + 1);
        }
    }
    #undef ENTRY
    #undef BLK_N
    #undef PART_N
    #undef PART_LO
    return 0;
}

/* A whole in-place allreduce of ``nbytes`` at ``buf`` in one call (no Python per chunk).

   Steps have signature (sig3[0..2], step). A buffer of at most ``small`` bytes (or world 1):
   one step per chunk of at most ``slot`` bytes; every rank publishes the chunk and folds all
   ranks' copies in rank order. A larger buffer is split into ``world`` contiguous parts (rank q
   owns part q) and takes two steps around a block pipeline (tp_allreduce_pipe): each rank
   publishes its blocks of the parts the others own (and of its own part when rank >= 2, whose
   fold order needs an unmodified copy), folds its own part block by block in rank order with
   three-operand folds straight from the peers' slots and its own buffer, storing each result
   into a slot too, and copies the other parts' results from the peers' slots. Ranks wait for
   one another per block (counters), not per step, so one rank's copy-in overlaps the other's
   fold and a rank that falls behind catches up without stalling the whole group at a barrier.
   Contiguous parts keep each rank's reads of its buffer in two sequential streams. Each
   element is folded in rank order 0..W-1 on exactly one rank, so every rank ends with bitwise
   identical data, equal to the reference.

   info: [bad rank, bad word, their value, steps used, failing step]. Status as tp_shm_step. */
TP_EXPORT int tp_shm_allreduce(char *hdr, char *data, int64_t world, int64_t rank, int64_t slot,
                               int64_t epoch, const int64_t *sig3, char *buf, int64_t nbytes,
                               int64_t esize, int64_t small, int64_t dtype, int64_t op,
                               int64_t timeout_ns, int64_t *info) {
    if (world < 1 || world > 256 || rank < 0 || rank >= world || esize <= 0 || nbytes < 0 ||
        nbytes % esize || slot < esize * world)
        return 4;
    int64_t deadline = tp_now_ns() + timeout_ns, step = 0, per = slot / esize;
    int64_t total = nbytes / esize, sig[SIG_WORDS] = {0};
    sig[0] = sig3[0]; sig[1] = sig3[1]; sig[2] = sig3[2];
    info[4] = 0;
    int st = tp_prewait(hdr, world, rank, epoch, deadline, info);
    if (st != 0) return st;
    if (nbytes <= small || world == 1) {  /* one step per chunk: everyone folds everything */
        int64_t lo = 0;
        do {
            int64_t m = total - lo < per ? total - lo : per, nb = m * esize;
            char *chunk = buf + lo * esize;
            int64_t ep = epoch + step, half = ep & 1;
            sig[3] = step; info[4] = step;
            if (nb) memcpy(data + (rank * 2 + half) * slot, chunk, (size_t)nb);
            if ((st = tp_sync(hdr, world, rank, ep, sig, deadline, info)) != 0) return st;
            if (world > 1 && nb) {
                const char *s0 = data + half * slot, *s1 = data + (2 + half) * slot;
                if (tp_fold3(chunk, s0, s1, m, dtype, op) != 0) return 4;
                for (int64_t q = 2; q < world; q++)
                    if (tp_fold3(chunk, chunk, data + (q * 2 + half) * slot, m, dtype, op) != 0) return 4;
            }
            step += 1; lo += m;
        } while (lo < total);
        info[3] = step;
        return 0;
    }
    /* Two steps: the first is a full barrier (signatures checked, every slot free), then the
       block pipeline runs on counters, then the second step is an arrival only: the next step's
       prewait waits for it, i.e. until every rank finished reading this call's slots. */
    tp_line_t *me = tp_line(hdr, rank);
    for (int k = TP_PUB; k <= TP_OUT; k++) __atomic_store_n(&me->pad[k], 0, __ATOMIC_RELAXED);
    sig[3] = 0; info[4] = 0;
    if ((st = tp_sync(hdr, world, rank, epoch, sig, deadline, info)) != 0) return st;
    info[4] = 1;
    if ((st = tp_allreduce_pipe(hdr, data, world, rank, slot, buf, total, esize, dtype, op, deadline)) != 0)
        return st;
    sig[3] = 1;
    for (int w = 0; w < SIG_WORDS; w++) me->sig[(epoch + 1) & 1][w] = sig[w];
    __atomic_store_n(&me->arrive, epoch + 1, __ATOMIC_SEQ_CST);
    tp_bump(hdr);
    info[3] = 2;
    return 0;
}

/* tp_shm_allreduce with its arguments in one int64 block (one ctypes argument instead of
   fifteen): a[0..15] = hdr, data, world, rank, slot, epoch, sig3[3], buf, nbytes, esize, small,
   dtype, op, timeout_ns; a[16..20] receives info. */
TP_EXPORT int tp_shm_allreduce_packed(int64_t *a) {
    int st = tp_shm_allreduce((char *)(intptr_t)a[0], (char *)(intptr_t)a[1], a[2], a[3], a[4],
                              a[5], a + 6, (char *)(intptr_t)a[9], a[10], a[11], a[12], a[13],
                              a[14], a[15], a + 16);
    if (st == TP_ST_GONE) a[16] = tp_gone_rank;  /* (bad rank: the one that left) */
    return st;
}

/* tp_shm_step with its arguments in one int64 block (one ctypes argument instead of fifteen;
   a step's Python cost at 4 KB was mostly argument conversion): a[0..4] = hdr, data, world,
   rank, slot (set once per arena), a[5] epoch, a[6 .. 6 + SIG_WORDS) sig, then npubs, nreads,
   dtype, op, timeout_ns, three words receiving ``bad``, then the pubs (2 words each) and the
   reads (5 words each). */
#define TP_STEP_HEAD (6 + SIG_WORDS + 8)
TP_EXPORT int tp_shm_step_packed(int64_t *a) {
    int64_t *t = a + 6 + SIG_WORDS, npubs = t[0];
    if (npubs < 0) return 4;
    int st = tp_shm_step((char *)(intptr_t)a[0], (char *)(intptr_t)a[1], a[2], a[3], a[4], a[5],
                         a + 6, a + TP_STEP_HEAD, npubs, a + TP_STEP_HEAD + 2 * npubs, t[1], t[2],
                         t[3], t[4], t + 5);
    if (st == TP_ST_GONE) t[5] = tp_gone_rank;
    return st;
}

/* Apply more reads from the slots of an already completed step (valid until this rank arrives
   at the next step: no peer rewrites that half before then). */
static int tp_shm_reread(char *data, int64_t world, int64_t slot, int64_t epoch,
                         const int64_t *reads, int64_t nreads, int64_t dtype, int64_t op) {
    int64_t bases[256], half = epoch & 1;
    if (world > 256) return 4;
    for (int64_t q = 0; q < world; q++) bases[q] = (int64_t)(intptr_t)(data + (q * 2 + half) * slot);
    for (int64_t k = 0; k < nreads; k++) {
        const int64_t *r = reads + 5 * k;
        if (r[0] < 0 || r[0] >= world || r[1] < 0 || r[3] < 0 || r[1] + r[3] > slot) return 4;
    }
    return tp_apply(bases, reads, nreads, dtype, op) == 0 ? 0 : 4;
}

/* alltoall's exchange of split sizes on the arena in one call, and the whole exchange when
   every rank's pieces fit one step (at 4 KB the Python around two steps cost more than they
   did). a[0..4] = hdr, data, world, rank, slot; a[5] epoch; a[6 .. 6 + SIG_WORDS) sig; then
   dtype, the pieces' read mode, timeout_ns and three words receiving ``bad``; then in_lens,
   out_lens, ins, outs (world words each) and room for every rank's sizes (2 world words per
   rank: its sends, then its receives). Each rank publishes its sizes, and its pieces when all
   of them fit beside the sizes, and reads every rank's sizes. Returns 0 when every rank's sends
   match their receivers' receives and every rank published its pieces (this rank's are then
   copied out: done); 5 when the caller goes on from the sizes (a mismatch to report, or
   pieces too long for one step); else tp_shm_step's status. */
#define TP_A2A_HEAD (6 + SIG_WORDS + 6)
TP_EXPORT int tp_shm_alltoall_packed(int64_t *a) {
    int64_t w = a[2], r = a[3], slot = a[4], epoch = a[5], *t = a + 6 + SIG_WORDS;
    if (w < 1 || w > 256 || r < 0 || r >= w) return 4;
    int64_t *in_lens = a + TP_A2A_HEAD, *ins = in_lens + 2 * w, *outs = in_lens + 3 * w;
    int64_t *mat = in_lens + 4 * w, pubs[2 * 257], reads[5 * 256], total = 16 * w, npubs = 1;
    pubs[0] = (int64_t)(intptr_t)in_lens;
    pubs[1] = 16 * w;
    for (int64_t d = 0; d < w; d++) {
        if (in_lens[d] < 0) return 4;
        total += in_lens[d];
    }
    if (total <= slot)
        for (int64_t d = 0; d < w; d++, npubs++) {
            pubs[2 * npubs] = ins[d];
            pubs[2 * npubs + 1] = in_lens[d];
        }
    for (int64_t q = 0; q < w; q++) {
        int64_t *x = reads + 5 * q;
        x[0] = q; x[1] = 0; x[2] = (int64_t)(intptr_t)(mat + 2 * w * q); x[3] = 16 * w; x[4] = 0;
    }
    int st = tp_shm_step((char *)(intptr_t)a[0], (char *)(intptr_t)a[1], w, r, slot, epoch, a + 6,
                         pubs, npubs, reads, w, t[0], 0, t[2], t + 3);
    if (st == TP_ST_GONE) t[3] = tp_gone_rank;
    if (st != 0) return st;
    int everyone = 1;
    for (int64_t q = 0; q < w; q++) {
        int64_t used = 16 * w;
        for (int64_t d = 0; d < w; d++) {
            if (mat[2 * w * q + d] != mat[2 * w * d + w + q]) return 5;
            used += mat[2 * w * q + d];
        }
        if (used > slot) everyone = 0;
    }
    if (!everyone) return 5;
    int64_t n = 0;
    for (int64_t q = 0; q < w; q++) {
        int64_t off = 16 * w, len = mat[2 * w * q + r];
        for (int64_t d = 0; d < r; d++) off += mat[2 * w * q + d];
        if (!len) continue;
        int64_t *x = reads + 5 * n++;
        x[0] = q; x[1] = off; x[2] = outs[q]; x[3] = len; x[4] = t[1];
    }
    return tp_shm_reread((char *)(intptr_t)a[1], w, slot, epoch, reads, n, t[0], 0) == 0 ? 0 : 4;
}

/* Set the abort word (first writer wins); returns the word now stored. */
TP_EXPORT int64_t tp_set_abort(char *hdr, int64_t value) {
    int64_t expected = 0;
    __atomic_compare_exchange_n((int64_t *)(hdr + 64), &expected, value, 0,
                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    tp_bump(hdr);
    return __atomic_load_n((int64_t *)(hdr + 64), __ATOMIC_ACQUIRE);
}

/* Engine doorbell: cells[0] posted, cells[1] taken, cells[2] stop, cells[3] sleeping (1: a
   timed sleep, 2: deep), cells[4] futex word (low 32 bits), cells[5] urgent, cells[6] sleeps
   ended (a count, for tests). Sleeps (GIL released by ctypes) until stop (returns 0), until
   work has been pending, untaken, for grace_ns, or at once when work is pending and marked
   urgent (someone waits on its future, not inline) (returns 1). Idle, the thread sleeps on the
   futex, woken by tp_doorbell_ring, at most poll_ns per sleep while work was posted within
   quiet_ns; after that it sleeps deep (up to deep_ns) and the next post wakes it
   (tp_doorbell_post): an idle engine costs no wake-ups, while one whose ops come back to back
   (each taken inline by its waiter) is never rung. */
TP_EXPORT int64_t tp_doorbell_wait(int64_t *cells, int64_t grace_ns, int64_t poll_ns,
                                   int64_t quiet_ns, int64_t deep_ns) {
    int64_t since = 0, seen_taken = -1, seen_posted = -1, active = 0;
    int32_t *word = (int32_t *)&cells[4];
    for (;;) {
        if (__atomic_load_n(&cells[2], __ATOMIC_ACQUIRE)) return 0;
        int64_t posted = __atomic_load_n(&cells[0], __ATOMIC_SEQ_CST);
        int64_t taken = __atomic_load_n(&cells[1], __ATOMIC_SEQ_CST);
        int64_t ns = poll_ns;
        if (posted != seen_posted) { seen_posted = posted; active = tp_now_ns(); }
        if (posted > taken) {
            if (__atomic_exchange_n(&cells[5], 0, __ATOMIC_SEQ_CST)) return 1;
            int64_t now = tp_now_ns();
            if (taken != seen_taken) { seen_taken = taken; since = now; }
            else if (now - since >= grace_ns) return 1;
            ns = grace_ns;
        } else {  /* an urgent mark whose work was run inline: drop it (a lost race costs grace_ns) */
            seen_taken = -1;
            __atomic_store_n(&cells[5], 0, __ATOMIC_SEQ_CST);
        }
        int deep = posted == taken && tp_now_ns() - active >= quiet_ns;
        __atomic_store_n(&cells[3], deep ? 2 : 1, __ATOMIC_SEQ_CST);
        int32_t g = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        /* deep: a post after the flag went up rings (tp_doorbell_post); one before it is seen
           here (both sides store, then load the other's word, sequentially consistent) */
        if (!__atomic_load_n(&cells[5], __ATOMIC_SEQ_CST) && !__atomic_load_n(&cells[2], __ATOMIC_SEQ_CST)
            && (!deep || __atomic_load_n(&cells[0], __ATOMIC_SEQ_CST) == posted)) {
            if (deep) ns = deep_ns;
            struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
            syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, g, &ts, NULL, 0);
            __atomic_add_fetch(&cells[6], 1, __ATOMIC_RELAXED);
        }
        __atomic_store_n(&cells[3], 0, __ATOMIC_SEQ_CST);
    }
}

/* Post one operation (the caller queued it): wakes the engine thread only if it sleeps deep. */
TP_EXPORT void tp_doorbell_post(int64_t *cells) {
    __atomic_add_fetch(&cells[0], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&cells[3], __ATOMIC_SEQ_CST) == 2) {
        __atomic_add_fetch((int32_t *)&cells[4], 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, (int32_t *)&cells[4], FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
}

/* Wake the engine thread: stop != 0 sets the stop flag, else marks pending work urgent. */
TP_EXPORT void tp_doorbell_ring(int64_t *cells, int64_t stop) {
    __atomic_store_n(&cells[stop ? 2 : 5], 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch((int32_t *)&cells[4], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&cells[3], __ATOMIC_SEQ_CST))
        syscall(SYS_futex, (int32_t *)&cells[4], FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* Mark rank q gone: it left the group, after its last arrival (tp_wait_word); never cleared.
   Set by a peer that read its goodbye (Communicator.on_peer_left). */
TP_EXPORT void tp_mark_gone(char *hdr, int64_t q) {
    __atomic_store_n(&tp_line(hdr, q)->pad[TP_GONE], 1, __ATOMIC_SEQ_CST);
    tp_bump(hdr);
}

TP_EXPORT int64_t tp_get_abort(char *hdr) {
    return __atomic_load_n((int64_t *)(hdr + 64), __ATOMIC_ACQUIRE);
}

/* A one-way byte ring between two processes (transport_shm.ShmRing): the payloads of large
   point-to-point frames between ranks of one host. Its header has the arena's layout where
   the arena's waiting needs it, so tp_wait_word, tp_post and tp_bump serve it as they are:
   [0] magic, [8] capacity; [64] closed, in the abort word's place (bits: 1 the writer
   finished -- the reader still takes what is in the ring --, 2 stop now; set by either side,
   never cleared), [72] futex word and [76] sleeper count, [80] yield cap (0); [128] head
   (bytes written so far: the writer's word), [192] tail (bytes read so far: the reader's),
   [256] mapped (set by the reader once it mapped the file). Data from RING_DATA, ``capacity``
   bytes used modulo. One writing thread and one reading thread at a time (the sender's
   connection lock, the receiver's reader).

   The file is shared with the peer, who may write any word of it: each side keeps its own
   position privately (``pos``; the shared word is only its publication), takes the capacity
   from its caller (checked when mapped) and checks the peer's word against it before any
   copy, so no value in the file can make a copy leave the data area. */
#define RING_DATA ${ring_data}
#define RING_HEAD ${ring_head}
#define RING_TAIL ${ring_tail}
#define RING_CORRUPT (-2)

/* Move up to n bytes through a ring of ``cap`` data bytes: into it from ``buf`` (put != 0) or
   out of it into ``buf`` (NULL: dropped), this side's position at ``*pos``, publishing every
   ``chunk`` bytes at most so that the other side copies while this one does. Returns the
   bytes moved once all n are, or when ``budget_ns`` passed without the room or data to go on
   (possibly 0); -1 once the ring is closed and nothing was moved (the reader first takes what
   the writer left in it, unless told to stop now); RING_CORRUPT when the peer's word is out
   of bounds. */
TP_EXPORT int64_t tp_ring_move(char *r, int64_t cap, int64_t *pos, char *buf, int64_t n,
                               int64_t chunk, int64_t budget_ns, int64_t put) {
    int64_t *closed = (int64_t *)(r + 64);
    int64_t *mine = (int64_t *)(r + (put ? RING_HEAD : RING_TAIL));
    int64_t *theirs = (int64_t *)(r + (put ? RING_TAIL : RING_HEAD));
    char *data = r + RING_DATA;
    int64_t done = 0, until = tp_now_ns() + budget_ns;
    if (cap <= 0 || n < 0) return RING_CORRUPT;
    if (chunk <= 0 || chunk > cap) chunk = cap;
    while (done < n) {
        int64_t cl = __atomic_load_n(closed, __ATOMIC_ACQUIRE);
        if (cl >= 2 || (cl && put)) return done > 0 ? done : -1;
        int64_t at = *pos;
        int64_t other = __atomic_load_n(theirs, __ATOMIC_ACQUIRE);
        int64_t held = put ? at - other : other - at;  /* bytes in the ring */
        if (held < 0 || held > cap) return RING_CORRUPT;
        int64_t ready = put ? cap - held : held;  /* room, or bytes to read */
        if (ready == 0) {
            if (cl) return done > 0 ? done : -1;  /* (a reader: all the writer left is taken) */
            /* the other side's word only grows: wait for it to pass ``other`` (or the close) */
            tp_wait_t w = {0, 0, until};
            if (tp_wait_word(r, theirs, other + 1, &w, -1) == 1) break;
            continue;
        }
        int64_t off = at % cap, k = n - done;
        if (off < 0) return RING_CORRUPT;
        if (k > ready) k = ready;
        if (k > chunk) k = chunk;
        if (k > cap - off) k = cap - off;
        if (put) memcpy(data + off, buf + done, (size_t)k);
        else if (buf) memcpy(buf + done, data + off, (size_t)k);
        *pos = at + k;
        tp_post(r, mine, at + k);
        done += k;
    }
    return done;
}

/* Close the ring (either side; both see it at their next check) and wake a sleeper: ``how``
   1 the writer finished (its reader still takes what is in the ring), 2 stop now. */
TP_EXPORT void tp_ring_close(char *r, int64_t how) {
    __atomic_fetch_or((int64_t *)(r + 64), how, __ATOMIC_SEQ_CST);
    tp_bump(r);
}
"""


class ShmLib:
    """The compiled kernels with ctypes signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fold = native.c_function(lib, "tp_fold", [p, p, i64, i64, i64], ctypes.c_int)
        self.apply = native.c_function(lib, "tp_apply", [p, p, i64, i64, i64], ctypes.c_int)
        self.set_abort = native.c_function(lib, "tp_set_abort", [p, i64], ctypes.c_int64)
        self.doorbell_wait = native.c_function(
            lib, "tp_doorbell_wait", [p, i64, i64, i64, i64], ctypes.c_int64
        )
        self.doorbell_post = native.c_function(lib, "tp_doorbell_post", [p], None)
        self.doorbell_ring = native.c_function(lib, "tp_doorbell_ring", [p, i64], None)
        self.allreduce_packed = native.c_function(lib, "tp_shm_allreduce_packed", [p], ctypes.c_int)
        self.step_packed = native.c_function(lib, "tp_shm_step_packed", [p], ctypes.c_int)
        self.alltoall_packed = native.c_function(lib, "tp_shm_alltoall_packed", [p], ctypes.c_int)
        self.set_yield = native.c_function(lib, "tp_set_yield", [i64], None)
        self.get_abort = native.c_function(lib, "tp_get_abort", [p], ctypes.c_int64)
        self.mark_gone = native.c_function(lib, "tp_mark_gone", [p, i64], None)
        self.ring_move = native.c_function(
            lib, "tp_ring_move", [p, i64, p, p, i64, i64, i64, i64], ctypes.c_int64
        )
        self.ring_close = native.c_function(lib, "tp_ring_close", [p, i64], None)


@functools.cache
def shm_lib() -> ShmLib:
    """Build (or load from the cache) the shared-memory kernels."""
    src = native.render(
        _SOURCE,
        sig_words=SIG_WORDS,
        line=LINE,
        ctrl_off=CTRL_OFF,
        gone_word=GONE_WORD,
        yield_ns=YIELD_NS,
        yield_cap_off=YIELD_CAP_OFF,
        pipe_block=PIPE_BLOCK,
        ring_data=RING_DATA,
        ring_head=RING_HEAD_OFF,
        ring_tail=RING_TAIL_OFF,
    )
    return ShmLib(native.build(src, name="tp_shm", extra_flags=("-fwrapv", "-ffp-contract=off")))
