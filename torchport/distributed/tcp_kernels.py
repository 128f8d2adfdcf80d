"""Native send/receive loop of the TCP transport (one ctypes call per transfer, GIL released).

A collective over TCP used to receive every frame on the connection's reader thread, which
then handed it to the collective's thread: two thread wake-ups (and two GIL acquisitions) per
frame, with four ranks of several Python threads each sharing two cores. Here the
collective's own thread moves a whole transfer -- its frames to every peer and the frames it
expects from every peer -- in one native loop over the raw socket descriptors
(non-blocking ``sendmsg``/``recv`` and ``poll``), while each connection's reader thread is
parked.

**Read ownership.** Every connection has a 32-bit ownership word: 0 free, 1 its reader
thread (reading one frame), 2 a collective, 3 the reader (reading one frame) with a
collective waiting for the socket. The reader waits in :func:`conn_wait` (``poll`` on the
socket, then a compare-and-swap 0 -> 1 and a second, zero-timeout ``poll``: a socket a
collective emptied meanwhile is given back; while a collective owns the socket it sleeps on
the word's futex instead of polling) and ends each frame with :func:`conn_done` (1 -> 0, or
3 -> 2: the socket goes straight to the waiting collective, which the reader cannot take it
back from). A collective claims the word with :func:`conn_claim`, which never waits: 0 -> 2
(owned), or 1 -> 3 (the reader is mid-frame: the socket is handed over when that frame is
in, meanwhile the collective moves its other frames -- the receives on that socket gated --
and waits in :func:`conn_await` only when nothing else is left); it gives a claim up with
:func:`conn_unclaim` and releases an owned socket with :func:`conn_release` (waking the
reader).

**Transfer table** (``tp_tcp_xfer``): ``OPW`` int64 words per operation::

    0 fd        1 kind (0 send, 1 receive)
    2 header    send: address of the 64-byte header to send;
                receive: address of the 64-byte header expected (every field is known)
    3 payload address        4 payload bytes
    5 progress (bytes of header + payload done)
    6 after     send: sent once every receive at a table index from word 7 up to this
                one completed (-1: at once)
    7 got       receive: address of a 64-byte buffer for the header as received;
      from      send: the first receive index word 6 covers
    8 gate      the operation does not start while this word is nonzero (the caller clears
                it, e.g. once the bytes a send carries are computed or a receive's buffer is
                free again); it still holds its place in its socket's order.
                Mesh.transfer gates sends, and the receives on a socket its reader
                thread still reads a frame from (claimed, not yet handed over): a gated
                receive on an owned socket would leave it unread (a peer's ABORT frame
                behind it too) until the gate opens
    9 notify    receive: 1 -> the loop returns ``NOTIFY`` (out[0] = its index) as soon as
                it completes, and sets the word to 2 (returned once)

Operations on one socket run in table order (sends and receives separately). A received
header is compared with the expected one byte for byte before any payload byte is read: only
an exact match (kind, group, source, sequence, signature, length) is received into the
payload address. Anything else -- another group's frame, an ABORT, a mismatched call -- is
returned to Python unread beyond its header (status ``FOREIGN``), which validates it with
the ordinary bounded decoder and handles it as the reader thread would. The loop returns
``SLICE`` once ``slice_ms`` of wall time passed since the call, whether bytes moved or not
(the progress words let the next call resume), so the caller can watch aborts and its
deadline: an aborted group is noticed within one slice even while a transfer streams. It
returns ``IDLE`` at once when no operation left can move: each waits on a gate, or is a send
waiting on a receive that does.
"""

from __future__ import annotations

import ctypes
import functools

from torchport import native
from torchport.distributed.wire import Kind

OPW = 10  # int64 words per transfer operation
MAXFD = 64  # distinct sockets one tp_tcp_xfer call can track (Mesh.transfer checks it)
# tp_tcp_xfer status (< 0: -errno)
DONE, SLICE, FOREIGN, SENT, CLOSED, NOTIFY, IDLE = 0, 1, 2, 3, 4, 5, 6
OWN_FREE, OWN_READER, OWN_COLL, OWN_CLAIMED = 0, 1, 2, 3

