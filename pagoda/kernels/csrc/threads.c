/* Pinning the compute threads. Torch's intra-op pool and these kernels share one OpenMP runtime
 * (torch's libgomp: the kernels' dependency resolves to the copy already loaded), and libgomp
 * reuses a master thread's pool in order, so pinning thread i of a team of n pins the thread that
 * runs share i of every later parallel region of that size started from the same thread. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

/* Pins thread i of the calling thread's team of n to cpus[i]; returns how many pins failed. */
int pagoda_bind_threads(const int *cpus, int n) {
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failed += sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed;
}
