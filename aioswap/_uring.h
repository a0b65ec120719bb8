/* io_uring, in the shape of io_submit/io_getevents.
 *
 * A backend of aioswap's queue (aioswap/_aio.pyx) beside kernel AIO and _kthreads.h: the
 * queue hands it the same iocbs and reaps the same io_events. Each iocb becomes one SQE
 * (user_data = the iocb); each CQE becomes one io_event {aio_data, iocb, res, 0}. Raw
 * syscalls against <linux/io_uring.h>, no liburing. Needs IORING_FEAT_EXT_ARG (Linux 5.11)
 * for timed waits. Calls return -1 with errno set on failure, like the system calls they
 * stand in for.
 *
 * Threading: uring_submit may run on several threads at once and beside uring_getevents,
 * which runs on one thread at a time (the reaper). The SQ side (SQEs, the SQ tail, the table
 * of registered buffers) is under `mu`; every io_uring_enter that submits runs under `mu`
 * too, so a submitter that takes its SQEs back after a hard error knows nobody else's enter
 * consumed them. The reaper alone moves the CQ head, and waits without `mu`. The kernel
 * ties each request to the thread that submitted it; when that thread exits first, some of
 * its buffered I/O fails -EFAULT/-ECANCELED, and the reaper runs it again (uring_harvest_).
 *
 * Setup flags: no IORING_SETUP_SINGLE_ISSUER / DEFER_TASKRUN (they need one submitting task,
 * and run completions only when that task enters the ring: our reaper is another thread)
 * and no COOP_TASKRUN. A completion is posted as task work of the task that submitted the
 * request; without COOP_TASKRUN that task is interrupted (TWA_SIGNAL) and runs it at once,
 * while with it the CQE would wait until the submitter next enters the kernel, and a
 * submitter busy in pure userspace (the interpreter) would leave the reaper waiting forever.
 * CQSIZE makes the CQ hold 2*cap entries, more than can ever be held, so it cannot
 * overflow; SUBMIT_ALL keeps a bad SQE from stalling the ones after it. NO_SQARRAY is left
 * out for simplicity: the SQ index array is set to the identity once at setup.
 */
#ifndef AIOSWAP_URING_H
#define AIOSWAP_URING_H

#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* iocb->aio_flags bit (ours, never passed to io_submit): run this read or write in the
 * submitting thread, under `mu`, and post its result through an IORING_OP_NOP (its result
 * kept in aio_reserved2 meanwhile). For files io_uring cannot start without blocking and
 * would hand to a kernel worker thread one by one: tmpfs, whose O_DIRECT and buffered I/O
 * is a memory copy (kernel AIO runs it inside io_submit too). */
#define URING_IOCB_INLINE (1U << 31)

#if defined(__has_include)
#if !__has_include(<linux/io_uring.h>)
#define AIOSWAP_NO_URING 1             /* kernel headers older than 5.1 (e.g. manylinux) */
#endif
#endif

#ifdef AIOSWAP_NO_URING
/* Built without <linux/io_uring.h>: the backend is absent, and setting it up says ENOSYS,
 * so "auto" goes on to kernel AIO. */
#define IORING_SETUP_CQSIZE (1U << 3)
#define IORING_SETUP_SUBMIT_ALL (1U << 7)
typedef struct uring_faults {
    int setup_errno, einval_flags, register_errno, files_errno, cqe_eagain, cqe_short;
} uring_faults;
static __attribute__((unused)) uring_faults uring_inject;
typedef struct uring { int unused; } uring;
static __attribute__((unused)) int uring_setup(uring **out, int cap, unsigned *flags_used)
{
    (void)cap;
    *out = NULL;
    if (flags_used)
        *flags_used = 0;
    errno = ENOSYS;
    return -1;
}
static __attribute__((unused)) long uring_submit(uring *u, long n, struct iocb **cbs)
{
    (void)u; (void)n; (void)cbs;
    errno = ENOSYS;
    return -1;
}
static __attribute__((unused)) long uring_getevents(uring *u, long min_nr, long max_nr,
                                                    struct io_event *out,
                                                    const struct timespec *timeout)
{
    (void)u; (void)min_nr; (void)max_nr; (void)out; (void)timeout;
    errno = ENOSYS;
    return -1;
}
static __attribute__((unused)) int uring_register_buffer(uring *u, void *addr, size_t len)
{
    (void)u; (void)addr; (void)len;
    errno = ENOSYS;
    return -1;
}
static __attribute__((unused)) int uring_unregister_buffer(uring *u, void *addr, size_t len)
{
    (void)u; (void)addr; (void)len;
    errno = ENOSYS;
    return -1;
}
static __attribute__((unused)) int uring_covers(uring *u, uint64_t addr, uint64_t len)
{
    (void)u; (void)addr; (void)len;
    return 0;
}
static __attribute__((unused)) void uring_counts(uring *u, long *fixed_pieces, int *registered)
{
    (void)u;
    *fixed_pieces = 0;
    *registered = 0;
}
static __attribute__((unused)) void uring_file_counts(uring *u, long *fixed_sqes, int *files)
{
    (void)u;
    *fixed_sqes = 0;
    *files = -1;
}
static __attribute__((unused)) void uring_file_open(int fd) { (void)fd; }
static __attribute__((unused)) void uring_file_close(int fd) { (void)fd; }
static __attribute__((unused)) void uring_after_fork_child(void) {}
static __attribute__((unused)) void uring_destroy(uring *u) { (void)u; }
static __attribute__((unused)) void uring_forget(uring *u) { (void)u; }
#else
#include <linux/io_uring.h>

