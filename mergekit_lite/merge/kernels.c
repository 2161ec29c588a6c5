/* Merge math fused into one loop per pass, on the CPU: SLERP's angle (bfloat16, float16, float32 inputs) and its
 * weighted sum, the task-vector family's chunk (task arithmetic, TIES, DARE, in any mix of trim, drop and sign
 * consensus) and TIES's threshold count, for bfloat16 checkpoints.
 *
 * In eager torch each pass is several: the angle converts both inputs to float32 before its products; the weighted
 * sum converts, scales, adds and rounds; a TIES chunk takes some fifteen passes per model (benchmarks/RESULTS.md,
 * "Merge math in one pass"). Here each entry is loaded once and the arithmetic is the one the torch code in
 * `mergekit_lite/merge/methods/tensor_math.py` spells out, operation for operation, so both give the same bytes and the
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
 * j + h for h = ANGLE_LANES/2 .. 1 (tensor_math.py's `angle_sums` does the same with whole rows at a time). The
 * lanes' sums stay in the L1 cache. */
#define ANGLE_ROWS 64
#define ANGLE_LANES 1024

static inline float from_bf16(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* Round to nearest even, as torch rounds float32 to bfloat16; every NaN becomes 0xffff, the NaN torch writes. */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0xffffu : (uint16_t)rounded;
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
 * entries of a short last block add nothing). Products of bfloat16, float16 or float32 values are exact in
 * float64, so fused or not they add the same. */
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

/* The task-vector family's chunk (methods.task_vector_merge): per model, delta = model - base in float32, trimmed
 * (hardshrink at its lambda), dropped (+0 + (keep_scale*delta)*keep) and weighted; then their sum, or with a
 * consensus the sum of the deltas agreeing with the elected sign (from +0), divided by the agreeing weights
 * (TIES's disjoint mean) or else by the weights' total; scaled, plus the base, rounded once to bfloat16. Entries go
 * in blocks of TV_BLOCK whose float32 values stay in the L1 cache, each block read whole before its output is
 * written (the output may be the base itself). */
#define TV_BLOCK 256
#define BAND_GROUP 16
#define MAX_MODELS 32
enum { PLAIN_SUM = 0, AGREE_POSITIVE = 1, AGREE_SIGNED = 2 };

typedef struct {
    int count, consensus, zero_sum_positive, normalize, divide_by_total, scale_after;
    const uint16_t *models[MAX_MODELS];
    const float *keeps[MAX_MODELS]; /* DARE's keep indicators (0 or 1), NULL where a model drops nothing */
    int trims[MAX_MODELS];
    float weights[MAX_MODELS], lambdas[MAX_MODELS], keep_scales[MAX_MODELS];
    float total, scale, eps;
} TaskVectors;

static inline float sign_of(float x) { return (float)((0.0f < x) - (x < 0.0f)); } /* torch.sign's, NaN to 0 */

PER_TARGET
static void task_vectors(uint16_t *out, const uint16_t *base, int64_t n, const TaskVectors *r) {
    float bases[TV_BLOCK], deltas[MAX_MODELS][TV_BLOCK], elected[TV_BLOCK], merged[TV_BLOCK], divisors[TV_BLOCK];
    for (int64_t first = 0; first < n; first += TV_BLOCK) {
        int width = n - first < TV_BLOCK ? (int)(n - first) : TV_BLOCK;
        for (int k = 0; k < width; k++)
            bases[k] = from_bf16(base[first + k]);
        for (int i = 0; i < r->count; i++) {
            const uint16_t *model = r->models[i] + first;
            float *delta = deltas[i], lambda = r->lambdas[i], keep_scale = r->keep_scales[i], weight = r->weights[i];
            for (int k = 0; k < width; k++)
                delta[k] = from_bf16(model[k]) - bases[k];
            if (r->trims[i])
                for (int k = 0; k < width; k++)
                    delta[k] = (delta[k] >= -lambda && delta[k] <= lambda) ? 0.0f : delta[k];
            if (r->keeps[i]) {
                const float *keep = r->keeps[i] + first;
                for (int k = 0; k < width; k++)
                    delta[k] = 0.0f + (keep_scale * delta[k]) * keep[k];
            }
            for (int k = 0; k < width; k++)
                delta[k] *= weight;
        }
        if (r->consensus == PLAIN_SUM) {
            for (int k = 0; k < width; k++)
                merged[k] = deltas[0][k];
            for (int i = 1; i < r->count; i++)
                for (int k = 0; k < width; k++)
                    merged[k] += deltas[i][k];
            if (r->divide_by_total)
                for (int k = 0; k < width; k++)
                    merged[k] /= r->total;
        } else {
            for (int k = 0; k < width; k++)
                elected[k] = deltas[0][k];
            for (int i = 1; i < r->count; i++)
                for (int k = 0; k < width; k++)
                    elected[k] += deltas[i][k];
            for (int k = 0; k < width; k++) {
                float total = elected[k];
                if (r->zero_sum_positive)
                    elected[k] = r->consensus == AGREE_POSITIVE ? copysignf(1.0f, total)
                                                                : (total >= 0.0f ? 1.0f : -1.0f);
                else
                    elected[k] = sign_of(total);
                merged[k] = 0.0f;
            }
            for (int i = 0; i < r->count; i++) {
                float weight = r->weights[i];
                for (int k = 0; k < width; k++) {
                    float d = deltas[i][k];
                    float agree = r->consensus == AGREE_POSITIVE ? (d * elected[k] > 0.0f ? 1.0f : 0.0f)
                                                                  : (sign_of(d) == elected[k] ? 1.0f : 0.0f);
                    merged[k] += d * agree;
                    divisors[k] = i == 0 ? agree * weight : divisors[k] + weight * agree;
                }
            }
            if (r->normalize)
                for (int k = 0; k < width; k++) {
                    float divisor = divisors[k];
                    if (r->consensus == AGREE_POSITIVE)
                        divisor = divisor < r->eps ? r->eps : divisor;
                    else
                        divisor = fabsf(divisor) < r->eps ? 1.0f : divisor;
                    merged[k] /= divisor;
                }
        }
        for (int k = 0; k < width; k++)
            out[first + k] = to_bf16((r->scale_after ? merged[k] * r->scale : merged[k]) + bases[k]);
    }
}

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

