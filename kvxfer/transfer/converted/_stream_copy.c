/* Copies whose stores bypass the cache (streaming stores), for kvxfer's copies on one host.
 *
 * glibc's memcpy switches to streaming stores only above a threshold of hundreds of MB on
 * this project's machines, so a mapped read's pieces (16 KiB - 2 MiB) are copied with
 * ordinary stores, which first read every destination line into the cache: measured at
 * 0.5-0.6x of one large memcpy on one thread. Streaming stores write the lines without
 * reading them, as the large memcpy does. See kvxfer/transfer/converted/stream_copy.py.
 *
 * A plain function called through ctypes (which releases the GIL); the module init only
 * lets the shared object be found by Python's import machinery. */
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>

static void copy_one(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}

static void fence(void) { _mm_sfence(); }
#define KVXFER_STREAMING 1
#else
static void copy_one(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
static void fence(void) {}
#define KVXFER_STREAMING 0
#endif

/* 1 where the stores stream (x86-64), 0 where this is memcpy. */
int kvxfer_streaming(void) { return KVXFER_STREAMING; }

/* rows x row_bytes: row r from src + r * src_stride to dst + r * dst_stride. The
 * streamed stores are fenced before returning, so that whoever learns of the copy's end
 * sees its bytes. */
void kvxfer_copy_rows(char *dst, ptrdiff_t dst_stride, const char *src, ptrdiff_t src_stride,
                      size_t rows, size_t row_bytes)
{
    for (size_t r = 0; r < rows; r++)
        copy_one(dst + (ptrdiff_t)r * dst_stride, src + (ptrdiff_t)r * src_stride, row_bytes);
    fence();
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream_copy",
                                    "kvxfer's streaming copy, called through ctypes", -1,
                                    NULL};

PyMODINIT_FUNC PyInit__stream_copy(void) { return PyModule_Create(&module); }
