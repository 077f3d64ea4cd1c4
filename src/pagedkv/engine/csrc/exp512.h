/* exp512: exp(x) for 16 float lanes, x <= 0, shared by the kernels that exponentiate
 * attention scores (paged_decode.c, prompt_attention.c). AVX-512F builds only. */
#ifndef PAGEDKV_EXP512_H
#define PAGEDKV_EXP512_H

#include <immintrin.h>

/* exp(x) for x <= 0 (a score minus its running max), 16 lanes: Cephes' expf polynomial on
 * x - n ln2 (n = round(x / ln2), ln2 split in two), scaled by 2^n with vscalefps. Checked
 * against the correctly rounded exp at 20M points of [-103, 0]: within 1 ulp wherever the
 * result is a normal float; exp(0) = 1 exactly; 0 below -103 (where expf underflows too). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
