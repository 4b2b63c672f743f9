//! Vector building blocks of the fast forward: a fast `exp`, the attention of one query head
//! over the KV cache, and the SiLU gate. Each has an AVX-512 kernel and a portable kernel that
//! perform **the same IEEE operations in the same order** (fused multiply-adds included:
//! `f32::mul_add` in the portable code, `vfmadd` in the vector code), so they give the same
//! bits; the choice is made per [`FastTarget`](super::FastTarget) (the portable code runs with
//! [`KernelPath::Scalar`](super::KernelPath::Scalar) and on CPUs without AVX-512). Neither
//! the arithmetic nor its order depends on how many rows a forward holds.
//!
//! # `exp`
//!
//! [`exp`]: `x` is clamped to `[-87, 88]`, split as `x = n ln2 + r` (`n = round(x log2 e)`,
//! ties to even; `r` by two fused multiply-adds with a two-part `ln 2`, `|r| <= 0.347`),
//! `e^r` from its Taylor polynomial of degree 7 by Horner's rule (fused multiply-adds;
//! truncation error below `6e-9` relative) and scaled by `2^n` built from the exponent bits.
//! Inputs below `-87` give `0` (and `-inf` gives `0`); inputs above `88` give `e^88`.
//! Measured relative error against `f64::exp` on `[-87, 88]` (240,000 points): at most
//! `7.5e-8`, about one ulp (the unit test bounds it by `1.5e-7`).
//!
//! # Attention of one query head
//!
//! [`KvCache`] stores keys transposed per KV head (`[kv_heads][d][cap]`, positions contiguous,
//! `cap` a multiple of 16) and values position-major (`[cap][kv_heads][d]`). For a query `q`
//! (`d` values, already scaled) attending to positions `0 .. len`:
//!
//! 1. score `s_j = (a_0 + a_1) + (a_2 + a_3)` where `a_c` runs over the dimensions `c, c + 4, ...`
//!    in increasing order, `a_c = fma(q[i], k[i, j], a_c)` from `0`;
//! 2. `m = max_j s_j` (exact in any order), `e_j = exp(s_j - m)`;
//! 3. `sum`: 16 partial sums over `j mod 16` (in increasing `j`, from `0`), combined by a
//!    pairwise tree (`(l0 + l1)`, `(l2 + l3)`, ... then pairs of those, ...);
//! 4. `o[i] = ((b_0 + b_1) + (b_2 + b_3)) · (1 / sum)` where `b_c` runs over the positions
//!    `j ≡ c (mod 4)` in increasing order, `b_c = fma(e_j, v[j, i], b_c)` from `0`.
//!
//! The vector kernel scores 16 positions per instruction (one lane each) and needs `d` to be
//! a multiple of 16; other head widths use the portable kernel.