/* Older <linux/io_uring.h> and <sys/syscall.h> may lack these; the values are kernel ABI. */
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif
#ifndef IORING_SETUP_SUBMIT_ALL
#define IORING_SETUP_SUBMIT_ALL (1U << 7)
#endif
#ifndef IORING_FEAT_EXT_ARG
#define IORING_FEAT_EXT_ARG (1U << 8)
#endif
#ifndef IORING_ENTER_EXT_ARG
#define IORING_ENTER_EXT_ARG (1U << 3)
#endif
#ifndef IORING_RSRC_REGISTER_SPARSE
#define IORING_RSRC_REGISTER_SPARSE (1U << 0)
#endif
#define URING_REGISTER_BUFFERS2 15          /* IORING_REGISTER_BUFFERS2 (an enum upstream) */
#define URING_REGISTER_BUFFERS_UPDATE 16    /* IORING_REGISTER_BUFFERS_UPDATE */
#define URING_REGISTER_FILES2 13            /* IORING_REGISTER_FILES2 */
#define URING_REGISTER_FILES_UPDATE2 14     /* IORING_REGISTER_FILES_UPDATE2 */

/* Our own copies of ABI structs that older headers lack (same layout as upstream). */
struct uring_ts_ {
    int64_t tv_sec;
    int64_t tv_nsec;
};
struct uring_getevents_arg_ {               /* struct io_uring_getevents_arg */
    uint64_t sigmask;
    uint32_t sigmask_sz;
    uint32_t pad;
    uint64_t ts;
};
struct uring_rsrc_register_ {               /* struct io_uring_rsrc_register */
    uint32_t nr;
    uint32_t flags;
    uint64_t resv2;
    uint64_t data;
    uint64_t tags;
};
struct uring_rsrc_update2_ {                /* struct io_uring_rsrc_update2 */
    uint32_t offset;
    uint32_t resv;
    uint64_t data;
    uint64_t tags;
    uint32_t nr;
    uint32_t resv2;
};

#define URING_SLOTS 64                      /* registered-buffer table */
#define URING_FILE_SLOTS 64                 /* registered-file table */
#define URING_FIXABLE_FDS 4096              /* fds below this may be registered */
#define URING_BUF_MAX (1UL << 30)           /* the kernel's limit on one registered buffer */
#define URING_RW_MAX 0x7ffff000U            /* MAX_RW_COUNT: longer pieces come back short */
#define URING_EAGAIN_MAX 1000               /* re-queues in a row before -EAGAIN is returned */
#define URING_ORPHAN_MAX 3                  /* re-queues of one piece for -EFAULT/-ECANCELED */

#define URING_API static __attribute__((unused))

/* Fault injection for tests; all zero in use. Counters are taken atomically.
 * setup_errno: uring_setup fails with it. einval_flags: every setup attempt with flags
 * fails with EINVAL (setup steps down to plain). register_errno: uring_register_buffer
 * fails with it. files_errno: the table of registered files is refused at setup (the ring
 * then names every file by its fd). cqe_eagain = N: the next N read/write CQEs are taken as
 * -EAGAIN (and re-queued). cqe_short = N: the next N read/write CQEs with res >= 8192 come
 * back short: half, rounded down to a multiple of 4096, so an O_DIRECT queue does not take
 * it for the end of the file (the kernel moved it all; the queue moves the rest again). */
typedef struct uring_faults {
    int setup_errno;
    int einval_flags;
    int register_errno;
    int files_errno;
    int cqe_eagain;
    int cqe_short;
} uring_faults;
static uring_faults uring_inject;

enum { URING_REG_NONE, URING_REG_SPARSE, URING_REG_ONCE, URING_REG_ONCE_USED };

typedef struct uring_reg_ {
    uint64_t start, end;                    /* [start, end) */
    unsigned slot;
} uring_reg_;

typedef struct uring_retry_ {
    struct iocb *cb;
    int n;
} uring_retry_;

typedef struct uring {
    pthread_mutex_t mu;         /* the SQ side: SQEs, sq tail, regs; every submitting enter */
    pthread_mutex_t reg_mu;     /* serialises uring_(un)register_buffer */
    int fd;
    int cap;                    /* most pieces held at once (in the SQ, in flight, in the CQ) */
    long held;                  /* atomic */
    unsigned flags;
    void *sq_map, *cq_map;      /* cq_map == sq_map with IORING_FEAT_SINGLE_MMAP */
    size_t sq_len, cq_len, sqes_len;
    struct io_uring_sqe *sqes;
    unsigned *sq_head, *sq_tail, *sq_flags, *sq_array;
    unsigned sq_mask, sq_entries;
    unsigned tail;              /* our SQ tail (under mu) */
    unsigned *cq_head, *cq_tail;
    unsigned cq_mask;
    struct io_uring_cqe *cqes;
    int reg_mode;               /* URING_REG_* */
    uint64_t slots_used;        /* bit per slot of the sparse table */
    int nreg;
    uring_reg_ reg[URING_SLOTS];
    uring_retry_ *retry;        /* reaper only: pieces re-queued for -EFAULT/-ECANCELED */
    int nretry;
    long nfixed;                /* READ_FIXED/WRITE_FIXED SQEs filled (under mu) */
    int files;                  /* a table of URING_FILE_SLOTS registered files (5.19) */
    int file_fd[URING_FILE_SLOTS];  /* the fd in each slot (under mu); -1 free, -2 stuck */
    int nfile_hi;               /* slots [0, nfile_hi) have been used */
    long nfixed_files;          /* SQEs filled that named a registered file (under mu) */
    struct uring *all_prev, *all_next;  /* every live ring (uring_all_mu) */
} uring;

