/* The attributes a request checks (type, device, inode, size, links), without the times.
 *
 * Why not fstat/stat: they ask for every basic attribute, timestamps included, and on file
 * systems with multigrain timestamps (ext4, xfs, btrfs, tmpfs since Linux 6.13) a query of
 * ctime/mtime marks the inode, so that the next write must stamp it with a fresh
 * fine-grained time. Each write then dirties the inode (a journal update on ext4) instead of
 * once per clock tick. A request that stats its file before each write (an fd or path
 * argument) or a read beside writes on the same file paid that on every write: measured on
 * ext4, one ext4_mark_inode_dirty per 4 KiB write (40,091 for 40,000 writes through an fd and
 * a path; 651-1,009 without the query).
 *
 * statx(2) with a mask without STATX_CTIME/STATX_MTIME does not mark the inode. Where statx
 * is missing (ENOSYS: Linux < 4.11; ENOSYS or EPERM: a seccomp filter) this falls back to
 * fstatat(2), as before. The struct is the kernel's ABI, declared here so that old kernel
 * headers (manylinux) build it too.
 */
#ifndef AIOSWAP_STATLITE_H
#define AIOSWAP_STATLITE_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

typedef struct stat_lite {
    unsigned mode;          /* st_mode */
    uint64_t dev;           /* st_dev, as stat(2) encodes it */
    uint64_t ino;
    int64_t size;
    uint64_t nlink;
} stat_lite;

struct statx_ts_ {
    int64_t tv_sec;
    uint32_t tv_nsec;
    int32_t reserved;
};

struct statx_ {             /* struct statx of <linux/stat.h> (Linux 4.11), 256 bytes */
    uint32_t mask;
    uint32_t blksize;
    uint64_t attributes;
    uint32_t nlink;
    uint32_t uid;
    uint32_t gid;
    uint16_t mode;
    uint16_t spare0;
    uint64_t ino;
    uint64_t size;
    uint64_t blocks;
    uint64_t attributes_mask;
    struct statx_ts_ atime, btime, ctime, mtime;
    uint32_t rdev_major, rdev_minor;
    uint32_t dev_major, dev_minor;
    uint64_t spare2[14];
};

#define STATLITE_MASK_ (0x1U /* TYPE */ | 0x2U /* MODE */ | 0x4U /* NLINK */ \
                        | 0x100U /* INO */ | 0x200U /* SIZE */)

/* 1: statx is refused here (ENOSYS), fstatat from then on. A race between threads that
 * both find out is harmless. */
static int statlite_nostatx_ = 0;

/* 0, or -1 with errno (as fstatat). `flags`: AT_EMPTY_PATH with path "" for an fd; 0 to
 * follow a path, as stat(2) does. Safe without the GIL. */
static __attribute__((unused)) int stat_lite_at(int dirfd, const char *path, int flags,
                                                stat_lite *out)
{
    struct stat st;
#ifdef SYS_statx
    struct statx_ sx;
    if (!statlite_nostatx_) {
        if (syscall(SYS_statx, dirfd, path, flags, STATLITE_MASK_, &sx) == 0) {
            out->mode = sx.mode;
            out->dev = (uint64_t)makedev(sx.dev_major, sx.dev_minor);
            out->ino = sx.ino;
            out->size = (int64_t)sx.size;
            out->nlink = sx.nlink;
            return 0;
        }
        if (errno != ENOSYS && errno != EPERM)    /* EPERM: a seccomp filter's answer */
            return -1;
        statlite_nostatx_ = 1;
    }
#endif
    if (fstatat(dirfd, path, &st, flags) != 0)
        return -1;
    out->mode = st.st_mode;
    out->dev = (uint64_t)st.st_dev;
    out->ino = (uint64_t)st.st_ino;
    out->size = (int64_t)st.st_size;
    out->nlink = (uint64_t)st.st_nlink;
    return 0;
}

/* stat_lite_at of an open fd (fstat without the times). */
static inline __attribute__((unused)) int stat_lite_fd(int fd, stat_lite *out)
{
    return stat_lite_at(fd, "", AT_EMPTY_PATH, out);
}

#endif
