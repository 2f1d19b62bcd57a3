/* The CPU's float32 fused multiply-add peak, for machine_limits.py: each thread runs ACC
 * independent chains of 16-float multiply-adds (one AVX-512 register or two AVX2 ones, as
 * -march=native allows), enough in flight to cover the FMA latency on every port, and nothing else
 * (no memory traffic). Returns the sum of the lanes so the loops are not optimized away. */
typedef float v16 __attribute__((vector_size(64)));

enum { ACC = 12 };

double fma_peak(long iters, int threads) {
    double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        v16 acc[ACC];
        const v16 mul = (v16){} + 0.9999f, add = (v16){} + 1e-4f;
        for (int i = 0; i < ACC; i++) acc[i] = (v16){} + (float)i;
        for (long it = 0; it < iters; it++)
#pragma GCC unroll 12 /* ACC: the chains stay in registers */
            for (int i = 0; i < ACC; i++) acc[i] = acc[i] * mul + add;
        for (int i = 0; i < ACC; i++)
            for (int j = 0; j < 16; j++) total += acc[i][j];
    }
    return total;
}