/* Registered files. A file that aioswap opened and owns (an AioFile) is "fixable" from its
 * open (uring_file_open) to just before its close (uring_file_close). The first SQE that
 * names it on a ring registers it in that ring's sparse table (one io_uring_register), and
 * every SQE after goes IOSQE_FIXED_FILE: the kernel then takes no file reference per
 * request. Closing takes it out of every ring's table before the fd is closed, so a slot
 * never outlives its fd, and an fd number reused for another file is never taken for the
 * old one; nothing is in flight on a file that is being closed (requests hold it open).
 * Fds the caller owns are never registered: they may be closed at any time. */
static uint64_t uring_fixable_[URING_FIXABLE_FDS / 64];
static pthread_mutex_t uring_all_mu = PTHREAD_MUTEX_INITIALIZER;
static struct uring *uring_all_;

static int uring_fixable_fd_(int fd)
{
    return fd >= 0 && fd < URING_FIXABLE_FDS
           && (__atomic_load_n(&uring_fixable_[fd / 64], __ATOMIC_RELAXED) >> (fd % 64)) & 1;
}

static int uring_take_(int *counter)
{
    int v = __atomic_load_n(counter, __ATOMIC_RELAXED);
    while (v > 0)
        if (__atomic_compare_exchange_n(counter, &v, v - 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return 1;
    return 0;
}

static int uring_enter_(int fd, unsigned to_submit, unsigned min_complete, unsigned flags,
                        void *arg, size_t argsz)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz);
}

static int uring_register_(int fd, unsigned op, void *arg, unsigned nr)
{
    return (int)syscall(__NR_io_uring_register, fd, op, arg, nr);
}

static void uring_unmap_(uring *u)
{
    if (u->sqes)
        munmap(u->sqes, u->sqes_len);
    if (u->cq_map && u->cq_map != u->sq_map)
        munmap(u->cq_map, u->cq_len);
    if (u->sq_map)
        munmap(u->sq_map, u->sq_len);
}

/* 0, or -1 with errno: a ring for `cap` pieces held at once; *flags_used (may be NULL) gets
 * the IORING_SETUP_* flags the kernel took. EINVAL steps down the flags; other errors
 * (EPERM: kernel.io_uring_disabled or seccomp; ENOSYS; ENOMEM; EMFILE) fail at once. */
URING_API int uring_setup(uring **out, int cap, unsigned *flags_used)
{
    static const unsigned tries[] = {IORING_SETUP_CQSIZE | IORING_SETUP_SUBMIT_ALL,
                                     IORING_SETUP_CQSIZE, 0};
    struct io_uring_params p;
    struct uring_rsrc_register_ rr;
    uring *u;
    void *m;
    unsigned i;
    int fd = -1, e = EINVAL;
    *out = NULL;
    if (uring_inject.setup_errno) {
        errno = uring_inject.setup_errno;
        return -1;
    }
    if (cap < 1 || cap > (1 << 20)) {
        errno = EINVAL;
        return -1;
    }
    for (i = 0; i < sizeof tries / sizeof tries[0]; i++) {
        if (uring_inject.einval_flags && tries[i]) {
            e = EINVAL;
            continue;
        }
        memset(&p, 0, sizeof p);
        p.flags = tries[i];
        if (p.flags & IORING_SETUP_CQSIZE)
            p.cq_entries = 2 * (unsigned)cap;
        fd = (int)syscall(__NR_io_uring_setup, (unsigned)cap, &p);
        if (fd >= 0)
            break;
        e = errno;
        if (e != EINVAL)
            break;
    }
    if (fd < 0) {
        errno = e;
        return -1;
    }
    if (!(p.features & IORING_FEAT_EXT_ARG) || p.cq_entries < 2 * (unsigned)cap) {
        close(fd);
        errno = ENOSYS;
        return -1;
    }
    u = (uring *)calloc(1, sizeof(uring));
    if (u)
        u->retry = (uring_retry_ *)calloc((size_t)cap, sizeof(uring_retry_));
    if (!u || !u->retry) {
        free(u);
        close(fd);
        errno = ENOMEM;
        return -1;
    }
    u->fd = fd;
    u->cap = cap;
    u->flags = p.flags;
    u->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    u->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (u->cq_len > u->sq_len)
            u->sq_len = u->cq_len;
        u->cq_len = u->sq_len;
    }
    m = mmap(NULL, u->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
             IORING_OFF_SQ_RING);
    if (m == MAP_FAILED)
        goto fail;
    u->sq_map = m;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        u->cq_map = m;
    } else {
        m = mmap(NULL, u->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                 IORING_OFF_CQ_RING);
        if (m == MAP_FAILED)
            goto fail;
        u->cq_map = m;
    }
    u->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    m = mmap(NULL, u->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
             IORING_OFF_SQES);
    if (m == MAP_FAILED)
        goto fail;
    u->sqes = (struct io_uring_sqe *)m;
    u->sq_head = (unsigned *)((char *)u->sq_map + p.sq_off.head);
    u->sq_tail = (unsigned *)((char *)u->sq_map + p.sq_off.tail);
    u->sq_flags = (unsigned *)((char *)u->sq_map + p.sq_off.flags);
    u->sq_array = (unsigned *)((char *)u->sq_map + p.sq_off.array);
    u->sq_mask = *(unsigned *)((char *)u->sq_map + p.sq_off.ring_mask);
    u->sq_entries = p.sq_entries;
    u->tail = *u->sq_tail;
    for (i = 0; i < p.sq_entries; i++)
        u->sq_array[i] = i;     /* SQE i is always entry i */
    u->cq_head = (unsigned *)((char *)u->cq_map + p.cq_off.head);
    u->cq_tail = (unsigned *)((char *)u->cq_map + p.cq_off.tail);
    u->cq_mask = *(unsigned *)((char *)u->cq_map + p.cq_off.ring_mask);
    u->cqes = (struct io_uring_cqe *)((char *)u->cq_map + p.cq_off.cqes);
    /* An empty table of URING_SLOTS buffers (5.19), filled by uring_register_buffer; else
     * one plain IORING_REGISTER_BUFFERS is left. */
    memset(&rr, 0, sizeof rr);
    rr.nr = URING_SLOTS;
    rr.flags = IORING_RSRC_REGISTER_SPARSE;
    if (uring_register_(fd, URING_REGISTER_BUFFERS2, &rr, sizeof rr) == 0)
        u->reg_mode = URING_REG_SPARSE;
    else
        u->reg_mode = URING_REG_ONCE;
    /* An empty table of URING_FILE_SLOTS files (5.19), filled as fixable files come. */
    memset(&rr, 0, sizeof rr);
    rr.nr = URING_FILE_SLOTS;
    rr.flags = IORING_RSRC_REGISTER_SPARSE;
    if (!uring_inject.files_errno
        && uring_register_(fd, URING_REGISTER_FILES2, &rr, sizeof rr) == 0)
        u->files = 1;
    for (i = 0; i < URING_FILE_SLOTS; i++)
        u->file_fd[i] = -1;
    pthread_mutex_init(&u->mu, NULL);
    pthread_mutex_init(&u->reg_mu, NULL);
    pthread_mutex_lock(&uring_all_mu);
    u->all_next = uring_all_;
    if (uring_all_)
        uring_all_->all_prev = u;
    uring_all_ = u;
    pthread_mutex_unlock(&uring_all_mu);
    if (flags_used)
        *flags_used = p.flags;
    *out = u;
    return 0;
