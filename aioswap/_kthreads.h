/* Positional I/O on worker threads, in the shape of io_submit/io_getevents.
 *
 * The portable backend of aioswap's queue (aioswap/_aio.pyx), used where the kernel refuses
 * io_setup (aio-max-nr exhausted, a seccomp profile): the queue hands it the same iocbs it
 * hands the kernel, and reaps io_events from it the same way. Worker threads run
 * pread/pwrite/fsync/fdatasync and post {aio_data, iocb, result or -errno}. Calls return
 * -1 with errno set on failure, like the system calls they stand in for.
 */
#ifndef AIOSWAP_KTHREADS_H
#define AIOSWAP_KTHREADS_H

#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct kthreads {
    pthread_mutex_t mu;
    pthread_cond_t work;        /* a piece is pending, or stop */
    pthread_cond_t done;        /* an event is posted (CLOCK_MONOTONIC) */
    struct iocb **pend;         /* ring of pending pieces */
    int phead, npend;
    struct io_event *ev;        /* ring of finished pieces */
    int ehead, nev;
    int cap;                    /* most pieces held at once (pending + running + posted) */
    int held;
    int stop;
    int nth;
    pthread_t *th;
} kthreads;

static void *kthreads_worker(void *arg)
{
    kthreads *k = (kthreads *)arg;
    sigset_t all;
    sigfillset(&all);           /* signals go to the interpreter's threads, never here */
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    for (;;) {
        struct iocb *cb;
        int64_t res;
        pthread_mutex_lock(&k->mu);
        while (k->npend == 0 && !k->stop)
            pthread_cond_wait(&k->work, &k->mu);
        if (k->npend == 0) {    /* stop, and nothing left to run */
            pthread_mutex_unlock(&k->mu);
            return NULL;
        }
        cb = k->pend[k->phead];
        k->phead = (k->phead + 1) % k->cap;
        k->npend--;
        pthread_mutex_unlock(&k->mu);
        do {
            ssize_t r;
            switch (cb->aio_lio_opcode) {
            case IOCB_CMD_PREAD:
                r = pread((int)cb->aio_fildes, (void *)(uintptr_t)cb->aio_buf,
                          (size_t)cb->aio_nbytes, (off_t)cb->aio_offset);
                break;
            case IOCB_CMD_PWRITE:
                r = pwrite((int)cb->aio_fildes, (const void *)(uintptr_t)cb->aio_buf,
                           (size_t)cb->aio_nbytes, (off_t)cb->aio_offset);
                break;
            case IOCB_CMD_FSYNC:
                r = fsync((int)cb->aio_fildes);
                break;
            case IOCB_CMD_FDSYNC:
                r = fdatasync((int)cb->aio_fildes);
                break;
            default:
                r = -1;
                errno = EINVAL;
            }
            res = r < 0 ? -(int64_t)errno : (int64_t)r;
        } while (res == -EINTR);
        pthread_mutex_lock(&k->mu);
        {
            struct io_event *e = &k->ev[(k->ehead + k->nev) % k->cap];
            e->data = cb->aio_data;
            e->obj = (uint64_t)(uintptr_t)cb;
            e->res = res;
            e->res2 = 0;
            k->nev++;
        }
        pthread_cond_broadcast(&k->done);
        pthread_mutex_unlock(&k->mu);
    }
}

static void kthreads_destroy(kthreads *k);

/* 0, or -1 with errno: a backend for `cap` pieces in flight on `nthreads` threads. */
static int kthreads_setup(kthreads **out, int cap, int nthreads)
{
    kthreads *k;
    pthread_condattr_t attr;
    int i, e;
    *out = NULL;
    k = (kthreads *)calloc(1, sizeof(kthreads));
    if (!k) {
        errno = ENOMEM;
        return -1;
    }
    k->cap = cap;
    k->pend = (struct iocb **)calloc((size_t)cap, sizeof(struct iocb *));
    k->ev = (struct io_event *)calloc((size_t)cap, sizeof(struct io_event));
    k->th = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    if (!k->pend || !k->ev || !k->th) {
        free(k->pend);
        free(k->ev);
        free(k->th);
        free(k);
        errno = ENOMEM;
        return -1;
    }
    pthread_mutex_init(&k->mu, NULL);
    pthread_cond_init(&k->work, NULL);
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&k->done, &attr);
    pthread_condattr_destroy(&attr);
    for (i = 0; i < nthreads; i++) {
        e = pthread_create(&k->th[i], NULL, kthreads_worker, k);
        if (e) {
            kthreads_destroy(k);    /* joins the ones started */
            errno = e;
            return -1;
        }
        k->nth++;
    }
    *out = k;
    return 0;
}

/* Queue n pieces; how many were taken (-1/EAGAIN when none fit). */
static long kthreads_submit(kthreads *k, long n, struct iocb **cbs)
{
    long i;
    pthread_mutex_lock(&k->mu);
    if (k->held + n > k->cap)
        n = k->cap - k->held;
    if (n <= 0) {
        pthread_mutex_unlock(&k->mu);
        errno = EAGAIN;
        return -1;
    }
    for (i = 0; i < n; i++)
        k->pend[(k->phead + k->npend + i) % k->cap] = cbs[i];
    k->npend += (int)n;
    k->held += (int)n;
    pthread_cond_broadcast(&k->work);
    pthread_mutex_unlock(&k->mu);
    return n;
}

/* Wait until min_nr pieces are finished or `timeout` (relative; NULL: none) passes; move up
 * to max_nr of them to `out`; how many. */
static long kthreads_getevents(kthreads *k, long min_nr, long max_nr, struct io_event *out,
                               const struct timespec *timeout)
{
    struct timespec until;
    long n, i;
    if (timeout) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += timeout->tv_sec;
        until.tv_nsec += timeout->tv_nsec;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&k->mu);
    while (k->nev < min_nr) {
        if (!timeout)
            pthread_cond_wait(&k->done, &k->mu);
        else if (pthread_cond_timedwait(&k->done, &k->mu, &until) == ETIMEDOUT)
            break;
    }
    n = k->nev < max_nr ? k->nev : max_nr;
    for (i = 0; i < n; i++)
        out[i] = k->ev[(k->ehead + i) % k->cap];
    k->ehead = (k->ehead + (int)n) % k->cap;
    k->nev -= (int)n;
    k->held -= (int)n;
    pthread_mutex_unlock(&k->mu);
    return n;
}

/* Run what is pending to the end, then stop and join the threads, and free. */
static void kthreads_destroy(kthreads *k)
{
    int i;
    if (!k)
        return;
    pthread_mutex_lock(&k->mu);
    k->stop = 1;
    pthread_cond_broadcast(&k->work);
    pthread_mutex_unlock(&k->mu);
    for (i = 0; i < k->nth; i++)
        pthread_join(k->th[i], NULL);
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->work);
    pthread_cond_destroy(&k->done);
    free(k->pend);
    free(k->ev);
    free(k->th);
    free(k);
}

#endif
