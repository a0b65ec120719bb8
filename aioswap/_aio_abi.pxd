# cython: language_level=3
# Declarations of <linux/aio_abi.h>, the AIO syscall numbers and statx(2); no logic here.
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t


cdef extern from "<linux/aio_abi.h>" nogil:
    ctypedef unsigned long aio_context_t

    enum:
        IOCB_CMD_PREAD
        IOCB_CMD_PWRITE
        IOCB_CMD_FSYNC
        IOCB_CMD_FDSYNC
        # IOCB_CMD_POLL, IOCB_CMD_NOOP, IOCB_CMD_PREADV, IOCB_CMD_PWRITEV left out

    struct io_event:
        uint64_t data
        uint64_t obj
        int64_t res
        int64_t res2

    struct iocb:
        uint64_t aio_data
        uint32_t aio_key
        int aio_rw_flags
        uint16_t aio_lio_opcode
        int aio_reqprio
        uint32_t aio_fildes
        uint64_t aio_buf
        uint64_t aio_nbytes
        int64_t aio_offset
        uint64_t aio_reserved2
        uint32_t aio_flags
        uint32_t aio_resfd


cdef extern from "<sys/syscall.h>" nogil:
    long SYS_io_setup
    long SYS_io_destroy
    long SYS_io_submit
    long SYS_io_cancel
    long SYS_io_getevents
    long SYS_statx
    long SYS_process_vm_writev
    long SYS_process_vm_readv


cdef extern from "<unistd.h>" nogil:
    long syscall(long number, ...)


cdef extern from "<fcntl.h>" nogil:
    int AT_FDCWD
    int AT_EMPTY_PATH


# struct statx of <linux/stat.h>, declared here rather than taken from the header: kernel
# headers older than 6.1 lack stx_dio_*, and <sys/stat.h> may or may not pull the kernel's
# definition in. The layout is kernel ABI (256 bytes); only the fields we read are named.
cdef struct statx_timestamp:
    int64_t tv_sec
    uint32_t tv_nsec
    int32_t __reserved

cdef struct statx_buf:
    uint32_t stx_mask
    uint32_t stx_blksize
    uint64_t stx_attributes
    uint32_t stx_nlink
    uint32_t stx_uid
    uint32_t stx_gid
    uint16_t stx_mode
    uint16_t __spare0
    uint64_t stx_ino
    uint64_t stx_size
    uint64_t stx_blocks
    uint64_t stx_attributes_mask
    statx_timestamp stx_atime
    statx_timestamp stx_btime
    statx_timestamp stx_ctime
    statx_timestamp stx_mtime
    uint32_t stx_rdev_major
    uint32_t stx_rdev_minor
    uint32_t stx_dev_major
    uint32_t stx_dev_minor
    uint64_t stx_mnt_id
    uint32_t stx_dio_mem_align
    uint32_t stx_dio_offset_align
    uint64_t __spare3[12]

# <linux/stat.h> request masks
cdef enum:
    STATX_SIZE = 0x00000200
    STATX_DIOALIGN = 0x00002000