fail:
    e = errno;
    uring_unmap_(u);
    close(fd);
    free(u->retry);
    free(u);
    errno = e;
    return -1;
}

/* Under mu: the slot of the registered file fd in u's table, registering it now if it is
 * fixable and a slot is free; -1: name it by its fd (not fixable, no table, table full,
 * or the kernel refused it). */
static int uring_file_slot_(uring *u, int fd)
{
    struct uring_rsrc_update2_ up;
    int i, s = -1;
    if (!u->files || !uring_fixable_fd_(fd))
        return -1;
    for (i = 0; i < u->nfile_hi; i++) {
        if (u->file_fd[i] == fd)
            return i;
        if (s < 0 && u->file_fd[i] == -1)     /* -2: a slot that failed to clear */
            s = i;
    }
    if (s < 0) {
        if (u->nfile_hi == URING_FILE_SLOTS)
            return -1;
        s = u->nfile_hi;
    }
    memset(&up, 0, sizeof up);
    up.offset = (unsigned)s;
    up.data = (uint64_t)(uintptr_t)&fd;
    up.nr = 1;
    if (uring_register_(u->fd, URING_REGISTER_FILES_UPDATE2, &up, sizeof up) != 1)
        return -1;
    u->file_fd[s] = fd;
    if (s == u->nfile_hi)
        u->nfile_hi++;
    return s;
}

/* Under mu: fill one SQE from cb; 0, or -1 for an opcode we do not know. */
static int uring_fill_(uring *u, struct io_uring_sqe *sqe, struct iocb *cb)
{
    uint64_t n = cb->aio_nbytes;
    int i;
    memset(sqe, 0, sizeof *sqe);
    sqe->user_data = (uint64_t)(uintptr_t)cb;
    if (!(cb->aio_flags & URING_IOCB_INLINE)
        && (i = uring_file_slot_(u, (int)cb->aio_fildes)) >= 0) {
        sqe->fd = i;
        sqe->flags = IOSQE_FIXED_FILE;
        u->nfixed_files++;
    } else {
        sqe->fd = (int32_t)cb->aio_fildes;
    }
    switch (cb->aio_lio_opcode) {
    case IOCB_CMD_PREAD:
    case IOCB_CMD_PWRITE:
        if (n > URING_RW_MAX)
            n = URING_RW_MAX;   /* comes back short; the queue moves the rest */
        sqe->opcode = cb->aio_lio_opcode == IOCB_CMD_PREAD ? IORING_OP_READ : IORING_OP_WRITE;
        sqe->addr = cb->aio_buf;
        sqe->len = (uint32_t)n;
        sqe->off = (uint64_t)cb->aio_offset;
        sqe->rw_flags = (uint32_t)cb->aio_rw_flags;
        if (cb->aio_flags & URING_IOCB_INLINE) {
            ssize_t r;
            do {
                if (cb->aio_lio_opcode == IOCB_CMD_PREAD)
                    r = pread((int)cb->aio_fildes, (void *)(uintptr_t)cb->aio_buf, (size_t)n,
                              (off_t)cb->aio_offset);
                else
                    r = pwrite((int)cb->aio_fildes, (const void *)(uintptr_t)cb->aio_buf,
                               (size_t)n, (off_t)cb->aio_offset);
            } while (r < 0 && errno == EINTR);
            cb->aio_reserved2 = (uint64_t)(int64_t)(r < 0 ? -errno : r);
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = IORING_OP_NOP;
            sqe->user_data = (uint64_t)(uintptr_t)cb;
            return 0;
        }
        for (i = 0; i < u->nreg; i++) {
            if (cb->aio_buf >= u->reg[i].start && cb->aio_buf + n <= u->reg[i].end) {
                sqe->opcode = sqe->opcode == IORING_OP_READ ? IORING_OP_READ_FIXED
                                                            : IORING_OP_WRITE_FIXED;
                sqe->buf_index = (uint16_t)u->reg[i].slot;
                u->nfixed++;
                break;
            }
        }
        return 0;
    case IOCB_CMD_FSYNC:
        sqe->opcode = IORING_OP_FSYNC;
        return 0;
    case IOCB_CMD_FDSYNC:
        sqe->opcode = IORING_OP_FSYNC;
        sqe->fsync_flags = IORING_FSYNC_DATASYNC;
        return 0;
    }
    return -1;
}