/// Lanes per vector (positions scored at once, padding of the cache).
pub(crate) const LANES: usize = 16;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = LN2_HI + LN2_LO`, `LN2_HI` with 8 trailing zero bits.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
/// Taylor coefficients `1 / k!`, `k = 7 .. 0`.
const EXP_C: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Fast `e^x` (module docs); the portable reference of the vector kernel.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    if x < EXP_LO || x.is_nan() {
        return if x.is_nan() { x } else { 0.0 };
    }
    let xc = x.min(EXP_HI);
    let nf = (xc * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;
    let r = nf.mul_add(-LN2_HI, xc);
    let r = nf.mul_add(-LN2_LO, r);
    let mut p = EXP_C[0];
    for &c in &EXP_C[1..] {
        p = p.mul_add(r, c);
    }
    let scale = f32::from_bits(((nf as i32 + 127) as u32) << 23);
    p * scale
}

/// Whether the AVX-512 kernels of this module can run.
pub(crate) fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The KV cache of one layer (module docs).
#[derive(Debug, Clone, Default)]
pub(crate) struct KvCache {
    nkv: usize,
    d: usize,
    /// Capacity in positions (a multiple of [`LANES`]).
    cap: usize,
    /// `[nkv][d][cap]`.
    kt: Vec<f32>,
    /// `[cap][nkv][d]`.
    v: Vec<f32>,
}

impl KvCache {
    pub(crate) fn new(nkv: usize, d: usize) -> Self {
        KvCache {
            nkv,
            d,
            ..KvCache::default()
        }
    }

    /// Makes room for `len` positions (keeps the first `keep`).
    pub(crate) fn reserve(&mut self, len: usize, keep: usize) {
        self.reserve_within(len, keep, usize::MAX);
    }

    /// Makes room for `len` positions (keeps the first `keep`), growing the capacity
    /// geometrically but never past `limit` positions rounded up to [`LANES`] (nor 64) unless
    /// `len` needs more.
    pub(crate) fn reserve_within(&mut self, len: usize, keep: usize, limit: usize) {
        if len <= self.cap {
            return;
        }
        let need = len.next_multiple_of(LANES);
        let cap = need
            .max(2 * self.cap)
            .max(64)
            .min(limit.saturating_add(LANES - 1) / LANES * LANES)
            .max(need);
        let rows = self.nkv * self.d;
        let mut kt = vec![0f32; rows * cap];
        for r in 0..rows {
            kt[r * cap..r * cap + keep].copy_from_slice(&self.kt[r * self.cap..][..keep]);
        }
        self.kt = kt;
        self.v.reserve_exact(cap * rows - self.v.len());
        self.v.resize(cap * rows, 0.0);
        self.cap = cap;
    }

    /// Stores the key and value vectors (`[nkv][d]` each) of position `pos < cap`.
    pub(crate) fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let rows = self.nkv * self.d;
        for (r, &kv) in k[..rows].iter().enumerate() {
            self.kt[r * self.cap + pos] = kv;
        }
        self.v[pos * rows..(pos + 1) * rows].copy_from_slice(&v[..rows]);
    }

    /// Makes this cache hold positions `0 .. len` of `src` (the same shape; `len` within what
    /// `src` holds): its keys and values copied, so the attention over them reads the same
    /// bits.
    pub(crate) fn copy_prefix_from(&mut self, src: &KvCache, len: usize) {
        self.reserve(len, 0);
        let rows = self.nkv * self.d;
        for r in 0..rows {
            self.kt[r * self.cap..r * self.cap + len]
                .copy_from_slice(&src.kt[r * src.cap..r * src.cap + len]);
        }
        self.v[..len * rows].copy_from_slice(&src.v[..len * rows]);
    }

    /// Bytes held by the keys and values (the capacity, not only the positions in use).
    pub(crate) fn memory_bytes(&self) -> usize {
        (self.kt.capacity() + self.v.capacity()) * std::mem::size_of::<f32>()
    }

    /// Appends the key and value vectors (`[nkv][d]` each) of position `pos < cap` to `k` and
    /// `v` (the inverse of [`KvCache::write`]).
    pub(crate) fn read(&self, pos: usize, k: &mut Vec<f32>, v: &mut Vec<f32>) {
        let rows = self.nkv * self.d;
        k.extend((0..rows).map(|r| self.kt[r * self.cap + pos]));
        v.extend_from_slice(&self.v[pos * rows..(pos + 1) * rows]);
    }
}

/// Attention of the query heads in `q` (`[heads][d]`, heads sharing KV head `kvh`) over
/// positions `0 .. len`, into `out` (`[heads][d]`); `scores` is scratch. `simd` selects the
/// AVX-512 kernel (callers check [`simd_available`]); the bits are the same either way.
pub(crate) fn attend(
    c: &KvCache,
    kvh: usize,
    q: &[f32],
    len: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    simd: bool,
) {
    let d = c.d;
    let heads = q.len() / d;
    assert!(len <= c.cap && q.len() == heads * d && out.len() == q.len() && len > 0 && kvh < c.nkv);
    scores.clear();
    scores.resize(heads * len.next_multiple_of(LANES), 0.0);
    #[cfg(target_arch = "x86_64")]
    if simd && d.is_multiple_of(LANES) {
        // SAFETY: the caller checked AVX-512 F.
        unsafe { x86::attend(c, kvh, q, len, scores, out) };
        return;
    }
    let _ = simd;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: FMA was detected at run time.
        unsafe { attend_portable_fma(c, kvh, q, len, scores, out) };
        return;
    }
    attend_portable_heads(c, kvh, q, len, scores, out);
}

/// The portable kernel with hardware fused multiply-adds (`f32::mul_add` otherwise calls the C
/// library's `fmaf`); the same bits. Callers must check that the CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn attend_portable_fma(
    c: &KvCache,
    kvh: usize,
    q: &[f32],
    len: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attend_portable_heads(c, kvh, q, len, scores, out);
}

#[inline(always)]
fn attend_portable_heads(
    c: &KvCache,
    kvh: usize,
    q: &[f32],
    len: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    for (qh, oh) in q.chunks_exact(c.d).zip(out.chunks_exact_mut(c.d)) {
        attend_portable(c, kvh, qh, len, scores, oh);
    }
}

/// Pairwise tree sum of 16 lanes (module docs, step 3).
#[inline(always)]
fn tree16(l: &[f32; LANES]) -> f32 {
    let mut a = *l;
    let mut w = LANES;
    while w > 1 {
        for i in 0..w / 2 {
            a[i] = a[2 * i] + a[2 * i + 1];
        }
        w /= 2;
    }
    a[0]
}

#[inline(always)]
fn attend_portable(
    c: &KvCache,
    kvh: usize,
    q: &[f32],
    len: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, cap) = (c.d, c.cap);
    let kt = &c.kt[kvh * d * cap..(kvh + 1) * d * cap];
    let mut max = f32::NEG_INFINITY;
    for (j, s) in scores[..len].iter_mut().enumerate() {
        let mut a = [0f32; 4];
        for i0 in (0..d).step_by(4) {
            for (ci, ac) in a.iter_mut().enumerate() {
                let i = i0 + ci;
                if i < d {
                    *ac = q[i].mul_add(kt[i * cap + j], *ac);
                }
            }
        }
        *s = (a[0] + a[1]) + (a[2] + a[3]);
        max = max.max(*s);
    }
    let mut lanes = [0f32; LANES];
    for (j, s) in scores[..len].iter_mut().enumerate() {
        *s = exp(*s - max);
        lanes[j % LANES] += *s;
    }
    let inv = 1.0 / tree16(&lanes);
    let rows = c.nkv * d;
    for (i, o) in out.iter_mut().enumerate() {
        let mut b = [0f32; 4];
        for (j, &e) in scores[..len].iter().enumerate() {
            b[j % 4] = e.mul_add(c.v[j * rows + kvh * d + i], b[j % 4]);
        }
        *o = ((b[0] + b[1]) + (b[2] + b[3])) * inv;
    }
}

/// `out[i] = silu(g[i]) · u[i]` with `silu(g) = g / (1 + exp(-g))` ([`exp`] of this module).
pub(crate) fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32], simd: bool) {
    let len = g.len().min(u.len()).min(out.len());
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the caller checked AVX-512 F; the kernel stays within `len`.
        unsafe { x86::silu_mul(&g[..len], &u[..len], &mut out[..len]) };
        return;
    }
    let _ = simd;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: FMA was detected at run time.
        unsafe { silu_mul_fma(&g[..len], &u[..len], &mut out[..len]) };
        return;
    }
    silu_mul_portable(&g[..len], &u[..len], &mut out[..len]);
}

/// [`silu_mul_portable`] with hardware fused multiply-adds (same bits). Callers must check
/// that the CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn silu_mul_fma(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_portable(g, u, out);
}

#[inline(always)]
fn silu_mul_portable(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &gv), &uv) in out.iter_mut().zip(g).zip(u) {
        *o = (gv / (1.0 + exp(-gv))) * uv;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// 16-lane [`exp`](super::exp): the same operations lane by lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn exp16(x: __m512) -> __m512 {
        let under = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(EXP_LO));
        let xc = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(EXP_LO)),
            _mm512_set1_ps(EXP_HI),
        );
        let magic = _mm512_set1_ps(ROUND_MAGIC);
        let nf = _mm512_sub_ps(
            _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), magic),
            magic,
        );
        let r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-LN2_HI), xc);
        let r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_C[0]);
        for &c in &EXP_C[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(nf),
            _mm512_set1_epi32(127),
        ));
        let y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
        // Lanes below EXP_LO (and NaN lanes, kept as they are) per the portable code.
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let y = _mm512_maskz_mov_ps(under, y);
        _mm512_mask_mov_ps(y, nan, x)
    }

    /// Attention of the `heads` query heads in `q` (`[heads][d]`) over KV head `kvh`, into
    /// `out` (`[heads][d]`); `scores` holds `heads` rows of `len` rounded up to 16. Heads are
    /// processed in batches of up to 4 that share each key and value load; every head's
    /// arithmetic is that of the portable kernel.
    #[target_feature(enable = "avx512f")]
    pub(super) fn attend(
        c: &KvCache,
        kvh: usize,
        q: &[f32],
        len: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let d = c.d;
        let heads = q.len() / d;
        let lp = len.next_multiple_of(LANES);
        assert!(
            kvh < c.nkv
                && d.is_multiple_of(LANES)
                && len <= c.cap
                && len > 0
                && out.len() == heads * d
                && scores.len() >= heads * lp
        );
        let mut h0 = 0;
        while h0 < heads {
            let hn = (heads - h0).min(4);
            let (qh, sh) = (&q[h0 * d..], &mut scores[h0 * lp..]);
            let oh = &mut out[h0 * d..];
            // SAFETY: the assertion above bounds every access made by the batch kernels:
            // `qh`/`oh` hold at least `hn d` values, `sh` at least `hn lp`, and the cache
            // reads stay within KV head `kvh`'s `d` rows of `cap >= lp` keys and `len` values.
            unsafe {
                match hn {
                    1 => batch::<1>(c, kvh, qh, len, sh, oh),
                    2 => batch::<2>(c, kvh, qh, len, sh, oh),
                    3 => batch::<3>(c, kvh, qh, len, sh, oh),
                    _ => batch::<4>(c, kvh, qh, len, sh, oh),
                }
            }
            h0 += hn;
        }
    }

    /// `H` heads of [`attend`]. Callers guarantee the bounds listed there.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn batch<const H: usize>(
        c: &KvCache,
        kvh: usize,
        q: &[f32],
        len: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        unsafe {
            let vmax = batch_scores::<H>(c, kvh, q, len, scores);
            let inv = batch_exp::<H>(&vmax, len, scores);
            batch_values::<H>(c, kvh, len, scores, &inv, out);
        }
    }

    /// Step 1 of [`batch`]: the scores of `H` heads (`q`, `[H, d]`) against positions
    /// `0 .. len` into `scores` (`[H, lp]`, `lp = len` rounded up to 16; padding `-inf`), 16
    /// positions per vector, 4 chains over the dimensions. Returns each head's lane maxima.
    // Register arrays indexed by head and chain together read clearer as index loops.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn batch_scores<const H: usize>(
        c: &KvCache,
        kvh: usize,
        q: &[f32],
        len: usize,
        scores: &mut [f32],
    ) -> [__m512; H] {
        unsafe {
            let (d, cap) = (c.d, c.cap);
            let lp = len.next_multiple_of(LANES);
            let kt = c.kt.as_ptr().add(kvh * d * cap);
            let qp = q.as_ptr();
            let sp = scores.as_mut_ptr();
            let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
            let mut vmax = [ninf; H];
            for j0 in (0..len).step_by(LANES) {
                let mut a = [[_mm512_setzero_ps(); 4]; H];
                for i0 in (0..d).step_by(4) {
                    for ci in 0..4 {
                        let i = i0 + ci;
                        let kv = _mm512_loadu_ps(kt.add(i * cap + j0));
                        for h in 0..H {
                            let qv = _mm512_set1_ps(*qp.add(h * d + i));
                            a[h][ci] = _mm512_fmadd_ps(qv, kv, a[h][ci]);
                        }
                    }
                }
                let valid = len - j0;
                let m: __mmask16 = if valid >= LANES {
                    0xffff
                } else {
                    (1u16 << valid) - 1
                };
                for h in 0..H {
                    let s = _mm512_add_ps(
                        _mm512_add_ps(a[h][0], a[h][1]),
                        _mm512_add_ps(a[h][2], a[h][3]),
                    );
                    let s = _mm512_mask_mov_ps(ninf, m, s);
                    vmax[h] = _mm512_max_ps(vmax[h], s);
                    _mm512_storeu_ps(sp.add(h * lp + j0), s);
                }
            }
            vmax
        }
    }

    /// Steps 2-3 of [`batch`]: `exp(score - max)` in place for each head's `len` scores and
    /// the reciprocal of their sum ([`tree16`] over the lanes), broadcast.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn batch_exp<const H: usize>(
        vmax: &[__m512; H],
        len: usize,
        scores: &mut [f32],
    ) -> [__m512; H] {
        unsafe {
            let lp = len.next_multiple_of(LANES);
            let sp = scores.as_mut_ptr();
            let mut inv = [_mm512_setzero_ps(); H];
            for (h, inv) in inv.iter_mut().enumerate() {
                let max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[h]));
                let mut vsum = _mm512_setzero_ps();
                for j0 in (0..len).step_by(LANES) {
                    let p = sp.add(h * lp + j0);
                    let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p), max));
                    vsum = _mm512_add_ps(vsum, e);
                    _mm512_storeu_ps(p, e);
                }
                let mut lanes = [0f32; LANES];
                _mm512_storeu_ps(lanes.as_mut_ptr(), vsum);
                *inv = _mm512_set1_ps(1.0 / tree16(&lanes));
            }
            inv
        }
    }

    /// Step 4 of [`batch`]: each head's output (`out`, `[H, d]`) as the values of positions
    /// `0 .. len` weighted by the exponentials in `scores`, times `inv`; 4 chains over the
    /// positions.
    // Register arrays indexed by head and chain together read clearer as index loops.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn batch_values<const H: usize>(
        c: &KvCache,
        kvh: usize,
        len: usize,
        scores: &[f32],
        inv: &[__m512; H],
        out: &mut [f32],
    ) {
        unsafe {
            let d = c.d;
            let lp = len.next_multiple_of(LANES);
            let sp = scores.as_ptr();
            let rows = c.nkv * d;
            let vp = c.v.as_ptr().add(kvh * d);
            for i0 in (0..d).step_by(LANES) {
                let mut b = [[_mm512_setzero_ps(); 4]; H];
                let mut j = 0;
                while j + 4 <= len {
                    for ci in 0..4 {
                        let vv = _mm512_loadu_ps(vp.add((j + ci) * rows + i0));
                        for h in 0..H {
                            let e = _mm512_set1_ps(*sp.add(h * lp + j + ci));
                            b[h][ci] = _mm512_fmadd_ps(e, vv, b[h][ci]);
                        }
                    }
                    j += 4;
                }
                for ci in 0..len - j {
                    let vv = _mm512_loadu_ps(vp.add((j + ci) * rows + i0));
                    for h in 0..H {
                        let e = _mm512_set1_ps(*sp.add(h * lp + j + ci));
                        b[h][ci] = _mm512_fmadd_ps(e, vv, b[h][ci]);
                    }
                }
                for h in 0..H {
                    let o = _mm512_mul_ps(
                        _mm512_add_ps(
                            _mm512_add_ps(b[h][0], b[h][1]),
                            _mm512_add_ps(b[h][2], b[h][3]),
                        ),
                        inv[h],
                    );
                    _mm512_storeu_ps(out.as_mut_ptr().add(h * d + i0), o);
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let len = out.len();
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < len {
            let m: __mmask16 = if len - i >= LANES {
                0xffff
            } else {
                (1u16 << (len - i)) - 1
            };
            // SAFETY: masked loads and stores touch only lanes `< len - i`, inside the slices.
            unsafe {
                let gv = _mm512_maskz_loadu_ps(m, g[i..].as_ptr());
                let uv = _mm512_maskz_loadu_ps(m, u[i..].as_ptr());
                let neg = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(gv),
                    _mm512_set1_epi32(i32::MIN),
                ));
                let e = exp16(neg);
                let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
                _mm512_mask_storeu_ps(out[i..].as_mut_ptr(), m, _mm512_mul_ps(s, uv));
            }
            i += LANES;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_731;
        }
        assert!(worst < 1.5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-87.5), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn simd_kernels_match_portable_bits() {
        if !simd_available() {
            return;
        }
        let mut s = 3;
        // exp on a sweep including the clamps and special values.
        let mut xs: Vec<f32> = (0..4000).map(|_| lcg(&mut s) * 100.0).collect();
        xs.extend([
            0.0,
            -0.0,
            -87.0,
            88.0,
            -87.0001,
            f32::NEG_INFINITY,
            f32::INFINITY,
        ]);
        let (g, u): (Vec<f32>, Vec<f32>) = xs.iter().map(|&x| (x, x * 0.5 - 1.0)).unzip();
        let (mut a, mut b) = (vec![0f32; g.len()], vec![0f32; g.len()]);
        silu_mul(&g, &u, &mut a, false);
        silu_mul(&g, &u, &mut b, true);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        for (nkv, d) in [(3, 64), (2, 16), (1, 32)] {
            let mut c = KvCache::new(nkv, d);
            for len in [1, 2, 15, 16, 17, 40, 100] {
                c.reserve(len, 0);
                for pos in 0..len {
                    let k: Vec<f32> = (0..nkv * d).map(|_| lcg(&mut s)).collect();
                    let v: Vec<f32> = (0..nkv * d).map(|_| lcg(&mut s)).collect();
                    c.write(pos, &k, &v);
                }
                for kvh in 0..nkv {
                    let heads = 1 + (len + kvh) % 6;
                    let q: Vec<f32> = (0..heads * d).map(|_| lcg(&mut s) * 3.0).collect();
                    let (mut o1, mut o2) = (vec![0f32; heads * d], vec![0f32; heads * d]);
                    let mut sc = Vec::new();
                    attend(&c, kvh, &q, len, &mut sc, &mut o1, false);
                    attend(&c, kvh, &q, len, &mut sc, &mut o2, true);
                    assert!(o1 == o2, "nkv {nkv} d {d} len {len} heads {heads}");
                    // Against an f64 softmax.
                    let rows = nkv * d;
                    for (qh, oh) in q.chunks_exact(d).zip(o1.chunks_exact(d)) {
                        let sc64: Vec<f64> = (0..len)
                            .map(|j| {
                                (0..d)
                                    .map(|i| {
                                        f64::from(qh[i])
                                            * f64::from(c.kt[(kvh * d + i) * c.cap + j])
                                    })
                                    .sum()
                            })
                            .collect();
                        let m = sc64.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = sc64.iter().map(|x| (x - m).exp()).collect();
                        let tot: f64 = e.iter().sum();
                        for i in 0..d {
                            let want: f64 = (0..len)
                                .map(|j| e[j] * f64::from(c.v[j * rows + kvh * d + i]))
                                .sum::<f64>()
                                / tot;
                            assert!(
                                (f64::from(oh[i]) - want).abs() < 1e-5,
                                "{} vs {want}",
                                oh[i]
                            );
                        }
                    }
                }
            }
        }
    }
}
