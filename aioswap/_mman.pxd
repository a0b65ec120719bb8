# cython: language_level=3
# Declarations of <sys/mman.h> that Cython's posix.mman lacks; no logic here.

cdef extern from "<sys/mman.h>" nogil:
    int madvise(void* addr, size_t length, int advice)
    int mincore(void* addr, size_t length, unsigned char* vec)

# Linux 5.14; the value is the kernel's (older headers lack the name)
cdef enum:
    MADV_POPULATE_READ = 22
    MADV_POPULATE_WRITE = 23