/* Under mu: hand the kernel every SQE it has not consumed; how many are left unconsumed.
 * A failure leaves them in the SQ for the next enter. */
static unsigned uring_flush_(uring *u)
{
    unsigned pend = u->tail - __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE);
    if (pend)
        uring_enter_(u->fd, pend, 0, 0, NULL, 0);
    return u->tail - __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE);
}

/* Queue n pieces; how many were taken (-1/EAGAIN when none fit). Taken pieces that the
 * kernel did not consume at once (EAGAIN/EBUSY/EINTR/ENOMEM from io_uring_enter) stay in
 * the SQ and go with the next enter (a submit, or the reaper's uring_getevents). A hard
 * error with none of ours consumed takes them back: -1 with errno. */
URING_API long uring_submit(uring *u, long n, struct iocb **cbs)
{
    unsigned tail0, head, used;
    long i, room;
    int r, e;
    pthread_mutex_lock(&u->mu);
    room = u->cap - __atomic_load_n(&u->held, __ATOMIC_ACQUIRE);
    head = __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE);
    used = u->tail - head;
    if (room > (long)(u->sq_entries - used))
        room = (long)(u->sq_entries - used);
    if (n > room)
        n = room;
    if (n <= 0) {
        pthread_mutex_unlock(&u->mu);
        errno = EAGAIN;
        return -1;
    }
    tail0 = u->tail;
    for (i = 0; i < n; i++)
        if (uring_fill_(u, &u->sqes[(tail0 + (unsigned)i) & u->sq_mask], cbs[i]) < 0)
            break;
    if (i == 0) {
        pthread_mutex_unlock(&u->mu);
        errno = EINVAL;         /* as io_submit: an iocb we cannot run, and it came first */
        return -1;
    }
    n = i;
    u->tail = tail0 + (unsigned)n;
    __atomic_add_fetch(&u->held, n, __ATOMIC_ACQ_REL);
    __atomic_store_n(u->sq_tail, u->tail, __ATOMIC_RELEASE);
    r = uring_enter_(u->fd, u->tail - head, 0, 0, NULL, 0);
    if (r < 0) {
        e = errno;
        if (e != EAGAIN && e != EBUSY && e != EINTR && e != ENOMEM) {
            unsigned done = __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE) - tail0;
            if ((int)done < 0)
                done = 0;       /* not even the ones before ours */
            if ((long)done < n) {       /* take back what the kernel has not seen */
                u->tail = tail0 + done;
                __atomic_store_n(u->sq_tail, u->tail, __ATOMIC_RELEASE);
                __atomic_sub_fetch(&u->held, n - (long)done, __ATOMIC_ACQ_REL);
                n = (long)done;
            }
            if (n == 0) {
                pthread_mutex_unlock(&u->mu);
                errno = e;
                return -1;
            }
        }
    }
    pthread_mutex_unlock(&u->mu);
    return n;
}

/* Reaper: put cb in the SQ again (it is still held); 1, or 0 when it does not fit (never:
 * pieces in the SQ are held, and held <= cap <= SQ entries). */
static int uring_requeue_(uring *u, struct iocb *cb)
{
    int ok = 0;
    pthread_mutex_lock(&u->mu);
    if (u->tail - __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE) < u->sq_entries
        && uring_fill_(u, &u->sqes[u->tail & u->sq_mask], cb) == 0) {
        u->tail++;
        __atomic_store_n(u->sq_tail, u->tail, __ATOMIC_RELEASE);
        ok = 1;
    }
    pthread_mutex_unlock(&u->mu);
    return ok;
}

/* Reaper: move up to max events from the CQ to out; how many.
 *
 * Some results are not the piece's own, and the piece goes again (it is still held):
 * -EAGAIN, up to URING_EAGAIN_MAX in a row (*streak) before they are returned as errors;
 * and -EFAULT/-ECANCELED, up to URING_ORPHAN_MAX times per piece. A request belongs to the
 * task (thread) that submitted it, and when that thread exits first the kernel fails what
 * it still had to do in that thread's name: a buffered read waiting for its page retries
 * as task work of the submitter, and fails -EFAULT when the submitter is gone
 * (io_req_task_submit: io_should_terminate_tw); work still queued in the thread's io-wq
 * is cancelled, -ECANCELED. Kernel AIO has no such tie; we cancel nothing. Re-queued here,
 * the piece belongs to the reaper's thread. A real -EFAULT (an unmapped buffer) comes back
 * after the retries. */