/* The band's entries of one block, in order: with AVX-512's compressing store where the CPU has it (HAS_COMPRESS,
 * checked at import; the caller chooses), else a group of BAND_GROUP at a time, most of which hold none. */
static int has_compress = 0;
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx512f"))) static int gather_band_compressed(const float *magnitudes, int width, float low,
                                                                     float high, float *band) {
    int inside = 0, k = 0;
    __m512 lows = _mm512_set1_ps(low), highs = _mm512_set1_ps(high);
    for (; k + 16 <= width; k += 16) {
        __m512 values = _mm512_loadu_ps(magnitudes + k);
        __mmask16 keep = _mm512_cmp_ps_mask(values, lows, _CMP_GE_OQ) & _mm512_cmp_ps_mask(values, highs, _CMP_LE_OQ);
        _mm512_mask_compressstoreu_ps(band + inside, keep, values);
        inside += __builtin_popcount(keep);
    }
    for (; k < width; k++)
        if (magnitudes[k] >= low && magnitudes[k] <= high)
            band[inside++] = magnitudes[k];
    return inside;
}
#define CHECK_COMPRESS() (has_compress = __builtin_cpu_supports("avx512f") != 0)
#else
static int gather_band_compressed(const float *magnitudes, int width, float low, float high, float *band) {
    return 0; /* never called: has_compress stays 0 */
}
#define CHECK_COMPRESS() (has_compress = 0)
#endif

static int gather_band(const float *magnitudes, int width, float low, float high, float *band, int compress) {
    if (compress && has_compress)
        return gather_band_compressed(magnitudes, width, low, high, band);
    int inside = 0;
    for (int group = 0; group < width; group += BAND_GROUP) {
        int end = group + BAND_GROUP < width ? group + BAND_GROUP : width, any = 0;
        for (int k = group; k < end; k++)
            any |= (magnitudes[k] >= low) & (magnitudes[k] <= high);
        if (any)
            for (int k = group; k < end; k++) { /* written always, kept by moving on: no branch */
                band[inside] = magnitudes[k];
                inside += (magnitudes[k] >= low) & (magnitudes[k] <= high);
            }
    }
    return inside;
}

/* TIES's threshold count (methods.TrimThreshold.count): of the magnitudes |model - base| in float32, how many lie
 * above the bracket [low, high], and those inside it, in order, into `band` (room for n entries). */
PER_TARGET
static int64_t magnitude_band(const uint16_t *base, const uint16_t *model, int64_t n, float low, float high,
                              float *band, int compress, int64_t *above) {
    int64_t inside = 0, reaching = 0;
    for (int64_t first = 0; first < n; first += TV_BLOCK) {
        int width = n - first < TV_BLOCK ? (int)(n - first) : TV_BLOCK, reach = 0;
        float magnitudes[TV_BLOCK];
        for (int k = 0; k < width; k++) {
            magnitudes[k] = fabsf(from_bf16(model[first + k]) - from_bf16(base[first + k]));
            reach += magnitudes[k] >= low;
        }
        reaching += reach;
        inside += gather_band(magnitudes, width, low, high, band + inside, compress);
    }
    *above = reaching - inside;
    return inside;
}

