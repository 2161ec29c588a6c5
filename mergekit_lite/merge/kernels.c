/* SLERP's two passes over bfloat16 tensors on the CPU, each fused into one loop.
 *
 * In eager torch each pass is several: the angle converts both inputs to float32 before its products, the
 * combination converts both, scales, adds and rounds, each a pass of its own over a chunk (benchmarks/RESULTS.md,
 * "SLERP in one pass"). Here each element is loaded once and the arithmetic is the one the torch code in
 * `mergekit_lite/merge/methods.py` spells out, operation for operation, so both give the same bytes and the
 * package works, only slower, where this module could not be built (it is an optional extension).
 *
 * No fast-math: built with -ffp-contract=off so no multiply is fused into an addition that torch rounds apart.
 * The loops vectorize per target (x86-64-v4, v3 and a baseline clone chosen at load) without reordering any
 * addition, so the bytes are the same on every machine.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define PER_TARGET __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef PER_TARGET
#define PER_TARGET
#endif

/* The angle's order of additions. A block of ANGLE_ROWS * ANGLE_LANES entries is read as rows of ANGLE_LANES:
 * each lane's sum adds its entries row after row from zero, then the lanes are added pairwise, lane j and lane
 * j + h for h = ANGLE_LANES/2 .. 1 (methods.py's `angle_sums` does the same with whole rows at a time). The
 * lanes' sums stay in the L1 cache. */
#define ANGLE_ROWS 64
#define ANGLE_LANES 1024

static inline float from_bf16(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* Round to nearest even, as torch rounds float32 to bfloat16; NaN becomes the canonical quiet NaN. */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

/* out = start * w0 + end * w1: the product on start rounded to float32, then one fused multiply-add (torch's
 * `mul_` then `add_(alpha=)`), rounded once to bfloat16. */
PER_TARGET
static void weighted_pair(uint16_t *out, const uint16_t *start, const uint16_t *end, int64_t n, float w0, float w1) {
    /* `out` may be `start` or `end` itself (each entry is read before it is written), never a partial overlap */
#pragma GCC ivdep
    for (int64_t i = 0; i < n; i++) {
        float scaled = from_bf16(start[i]) * w0;
        out[i] = to_bf16(fmaf(from_bf16(end[i]), w1, scaled));
    }
}

/* One block's sums of start*start, start*end and end*end (n <= ANGLE_ROWS * ANGLE_LANES entries; the missing
 * entries of a short last block add nothing). Products of bfloat16 or float32 values are exact in float64, so
 * fused or not they add the same. */
#define BLOCK_SUMS(name, type, load)                                                      \
    PER_TARGET                                                                            \
    static void name(const type *start, const type *end, int64_t n, double sums[3]) {    \
        double ss[ANGLE_LANES] = {0}, se[ANGLE_LANES] = {0}, ee[ANGLE_LANES] = {0};       \
        for (int64_t row = 0; row * ANGLE_LANES < n; row++) {                             \
            const type *a = start + row * ANGLE_LANES, *b = end + row * ANGLE_LANES;      \
            int64_t width = n - row * ANGLE_LANES < ANGLE_LANES ? n - row * ANGLE_LANES : ANGLE_LANES; \
            for (int64_t lane = 0; lane < width; lane++) {                                \
                double x = load(a[lane]), y = load(b[lane]);                              \
                ss[lane] += x * x;                                                        \
                se[lane] += x * y;                                                        \
                ee[lane] += y * y;                                                        \
            }                                                                             \
        }                                                                                 \
        for (int half = ANGLE_LANES / 2; half > 0; half /= 2) {                           \
            for (int lane = 0; lane < half; lane++) {                                     \
                ss[lane] += ss[lane + half];                                              \
                se[lane] += se[lane + half];                                              \
                ee[lane] += ee[lane + half];                                              \
            }                                                                             \
        }                                                                                 \
        sums[0] = ss[0];                                                                  \
        sums[1] = se[0];                                                                  \
        sums[2] = ee[0];                                                                  \
    }

static inline float from_f32(float value) { return value; }
BLOCK_SUMS(block_sums_bf16, uint16_t, from_bf16)
BLOCK_SUMS(block_sums_f32, float, from_f32)
#ifdef __FLT16_MAX__ /* a compiler with _Float16 (GCC 12, Clang 15): float16 too, else float16 runs in torch */
static inline float from_f16(_Float16 value) { return (float)value; }
BLOCK_SUMS(block_sums_f16, _Float16, from_f16)
#define HAS_FLOAT16 1
#else
#define HAS_FLOAT16 0
#endif

static PyObject *py_weighted_pair(PyObject *self, PyObject *args) {
    unsigned long long out, start, end;
    long long n;
    double w0, w1;
    if (!PyArg_ParseTuple(args, "KKKLdd", &out, &start, &end, &n, &w0, &w1))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    weighted_pair((uint16_t *)(uintptr_t)out, (const uint16_t *)(uintptr_t)start, (const uint16_t *)(uintptr_t)end,
                  n, (float)w0, (float)w1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_angle_sums(PyObject *self, PyObject *args) {
    unsigned long long start, end;
    long long n, block;
    int dtype;
    double totals[3];
    if (!PyArg_ParseTuple(args, "KKLCL(ddd)", &start, &end, &n, &dtype, &block, &totals[0], &totals[1],
                          &totals[2]))
        return NULL;
    if (block != ANGLE_ROWS * ANGLE_LANES || !(dtype == 'b' || dtype == 'f' || (dtype == 'h' && HAS_FLOAT16))) {
        PyErr_SetString(PyExc_ValueError, "block must be ANGLE_ROWS * ANGLE_LANES, dtype one of ANGLE_DTYPES");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t first = 0; first < n; first += block) {
        int64_t size = n - first < block ? n - first : block;
        double sums[3];
        if (dtype == 'b')
            block_sums_bf16((const uint16_t *)(uintptr_t)start + first, (const uint16_t *)(uintptr_t)end + first,
                            size, sums);
#if HAS_FLOAT16
        else if (dtype == 'h')
            block_sums_f16((const _Float16 *)(uintptr_t)start + first, (const _Float16 *)(uintptr_t)end + first,
                           size, sums);
#endif
        else
            block_sums_f32((const float *)(uintptr_t)start + first, (const float *)(uintptr_t)end + first, size,
                           sums);
        for (int k = 0; k < 3; k++)
            totals[k] += sums[k];
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ddd)", totals[0], totals[1], totals[2]);
}

static PyMethodDef methods[] = {
    {"weighted_pair", py_weighted_pair, METH_VARARGS,
     "weighted_pair(out, start, end, n, w0, w1): n bfloat16 entries out = start*w0 + end*w1 (data addresses)"},
    {"angle_sums", py_angle_sums, METH_VARARGS,
     "angle_sums(start, end, n, dtype, block, totals) -> totals plus each block's sums of start*start, "
     "start*end, end*end, in order (dtype 'b' bfloat16, 'h' float16, 'f' float32)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *created = PyModule_Create(&module);
    if (created && PyModule_AddStringConstant(created, "ANGLE_DTYPES", HAS_FLOAT16 ? "bhf" : "bf") < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