static long uring_harvest_(uring *u, struct io_event *out, long max, int *streak)
{
    unsigned head = *u->cq_head;
    unsigned tail = __atomic_load_n(u->cq_tail, __ATOMIC_ACQUIRE);
    long got = 0;
    int requeued = 0, i;
    while (head != tail && got < max) {
        struct io_uring_cqe *cqe = &u->cqes[head & u->cq_mask];
        struct iocb *cb = (struct iocb *)(uintptr_t)cqe->user_data;
        int64_t res = cqe->res;
        int rw = cb->aio_lio_opcode == IOCB_CMD_PREAD || cb->aio_lio_opcode == IOCB_CMD_PWRITE;
        head++;
        if (rw && (cb->aio_flags & URING_IOCB_INLINE))
            res = (int64_t)cb->aio_reserved2;   /* the NOP stood in for it */
        if (rw && res >= 0 && uring_inject.cqe_eagain && uring_take_(&uring_inject.cqe_eagain))
            res = -EAGAIN;
        if (rw && res >= 8192 && uring_inject.cqe_short && uring_take_(&uring_inject.cqe_short))
            res = (res / 2) & ~(int64_t)4095;   /* still aligned: not taken for the end */
        if (res == -EAGAIN && *streak < URING_EAGAIN_MAX && uring_requeue_(u, cb)) {
            (*streak)++;
            requeued = 1;
            continue;
        }
        for (i = 0; i < u->nretry && u->retry[i].cb != cb; i++)
            ;
        if ((res == -EFAULT || res == -ECANCELED)
            && (i == u->nretry || u->retry[i].n < URING_ORPHAN_MAX) && uring_requeue_(u, cb)) {
            if (i == u->nretry && u->nretry < u->cap) {
                u->retry[i].cb = cb;
                u->retry[i].n = 0;
                u->nretry++;
            }
            if (i < u->nretry)
                u->retry[i].n++;
            requeued = 1;
            continue;
        }
        if (i < u->nretry)      /* the piece is done: forget its retries */
            u->retry[i] = u->retry[--u->nretry];
        if (res != -EAGAIN)
            *streak = 0;
        out[got].data = cb->aio_data;
        out[got].obj = (uint64_t)(uintptr_t)cb;
        out[got].res = res;
        out[got].res2 = 0;
        got++;
    }
    __atomic_store_n(u->cq_head, head, __ATOMIC_RELEASE);
    if (requeued) {
        pthread_mutex_lock(&u->mu);
        uring_flush_(u);
        pthread_mutex_unlock(&u->mu);
    }
    return got;
}

/* Wait until min_nr pieces are finished or `timeout` (relative; NULL: none) passes; move up
 * to max_nr of them to `out`; how many, or -1 with errno (EINTR only with none to give). */
URING_API long uring_getevents(uring *u, long min_nr, long max_nr, struct io_event *out,
                               const struct timespec *timeout)
{
    struct timespec until, now;
    struct uring_ts_ ts;
    struct uring_getevents_arg_ arg;
    long got = 0;
    int streak = 0, r, e;
    if (min_nr < 0 || max_nr < 0 || min_nr > max_nr) {
        errno = EINVAL;
        return -1;
    }
    if (timeout) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += timeout->tv_sec;
        until.tv_nsec += timeout->tv_nsec;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    for (;;) {
        unsigned pend;
        int64_t left;
        if (__atomic_load_n(u->sq_flags, __ATOMIC_RELAXED) & IORING_SQ_CQ_OVERFLOW)
            uring_enter_(u->fd, 0, 0, IORING_ENTER_GETEVENTS, NULL, 0);
        got += uring_harvest_(u, out + got, max_nr - got, &streak);
        if (got >= min_nr || got == max_nr)
            break;
        pthread_mutex_lock(&u->mu);
        pend = uring_flush_(u);
        pthread_mutex_unlock(&u->mu);
        left = INT64_MAX;
        if (timeout) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            left = (int64_t)(until.tv_sec - now.tv_sec) * 1000000000LL
                   + (until.tv_nsec - now.tv_nsec);
            if (left <= 0) {
                got += uring_harvest_(u, out + got, max_nr - got, &streak);
                break;
            }
        }
        if (pend && left > 1000000)
            left = 1000000;     /* the kernel refused SQEs for now: try them again in 1 ms */
        memset(&arg, 0, sizeof arg);
        if (left != INT64_MAX) {
            ts.tv_sec = left / 1000000000LL;
            ts.tv_nsec = left % 1000000000LL;
            arg.ts = (uint64_t)(uintptr_t)&ts;
        }
        r = uring_enter_(u->fd, 0, (unsigned)(min_nr - got),
                         IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg, sizeof arg);
        if (r < 0) {
            e = errno;
            if (e == ETIME || e == EAGAIN || e == EBUSY)
                continue;       /* the loop looks at the CQ and the clock again */
            got += uring_harvest_(u, out + got, max_nr - got, &streak);
            if (got == 0) {
                errno = e;
                return -1;
            }
            break;
        }
    }
    __atomic_sub_fetch(&u->held, got, __ATOMIC_ACQ_REL);
    return got;
}

/* 0, or -1 with errno: let reads and writes that lie wholly inside one registered buffer use
 * READ_FIXED/WRITE_FIXED (no page pinning per I/O). The range is pinned now, in pieces of at
 * most 1 GiB (a piece of I/O that straddles two of them goes plain), and is charged to
 * RLIMIT_MEMLOCK without CAP_IPC_LOCK. The memory must stay mapped until
 * uring_unregister_buffer or uring_destroy: the kernel keeps the pages it pinned, so I/O
 * after an munmap/mmap at the same address would hit the old pages. Errors (ENOMEM under
 * RLIMIT_MEMLOCK, EFAULT/EOPNOTSUPP for memory the kernel will not pin, ENOSPC when the
 * table of 64 is full, EBUSY for a second range on a kernel before 5.19) leave that memory
 * on plain READ/WRITE and the ring working. */