static PyObject *py_magnitude_band(PyObject *self, PyObject *args) {
    unsigned long long base, model, band;
    long long n;
    double low, high;
    int64_t inside, above;
    int compress;
    if (!PyArg_ParseTuple(args, "KKLddKp", &base, &model, &n, &low, &high, &band, &compress))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    inside = magnitude_band((const uint16_t *)(uintptr_t)base, (const uint16_t *)(uintptr_t)model, n, (float)low,
                            (float)high, (float *)(uintptr_t)band, compress, &above);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(LL)", (long long)above, (long long)inside);
}

/* A sequence of `count` numbers (addresses as integers, or floats) into `into`; -1 with an exception set. */
static int numbers(PyObject *sequence, int count, unsigned long long *addresses, float *floats) {
    PyObject *fast = PySequence_Fast(sequence, "expected a sequence");
    if (!fast)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "one entry per model expected");
        return -1;
    }
    for (int i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (addresses)
            addresses[i] = PyLong_AsUnsignedLongLong(item);
        else
            floats[i] = (float)PyFloat_AsDouble(item);
    }
    Py_DECREF(fast);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *py_task_vectors(PyObject *self, PyObject *args) {
    unsigned long long out, base, models[MAX_MODELS], keeps[MAX_MODELS];
    long long n;
    double total, scale, eps;
    PyObject *model_list, *keep_list, *weight_list, *lambda_list, *keep_scale_list;
    TaskVectors r;
    memset(&r, 0, sizeof r);
    if (!PyArg_ParseTuple(args, "KKOLOOOOiiiiiddd", &out, &base, &model_list, &n, &weight_list, &lambda_list,
                          &keep_list, &keep_scale_list, &r.consensus, &r.zero_sum_positive, &r.normalize,
                          &r.divide_by_total, &r.scale_after, &total, &scale, &eps))
        return NULL;
    Py_ssize_t count = PySequence_Size(model_list);
    if (count < 0)
        return NULL;
    r.count = count > MAX_MODELS ? MAX_MODELS + 1 : (int)count; /* the models' sequence says how many */
    if (r.count < 1 || r.count > MAX_MODELS || r.consensus < PLAIN_SUM || r.consensus > AGREE_SIGNED) {
        PyErr_SetString(PyExc_ValueError, "1 to MAX_MODELS models, consensus 0, 1 or 2");
        return NULL;
    }
    if (numbers(model_list, r.count, models, NULL) || numbers(keep_list, r.count, keeps, NULL) ||
        numbers(weight_list, r.count, NULL, r.weights) || numbers(lambda_list, r.count, NULL, r.lambdas) ||
        numbers(keep_scale_list, r.count, NULL, r.keep_scales))
        return NULL;
    for (int i = 0; i < r.count; i++) {
        r.models[i] = (const uint16_t *)(uintptr_t)models[i];
        r.keeps[i] = (const float *)(uintptr_t)keeps[i];
        r.trims[i] = r.lambdas[i] >= 0.0f; /* a negative lambda: no trim */
    }
    r.total = (float)total;
    r.scale = (float)scale;
    r.eps = (float)eps;
    Py_BEGIN_ALLOW_THREADS
    task_vectors((uint16_t *)(uintptr_t)out, (const uint16_t *)(uintptr_t)base, n, &r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"weighted_pair", py_weighted_pair, METH_VARARGS,
     "weighted_pair(out, start, end, n, w0, w1): n bfloat16 entries out = start*w0 + end*w1 (data addresses)"},
    {"angle_sums", py_angle_sums, METH_VARARGS,
     "angle_sums(start, end, n, dtype, block, totals) -> totals plus each block's sums of start*start, "
     "start*end, end*end, in order (dtype 'b' bfloat16, 'h' float16, 'f' float32)"},
    {"task_vectors", py_task_vectors, METH_VARARGS,
     "task_vectors(out, base, models, n, weights, lambdas, keeps, keep_scales, consensus, zero_sum_positive, "
     "normalize, divide_by_total, scale_after, total, scale, eps): methods.task_vector_merge's chunk of n "
     "bfloat16 entries into `out` (data addresses; a negative lambda trims nothing, a keep address 0 drops "
     "nothing)"},
    {"magnitude_band", py_magnitude_band, METH_VARARGS,
     "magnitude_band(base, model, n, low, high, band, compress) -> (above, inside): of n bfloat16 entries' "
     "|model - base|, the count above [low, high] and the `inside` ones within it, written in order to the float32 "
     "`band` (with AVX-512's compressing store if `compress` and HAS_COMPRESS)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    CHECK_COMPRESS();
    PyObject *created = PyModule_Create(&module);
    if (created && (PyModule_AddStringConstant(created, "ANGLE_DTYPES", HAS_FLOAT16 ? "bhf" : "bf") < 0 ||
                    PyModule_AddIntConstant(created, "MAX_MODELS", MAX_MODELS) < 0 ||
                    PyModule_AddIntConstant(created, "HAS_COMPRESS", has_compress) < 0)) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
