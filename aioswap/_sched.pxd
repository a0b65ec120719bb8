# cython: language_level=3
# Declarations of <sched.h>; no logic here.

cdef extern from "<sched.h>" nogil:
    int sched_yield()