URING_API int uring_register_buffer(uring *u, void *addr, size_t len)
{
    struct iovec iov[URING_SLOTS];
    unsigned slot[URING_SLOTS] = {0};
    uint64_t a = (uint64_t)(uintptr_t)addr, used;
    size_t k, nk;
    int r = 0, e = 0;
    if (uring_inject.register_errno) {
        errno = uring_inject.register_errno;
        return -1;
    }
    if (!addr || !len) {
        errno = EINVAL;
        return -1;
    }
    nk = (len + URING_BUF_MAX - 1) / URING_BUF_MAX;
    if (nk > URING_SLOTS) {
        errno = ENOSPC;
        return -1;
    }
    for (k = 0; k < nk; k++) {
        iov[k].iov_base = (char *)addr + k * URING_BUF_MAX;
        iov[k].iov_len = k + 1 < nk ? URING_BUF_MAX : len - k * URING_BUF_MAX;
    }
    pthread_mutex_lock(&u->reg_mu);
    if (u->reg_mode == URING_REG_SPARSE) {
        struct uring_rsrc_update2_ up;
        used = u->slots_used;
        for (k = 0; k < nk; k++) {
            unsigned s = 0;
            while (s < URING_SLOTS && (used >> s) & 1)
                s++;
            if (s == URING_SLOTS) {
                e = ENOSPC;
                break;
            }
            memset(&up, 0, sizeof up);
            up.offset = s;
            up.data = (uint64_t)(uintptr_t)&iov[k];
            up.nr = 1;
            r = uring_register_(u->fd, URING_REGISTER_BUFFERS_UPDATE, &up, sizeof up);
            if (r != 1) {
                e = r < 0 ? errno : EFAULT;
                break;
            }
            used |= 1ULL << s;
            slot[k] = s;
        }
        if (e) {                /* clear the slots filled for this range */
            struct iovec none = {NULL, 0};
            size_t j;
            for (j = 0; j < k; j++) {
                memset(&up, 0, sizeof up);
                up.offset = slot[j];
                up.data = (uint64_t)(uintptr_t)&none;
                up.nr = 1;
                uring_register_(u->fd, URING_REGISTER_BUFFERS_UPDATE, &up, sizeof up);
            }
        } else {
            u->slots_used = used;
        }
    } else if (u->reg_mode == URING_REG_ONCE) {
        r = uring_register_(u->fd, IORING_REGISTER_BUFFERS, iov, (unsigned)nk);
        if (r < 0) {
            e = errno;
        } else {
            u->reg_mode = URING_REG_ONCE_USED;
            for (k = 0; k < nk; k++)
                slot[k] = (unsigned)k;
        }
    } else {
        e = EBUSY;
    }
    if (!e) {
        pthread_mutex_lock(&u->mu);
        for (k = 0; k < nk; k++) {
            u->reg[u->nreg].start = a + k * URING_BUF_MAX;
            u->reg[u->nreg].end = a + k * URING_BUF_MAX + iov[k].iov_len;
            u->reg[u->nreg].slot = slot[k];
            u->nreg++;
        }
        pthread_mutex_unlock(&u->mu);
    }
    pthread_mutex_unlock(&u->reg_mu);
    if (e) {
        errno = e;
        return -1;
    }
    return 0;
}

/* Whether [addr, addr+len) lies inside one registered buffer. */
URING_API int uring_covers(uring *u, uint64_t addr, uint64_t len)
{
    int i, hit = 0;
    pthread_mutex_lock(&u->mu);
    for (i = 0; i < u->nreg && !hit; i++)
        hit = addr >= u->reg[i].start && addr + len <= u->reg[i].end;
    pthread_mutex_unlock(&u->mu);
    return hit;
}

/* READ_FIXED/WRITE_FIXED SQEs filled so far, and buffers (pieces of at most 1 GiB) registered
 * now. */
URING_API void uring_counts(uring *u, long *fixed_pieces, int *registered)
{
    pthread_mutex_lock(&u->mu);
    *fixed_pieces = u->nfixed;
    *registered = u->nreg;
    pthread_mutex_unlock(&u->mu);
}

/* SQEs filled so far that named a registered file, and files registered now (-1: the
 * ring has no table of registered files). */
URING_API void uring_file_counts(uring *u, long *fixed_sqes, int *files)
{
    int i, n = 0;
    pthread_mutex_lock(&u->mu);
    *fixed_sqes = u->nfixed_files;
    for (i = 0; i < u->nfile_hi; i++)
        n += u->file_fd[i] >= 0;
    *files = u->files ? n : -1;
    pthread_mutex_unlock(&u->mu);
}

/* Take fd out of every ring's table of registered files. */
static void uring_file_forget_(int fd)
{
    struct uring_rsrc_update2_ up;
    int none = -1, i;
    uring *u;
    pthread_mutex_lock(&uring_all_mu);
    for (u = uring_all_; u; u = u->all_next) {
        pthread_mutex_lock(&u->mu);
        for (i = 0; i < u->nfile_hi; i++) {
            if (u->file_fd[i] != fd)
                continue;
            memset(&up, 0, sizeof up);
            up.offset = (unsigned)i;
            up.data = (uint64_t)(uintptr_t)&none;
            up.nr = 1;
            /* Cannot fail for a slot that holds a file (the kernel drops its reference once
             * the requests using it are done); if it did, the slot stays out of use. */
            if (uring_register_(u->fd, URING_REGISTER_FILES_UPDATE2, &up, sizeof up) == 1)
                u->file_fd[i] = -1;
            else
                u->file_fd[i] = -2;
        }
        pthread_mutex_unlock(&u->mu);
    }
    pthread_mutex_unlock(&uring_all_mu);
}

