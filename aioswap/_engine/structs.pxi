# The queue's C records: piece kinds and states, the file's shared state, the
# request (_Req), the slot, the queue (_Q).
# Part of aioswap/_aio.pyx (included there, one module).

# ========================================================================================
# The shared queue: many requests, one kernel context
#
# An AioQueue owns one kernel AIO context and ``depth`` iocb slots. Requests from any
# thread are linked into one pending list; whoever holds the queue's mutex cuts the next
# pieces of pending requests into free slots, and the pieces go to the kernel in one
# io_submit. One thread at a time holds the reaping role: a sync caller waiting for its own
# request, or the handle's completion thread (serve()) while asynchronous work is in flight.
# Reaping accounts each completion to its request; a request finishes when its last piece is
# reaped. No Python runs per piece.
#
# Pieces come in kinds:
#   K_DIRECT     the caller's memory (or any memory on a buffered fd) straight to the kernel
#   K_BREAD      read into a ring buffer, copied out when it lands (bounce and edge reads)
#   K_BWRITE     copied into a ring buffer, then written
#   K_RMW_READ   an edge block of a write (bytes of the block outside the request): read the
#                block, patch the request's bytes in, then write it whole (K_RMW_WRITE);
#                serialised per (file, block) across the process, so O_DIRECT writes to one
#                file never go through the page cache and neighbours never lose bytes
#   K_FSYNC      IOCB_CMD_FSYNC after a write's last piece (fsync=True)



cdef enum:
    K_DIRECT = 0
    K_BREAD = 1
    K_BWRITE = 2
    K_RMW_READ = 3
    K_RMW_WRITE = 4
    K_FSYNC = 5

cdef enum:
    ST_HEAD = 0
    ST_MIDDLE = 1
    ST_TAIL = 2
    ST_FSYNC = 3
    ST_DONE = 4

cdef enum:
    M_DIRECT = 0        # pieces on the caller's memory, O_DIRECT alignment applies
    M_BOUNCE = 1        # every piece through the ring
    M_PLAIN = 2         # a buffered fd: no alignment, no ring

MODE_DIRECT = M_DIRECT
MODE_BOUNCE = M_BOUNCE
MODE_PLAIN = M_PLAIN

# Most pieces one call cuts and submits; bounds stack arrays of submitters.
DEF _BATCH = 64
# Longest a waiter sleeps before it looks at Python signal handlers again.
cdef long _TICK_NS = 10000000
# While a piece waits for an edge block another queue holds, poll this often.
cdef long _EDGE_POLL_NS = 200000


cdef extern from "<sys/vfs.h>" nogil:
    ctypedef struct _statfs_t "struct statfs":
        long f_type
    int _fstatfs "fstatfs"(int fd, _statfs_t* buf)

cdef long _TMPFS_MAGIC = 0x01021994


cdef struct _FileCore:
    int64_t logical_end         # largest end of the writes in flight on the file
    int active_writes
    int64_t known_size          # the file is at least this long (see _grow; 0: not known)
    bint no_grow                # fallocate is refused here: writes extend the file themselves
    bint inline                 # on tmpfs: io_uring runs its pieces in the submitting thread


cdef struct _Req:
    int fd
    uint16_t opcode
    int mode
    uint64_t addr
    uint64_t nbytes
    int64_t offset
    uint64_t align
    uint64_t block              # piece size on the caller's memory
    uint64_t bblock             # piece size through the ring
    _FileCore* file
    bint fsync
    bint sync
    uint64_t head_end
    uint64_t tail_start
    int stage
    uint64_t pos
    int inflight
    uint64_t done
    int err
    int64_t err_offset
    uint64_t err_nbytes
    bint eof
    bint stop                   # cut nothing new: failed or cancelled
    bint finished
    bint queued
    bint counted_write
    PyObject* obj               # its Request, referenced while the queue may touch it
    _Req* prev
    _Req* next
    _Req* done_next


cdef struct _Slot:
    abi.iocb cb
    _Req* req
    int kind
    int buf
    int lock
    bint fresh
    bint pads                   # an edge block past the end of the file is written whole
    uint64_t rgot               # bytes of the edge block that existed (its read)
    int64_t parked              # a reaped result waiting for its copy-out
    int err
    bint eof
    uint64_t uaddr
    uint64_t ulen
    uint64_t skip
    uint64_t span
    uint64_t got
    int64_t foff


cdef struct _Q:
    abi.aio_context_t ctx
    int depth                   # most pieces in the kernel at once
    int nslots                  # slots: 2 x depth, so that reaped pieces waiting for their
                                # copy-out do not keep new pieces from the drive
    int kin                     # pieces in the kernel (cut, not yet reaped)
    _Slot* slots
    int* free_slots
    int nfree
    int inflight                # slots taken (cut and not yet accounted)
    char* ring
    uint64_t bufsize
    int nbuf
    int* free_bufs
    int nfreebuf
    _Req* pend_head
    _Req* pend_tail
    _Req* done_head
    _Req* done_tail
    int ndone
    int nasync                  # asynchronous requests not finished: the completion thread
                                # reaps only for them, sync callers reap for themselves
    double done_since           # when the oldest undelivered request finished
    int* retry                  # cut, not yet accepted by io_submit (EAGAIN)
    int nretry
    int* rscratch               # the reaper's: slots to launch
    abi.io_event* events
    bint reaping
    bint closing
    bint edge_blocked
    bint single_submit
    bint overlap
    int broken                  # errno of a failed io_getevents: nothing more can be reaped
    kt.kthreads* threads        # the worker-thread backend (NULL: not in use)
    ur.uring* uring             # the io_uring backend (NULL: not in use)
    int waiters
    int eager                   # threads blocked in the handle's wait(): deliver at once
    int helpers                 # threads in _help: they reap and deliver, the completion
                                # thread stands by
    double last_async           # when the last asynchronous request was queued
    bint helped                 # its callers wait for their bursts and reap them (help()):
                                # a new asynchronous request does not wake the completion
                                # thread, which looks every _HELPED_TICK_S instead
    pt.pthread_mutex_t mu
    pt.pthread_cond_t cv        # waiters for pieces, the reaping role or finished requests
    pt.pthread_cond_t scv       # the completion thread's own (see _wake)
    bint swaiting               # the completion thread waits on scv
    bint napping                # ... until a burst its caller is queueing is over
    bint ticking                # ... for at most _HELPED_TICK_S