_SOURCE = r"""
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <linux/futex.h>

#define OPW ${opw}
#define HDR 64
#define MAXFD ${maxfd}

/* May send operation op start: is every receive it waits on (words 7 to 6) in? */
static int tp_send_ready(const int64_t *ops, const int64_t *op, int64_t first_open) {
    if (op[6] < first_open) return 1;  /* also -1: no receive to wait on */
    for (int64_t j = op[7] > first_open ? op[7] : first_open; j <= op[6]; j++) {
        const int64_t *r = ops + j * OPW;
        if (r[1] == 1 && r[5] < HDR + r[4]) return 0;
    }
    return 1;
}

static int64_t tp_ms_now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void tp_futex_wait_us(int32_t *w, int32_t v, int64_t us) {
    struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
    syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, &ts, NULL, 0);
}

static void tp_futex_wait(int32_t *w, int32_t v, int64_t ms) {
    tp_futex_wait_us(w, v, ms * 1000);
}

/* Wake a reader lingering on own (tp_conn_wait) without changing the word: it re-polls and,
   its one linger spent, reads the frame. */
TP_EXPORT void tp_conn_poke(int32_t *own) {
    syscall(SYS_futex, own, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

TP_EXPORT void tp_conn_release(int32_t *own) {
    __atomic_store_n(own, 0, __ATOMIC_RELEASE);
    syscall(SYS_futex, own, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* The reader finished its frame: the socket is free again (1 -> 0), or goes to the collective
   that claimed it meanwhile (3 -> 2). */
TP_EXPORT void tp_conn_done(int32_t *own) {
    for (;;) {
        int32_t v = 1;
        if (__atomic_compare_exchange_n(own, &v, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) break;
        if (v != 3) break;  /* (not the reader's: nothing to give) */
        if (__atomic_compare_exchange_n(own, &v, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) break;
        /* the claim was given up meanwhile (3 -> 1, tp_conn_unclaim): free it */
    }
    syscall(SYS_futex, own, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Reader thread: wait until the socket is readable (or hung up) and this thread owns it.
   1: owned, read one frame then tp_conn_done; 0: nothing within slice_ms. Ownership is
   only ever taken with the 0 -> 1 compare-and-swap, and kept only while the socket is still
   readable after it (a collective may have drained it between the poll and the swap: the
   reader would then block in recv holding the socket).
   Linger: a COLL frame (its header peeked) that arrives while the socket is free is left in
   the socket for up to linger_us (big_linger_us when its payload is at least big_bytes and
   that is longer), once, for this rank's collective to take the socket and receive it in
   place (no copy through a mailbox buffer, no reader wake-up); unless stream (the caller
   read a frame just before: frames arriving back to back are read at once) or *waiters is
   non-zero (a consumer waits on the mailbox for what this reader delivers: nobody would
   take the socket). Any time the word was taken meanwhile re-arms it; tp_conn_poke ends a
   linger at once.
   Any other kind is read at once. */
TP_EXPORT int64_t tp_conn_wait(int32_t *own, int64_t fd, int64_t slice_ms, int64_t linger_us,
                               int64_t big_linger_us, int64_t big_bytes, int64_t stream,
                               const int32_t *waiters) {
    int64_t end = tp_ms_now() + slice_ms;
    int may = linger_us > 0 || big_linger_us > 0;
    int linger = may && !stream;
    for (;;) {
        int64_t left = end - tp_ms_now();
        if (left <= 0) return 0;
        int32_t v = __atomic_load_n(own, __ATOMIC_ACQUIRE);
        if (v != 0) { tp_futex_wait(own, v, left); linger = may; continue; }
        struct pollfd p = { (int)fd, POLLIN, 0 };
        int r = poll(&p, 1, 0);
        if (r == 0) {  /* idle: the next frame to arrive may be lingered on */
            linger = may;
            r = poll(&p, 1, (int)left);
        }
        int failed = r < 0 && errno != EINTR;  /* owned, the reader's recv reports it */
        if (r <= 0 && !failed) continue;
        if (linger && !failed && __atomic_load_n(waiters, __ATOMIC_ACQUIRE) == 0) {
            unsigned char h[HDR];
            ssize_t k = recv((int)fd, h, HDR, MSG_PEEK | MSG_DONTWAIT);
            if (k == HDR && memcmp(h, "TPRT", 4) == 0 && h[5] == ${coll}) {
                uint64_t length;
                memcpy(&length, h + HDR - 8, 8);  /* the header's last field (little-endian) */
                int64_t us = linger_us;
                if (big_linger_us > us && length >= (uint64_t)big_bytes) us = big_linger_us;
                linger = 0;
                if (us > 0) {
                    tp_futex_wait_us(own, 0, us);  /* at once if already taken; a poke ends it */
                    continue;
                }
            }
        }
        int32_t zero = 0;
        if (!__atomic_compare_exchange_n(own, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        if (failed) return 1;
        p.revents = 0;
        int q = poll(&p, 1, 0);
        if (q > 0 || (q < 0 && errno != EINTR)) return 1;  /* readable or failed: recv says */
        tp_conn_done(own);  /* emptied before the swap: give it back, wait again */
    }
}

/* A collective asks for the socket, without waiting: 1 owned (0 -> 2); -1 claimed (1 -> 3:
   the reader is mid-frame and hands the socket over when it is in, tp_conn_done); 0 another
   collective owns or claimed it. */
TP_EXPORT int64_t tp_conn_claim(int32_t *own) {
    for (;;) {
        int32_t v = 0;
        if (__atomic_compare_exchange_n(own, &v, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 1;
        if (v != 1) return 0;
        if (__atomic_compare_exchange_n(own, &v, 3, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return -1;
        /* the reader finished (0) or took another frame (1) meanwhile: ask again */
    }
}

/* Give up a claim (tp_conn_claim returned -1): the reader keeps the socket (3 -> 1), or, when
   it was handed over meanwhile (2), the socket is released. */
TP_EXPORT void tp_conn_unclaim(int32_t *own) {
    int32_t v = 3;
    if (!__atomic_compare_exchange_n(own, &v, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        tp_conn_release(own);
}

/* Wait up to us microseconds for a claimed socket to be handed over; 1 once it is (the word
   is 2, the caller owns it). */
TP_EXPORT int64_t tp_conn_await(int32_t *own, int64_t us) {
    if (__atomic_load_n(own, __ATOMIC_ACQUIRE) == 3) tp_futex_wait_us(own, 3, us);
    return __atomic_load_n(own, __ATOMIC_ACQUIRE) == 2;
}

/* Pin the calling thread to one CPU: cpu >= 0 that one (when the thread's mask allows it),
   else (or cpu = -1) the CPU it runs on; tp_pin(-2) restores the mask saved by the pin.
   Returns the CPU pinned to (-1 on failure). A sender that migrates mid-stream can reorder
   loopback segments: packets queued on the old CPU's backlog are processed after the new
   CPU's, which TCP takes for loss. */
#define TP_MASK_WORDS 16
static __thread unsigned long tp_saved_mask[TP_MASK_WORDS];
TP_EXPORT int64_t tp_pin(int64_t cpu) {
    if (cpu == -2)
        return syscall(SYS_sched_setaffinity, 0, sizeof tp_saved_mask, tp_saved_mask) < 0 ? -1 : 0;
    if (syscall(SYS_sched_getaffinity, 0, sizeof tp_saved_mask, tp_saved_mask) < 0) return -1;
    if (cpu < 0 || cpu >= 64 * TP_MASK_WORDS || !((tp_saved_mask[cpu / 64] >> (cpu % 64)) & 1UL)) {
        unsigned now = 0;
        if (syscall(SYS_getcpu, &now, NULL, NULL) < 0) return -1;
        cpu = now;
    }
    if (cpu >= 64 * TP_MASK_WORDS) return -1;
    unsigned long one[TP_MASK_WORDS] = {0};
    one[cpu / 64] = 1UL << (cpu % 64);
    return syscall(SYS_sched_setaffinity, 0, sizeof one, one) < 0 ? -1 : cpu;
}

/* The table's bookkeeping off the hot loop (one pass each, however many operations). */

/* The distinct sockets of the unfinished operations ops[from, n) into fds (at most cap of them;
   the count is returned). */
TP_EXPORT int64_t tp_tcp_open_fds(const int64_t *ops, int64_t from, int64_t n, int64_t *fds,
                                  int64_t cap) {
    int64_t nf = 0;
    for (int64_t i = from; i < n; i++) {
        const int64_t *op = ops + i * OPW;
        if (op[5] >= HDR + op[4]) continue;
        int seen = 0;
        for (int64_t k = 0; k < nf && !seen; k++) seen = fds[k] == op[0];
        if (!seen && nf < cap) fds[nf++] = op[0];
    }
    return nf;
}

/* After an error: nothing is computed from a receive any more (word 9 cleared) and every
   operation that is not part-way, or is on one of the nb sockets in broken, counts as done; the
   indices of the operations part-way go to rows (at most cap; the count is returned). */
TP_EXPORT int64_t tp_tcp_settle(int64_t *ops, int64_t n, const int64_t *broken, int64_t nb,
                                int64_t *rows, int64_t cap) {
    int64_t nr = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t *op = ops + i * OPW;
        op[9] = 0;
        int part = op[5] > 0 && op[5] < HDR + op[4];
        for (int64_t k = 0; k < nb && part; k++) part = broken[k] != op[0];
        if (part && nr < cap) rows[nr++] = i;
        else op[5] = HDR + op[4];
    }
    return nr;
}

/* Move the operations of the table (module docstring). out[0]: the operation a FOREIGN,
   NOTIFY, CLOSED or error status refers to. SENT: every send finished (returned once, when
   sends were pending at entry and receives remain) so the caller may release its send locks. */
TP_EXPORT int64_t tp_tcp_xfer(int64_t *ops, int64_t n, int64_t slice_ms, int64_t *out) {
    int sends_at_entry = 0;
    for (int64_t i = 0; i < n; i++)
        if (ops[i * OPW + 1] == 0 && ops[i * OPW + 5] < HDR + ops[i * OPW + 4]) sends_at_entry = 1;
    int64_t end = tp_ms_now() + slice_ms;
    for (;;) {
        int progress = 0, pending = 0, sends_pending = 0;
        int64_t first_open = n;  /* the first unfinished receive */
        for (int64_t i = 0; i < n && first_open == n; i++)
            if (ops[i * OPW + 1] == 1 && ops[i * OPW + 5] < HDR + ops[i * OPW + 4]) first_open = i;
        int64_t busy_s[MAXFD], busy_r[MAXFD];
        int nbs = 0, nbr = 0;
        struct pollfd pf[MAXFD];
        int npf = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t *op = ops + i * OPW;
            int64_t fd = op[0], total = HDR + op[4];
            if (op[5] >= total) continue;
            pending++;
            int is_send = op[1] == 0;
            if (is_send) sends_pending++;
            int64_t *busy = is_send ? busy_s : busy_r;
            int *nb = is_send ? &nbs : &nbr;
            int seen = 0;
            for (int k = 0; k < *nb; k++) seen |= busy[k] == fd;
            if (seen) continue;  /* an earlier operation on this socket is unfinished */
            if (*nb < MAXFD) busy[(*nb)++] = fd;
            if (op[8]) continue;  /* gated: later operations on this socket wait behind it */
            short want = 0;
            if (is_send) {
                if (!tp_send_ready(ops, op, first_open)) continue;
                for (;;) {
                    struct iovec iov[2];
                    int niov = 0;
                    int64_t d = op[5];
                    if (d < HDR) {
                        iov[niov].iov_base = (char *)op[2] + d;
                        iov[niov++].iov_len = (size_t)(HDR - d);
                        if (op[4]) {
                            iov[niov].iov_base = (char *)op[3];
                            iov[niov++].iov_len = (size_t)op[4];
                        }
                    } else {
                        iov[niov].iov_base = (char *)op[3] + (d - HDR);
                        iov[niov++].iov_len = (size_t)(total - d);
                    }
                    struct msghdr m = {0};
                    m.msg_iov = iov; m.msg_iovlen = niov;
                    ssize_t k = sendmsg((int)fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
                    if (k < 0) {
                        if (errno == EINTR) continue;
                        if (errno == EAGAIN || errno == EWOULDBLOCK) { want = POLLOUT; break; }
                        out[0] = i; return -errno;
                    }
                    op[5] += k; progress = 1;
                    if (op[5] >= total) break;
                }
            } else {
                for (;;) {
                    int64_t d = op[5];
                    char *dst; size_t len;
                    if (d < HDR) { dst = (char *)op[7] + d; len = (size_t)(HDR - d); }
                    else { dst = (char *)op[3] + (d - HDR); len = (size_t)(total - d); }
                    ssize_t k = recv((int)fd, dst, len, MSG_DONTWAIT);
                    if (k < 0) {
                        if (errno == EINTR) continue;
                        if (errno == EAGAIN || errno == EWOULDBLOCK) { want = POLLIN; break; }
                        out[0] = i; return -errno;
                    }
                    if (k == 0) { out[0] = i; return ${closed}; }
                    op[5] += k; progress = 1;
                    if (d < HDR && op[5] == HDR && memcmp((char *)op[7], (char *)op[2], HDR)) {
                        out[0] = i; return ${foreign};
                    }
                    if (op[5] >= total) break;
                }
                if (op[5] >= total && op[9] == 1) { op[9] = 2; out[0] = i; return ${notify}; }
            }
            if (want && npf < MAXFD) {
                int j = 0;
                while (j < npf && pf[j].fd != (int)fd) j++;
                if (j == npf) { pf[npf].fd = (int)fd; pf[npf].events = 0; pf[npf].revents = 0; npf++; }
                pf[j].events |= want;
            }
        }
        if (!pending) return ${done};
        if (sends_at_entry && !sends_pending) return ${sent};
        /* A slice is wall time since entry, progress or not: a transfer that keeps moving
           bytes (or a peer trickling them) must still return for the abort/deadline checks. */
        int64_t left = end - tp_ms_now();
        if (progress) { if (left <= 0) return ${slice}; continue; }
        if (left <= 0) return ${slice};
        if (npf == 0) return ${idle};  /* every operation left waits on a gate or a receive */
        int r = poll(pf, npf, (int)left);
        if (r < 0 && errno != EINTR) { out[0] = -1; return -errno; }
    }
}
"""


