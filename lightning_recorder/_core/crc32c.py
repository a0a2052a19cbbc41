"""CRC-32C in C, for the checksums of TensorBoard's event records.

Every record of a TensorBoard event file carries two masked CRC-32C checksums (of its length and
of its bytes). ``torch.utils.tensorboard`` writes through TensorBoard's own record writer, whose
checksum is computed in pure Python: about 0.24 ms per KiB on the writer thread, holding the GIL,
so a step that logs a large event slows the training thread that shares the GIL with it.
:func:`masked_crc32c` computes the same number in C (the SSE4.2 ``crc32`` instruction where the
kernels are built for AVX2 or AVX-512, an eight-table loop otherwise), with the GIL released; it
is built like the other kernels (:mod:`lightning_recorder._core.native`) and is
``None``-returning where they cannot be built, callers then keeping TensorBoard's.
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import native

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(__SSE4_2__) && defined(__x86_64__)
uint32_t lr_crc32c(const unsigned char *p, int64_t n) {
    uint64_t c = 0xFFFFFFFFu;
    while (n > 0 && ((uintptr_t)p & 7)) { c = __builtin_ia32_crc32qi((uint32_t)c, *p++); n--; }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
    }
    for (; n > 0; n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return (uint32_t)c ^ 0xFFFFFFFFu;
}
#else
/* table[k][b]: the CRC of byte b followed by k zero bytes (reflected polynomial 0x82F63B78) */
static uint32_t table[8][256];

__attribute__((constructor)) static void fill(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++)
            table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xFF];
}

uint32_t lr_crc32c(const unsigned char *p, int64_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                           (uint32_t)p[3] << 24);
        c = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^
            table[4][lo >> 24] ^ table[3][p[4]] ^ table[2][p[5]] ^ table[1][p[6]] ^
            table[0][p[7]];
    }
    for (; n > 0; n--) c = table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}
#endif

/* TensorFlow's masked form: rotated right by 15 bits, plus a constant */
uint32_t lr_masked_crc32c(const unsigned char *p, int64_t n) {
    uint32_t c = lr_crc32c(p, n);
    return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}
"""

_SIGNATURES = {
    "lr_crc32c": (ctypes.c_uint32, (ctypes.c_char_p, ctypes.c_int64)),
    "lr_masked_crc32c": (ctypes.c_uint32, (ctypes.c_char_p, ctypes.c_int64)),
}

LIBRARY = "lightning_recorder_crc32c"


def _library() -> Any:
    return native.load(LIBRARY, SOURCE, _SIGNATURES)


def available() -> bool:
    """Whether the C checksum runs here (built, or loaded from the cache)."""
    return _library() is not None


def crc32c(data: bytes) -> int:
    """The CRC-32C (Castagnoli) of ``data`` (call only where :func:`available`)."""
    return int(_library().lr_crc32c(data, len(data)))


def masked_crc32c(data: bytes) -> int:
    """TensorFlow's masked CRC-32C of ``data``, as in the framing of a TFRecord (call only where
    :func:`available`)."""
    return int(_library().lr_masked_crc32c(data, len(data)))