/* fd is a file aioswap opened and owns: rings may register it. Any registration left
 * under its number (of a file closed behind our back) is dropped first. */
URING_API void uring_file_open(int fd)
{
    if (fd < 0 || fd >= URING_FIXABLE_FDS)
        return;
    uring_file_forget_(fd);
    __atomic_or_fetch(&uring_fixable_[fd / 64], 1ULL << (fd % 64), __ATOMIC_RELEASE);
}

/* fd is about to be closed (nothing is in flight on it): no ring may name it from now on. */
URING_API void uring_file_close(int fd)
{
    if (fd < 0 || fd >= URING_FIXABLE_FDS)
        return;
    __atomic_and_fetch(&uring_fixable_[fd / 64], ~(1ULL << (fd % 64)), __ATOMIC_RELEASE);
    uring_file_forget_(fd);
}

/* In a forked child: the rings on the list are the parent's (uring_forget lets go of each),
 * and another thread may have held the list's mutex at the fork. */
URING_API void uring_after_fork_child(void)
{
    pthread_mutex_init(&uring_all_mu, NULL);
    uring_all_ = NULL;
}

/* Drop the registrations that lie inside [addr, addr+len); I/O already in flight on them
 * finishes first (the kernel holds the pages until then). 0, or -1 with errno. */
URING_API int uring_unregister_buffer(uring *u, void *addr, size_t len)
{
    uint64_t a = (uint64_t)(uintptr_t)addr, drop = 0;
    int i, j, r = 0;
    pthread_mutex_lock(&u->reg_mu);
    pthread_mutex_lock(&u->mu);
    for (i = j = 0; i < u->nreg; i++) {
        if (u->reg[i].start >= a && u->reg[i].end <= a + len)
            drop |= 1ULL << u->reg[i].slot;
        else
            u->reg[j++] = u->reg[i];
    }
    u->nreg = j;
    pthread_mutex_unlock(&u->mu);
    if (drop && u->reg_mode == URING_REG_SPARSE) {
        struct iovec none = {NULL, 0};
        struct uring_rsrc_update2_ up;
        unsigned s;
        for (s = 0; s < URING_SLOTS; s++) {
            if (!((drop >> s) & 1))
                continue;
            memset(&up, 0, sizeof up);
            up.offset = s;
            up.data = (uint64_t)(uintptr_t)&none;
            up.nr = 1;
            if (uring_register_(u->fd, URING_REGISTER_BUFFERS_UPDATE, &up, sizeof up) < 0)
                r = -1;
            else
                u->slots_used &= ~(1ULL << s);
        }
    } else if (drop && u->nreg == 0) {  /* the one plain table, all of it */
        if (uring_register_(u->fd, IORING_UNREGISTER_BUFFERS, NULL, 0) < 0)
            r = -1;
        else
            u->reg_mode = URING_REG_ONCE;
    }
    pthread_mutex_unlock(&u->reg_mu);
    return r;
}

/* Run what is held to the end (closing an io_uring fd does not wait for its I/O, and
 * callers free the buffers next), then unmap, close, and free. Idempotent on NULL. */
URING_API void uring_destroy(uring *u)
{
    struct io_event ev[64];
    int fails = 0;
    if (!u)
        return;
    pthread_mutex_lock(&uring_all_mu);
    if (u->all_prev)
        u->all_prev->all_next = u->all_next;
    else if (uring_all_ == u)
        uring_all_ = u->all_next;
    if (u->all_next)
        u->all_next->all_prev = u->all_prev;
    pthread_mutex_unlock(&uring_all_mu);
    pthread_mutex_lock(&u->mu);
    uring_flush_(u);
    pthread_mutex_unlock(&u->mu);
    while (__atomic_load_n(&u->held, __ATOMIC_ACQUIRE) > 0) {
        if (uring_getevents(u, 1, 64, ev, NULL) < 0 && errno != EINTR) {
            struct timespec ms = {0, 1000000};
            if (++fails > 1000)
                break;          /* the ring itself is broken: nothing more can be done */
            nanosleep(&ms, NULL);
        }
    }
    if (u->nreg || u->slots_used)       /* unpin now, not in the kernel's deferred teardown */
        uring_register_(u->fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
    if (u->files)                       /* let go of the files now, likewise */
        uring_register_(u->fd, IORING_UNREGISTER_FILES, NULL, 0);
    uring_unmap_(u);
    close(u->fd);
    pthread_mutex_destroy(&u->mu);
    pthread_mutex_destroy(&u->reg_mu);
    free(u->retry);
    free(u);
}

/* In a forked child that inherited the ring: unmap, close, free; enter nothing, write
 * nothing of the rings, and leave the mutexes alone (another thread may have held one at
 * the fork). The parent's I/O goes on untouched. Idempotent on NULL. */
URING_API void uring_forget(uring *u)
{
    if (!u)
        return;
    uring_unmap_(u);
    close(u->fd);
    free(u->retry);
    free(u);
}

#endif /* AIOSWAP_NO_URING */

#endif