class TcpLib:
    """The compiled loop with ctypes signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.conn_wait = native.c_function(
            lib, "tp_conn_wait", [p, i64, i64, i64, i64, i64, i64, p], i64
        )
        self.conn_poke = native.c_function(lib, "tp_conn_poke", [p], None)
        self.conn_done = native.c_function(lib, "tp_conn_done", [p], None)
        self.conn_claim = native.c_function(lib, "tp_conn_claim", [p], i64)
        self.conn_unclaim = native.c_function(lib, "tp_conn_unclaim", [p], None)
        self.conn_await = native.c_function(lib, "tp_conn_await", [p, i64], i64)
        self.conn_release = native.c_function(lib, "tp_conn_release", [p], None)
        self.pin = native.c_function(lib, "tp_pin", [i64], i64)
        self.open_fds = native.c_function(lib, "tp_tcp_open_fds", [p, i64, i64, p, i64], i64)
        self.settle = native.c_function(lib, "tp_tcp_settle", [p, i64, p, i64, p, i64], i64)
        self.xfer = native.c_function(lib, "tp_tcp_xfer", [p, i64, i64, p], i64)


@functools.cache
def tcp_lib() -> TcpLib:
    """Build (or load from the cache) the TCP transfer loop."""
    src = native.render(
        _SOURCE,
        opw=OPW,
        maxfd=MAXFD,
        done=DONE,
        slice=SLICE,
        foreign=FOREIGN,
        sent=SENT,
        closed=CLOSED,
        notify=NOTIFY,
        idle=IDLE,
        coll=int(Kind.COLL),
    )
    return TcpLib(native.build(src, name="tp_tcp"))
