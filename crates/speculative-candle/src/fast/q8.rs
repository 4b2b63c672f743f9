//! Our 8-bit block weight format and the multi-row, batch-invariant int8 matmul.
//!
//! # Format
//!
//! A [`Q8Matrix`] holds a `[rows, cols]` matrix (row-major in meaning: row `j` is output
//! feature `j`) as blocks of [`BLOCK`] = 32 signed 8-bit values with one `f32` scale each:
//! `w[j, 32 b + i] ≈ scale[j, b] * q[j, b, i]`. This is the idea of ggml's Q8_0 (one scale per 32
//! weights); the in-memory layout is ours: rows are grouped into tiles of [`TILE`] = 8 output
//! features, and inside a tile the quants of two consecutive blocks of each feature are stored
//! next to each other (`[tile][block pair][feature][64 bytes]`), so one pass over a tile reads
//! its bytes sequentially. The number of blocks per row is padded to an even count and the
//! number of rows to a multiple of 8 with zero blocks (scale 0).
//!
//! Quantising (both weights and activations) uses `scale = max|x| / 127` and
//! `q = round(x / scale)` (ties away from zero), clamped to `[-127, 127]`.
//!
//! # Arithmetic (identical in every kernel path)
//!
//! [`Q8Matrix::matmul`] computes `out[r, j] = Σ_k x[r, k] · W[j, k]` for `n` activation rows
//! `x` already quantised per block ([`Q8Act`]). For every row `r`, feature `j` and block `b`:
//!
//! 1. the integer block dot product `t = Σ_i qx[r, b, i] · qw[j, b, i]` (exact in `i32`: at most
//!    `32 · 128 · 127`, which is also exactly representable in `f32`);
//! 2. `acc[r, j] = acc[r, j] + ((t as f32) · scale_w[j, b]) · scale_x[r, b]`, two rounded
//!    multiplications and one rounded addition, no fused multiply-add, blocks in increasing
//!    order starting from `acc = 0.0`.
//!
//! Step 1 is exact whatever the summation order, so each SIMD path may add the 32 products in
//! any order; step 2 is done element-wise (one SIMD lane per output feature) in the same order
//! in every path. The result for one row therefore depends only on that row and the weights,
//! never on `n` or on the kernel path (tested bit for bit).
//!
//! Each tile's weight blocks are loaded once and used for all `n` rows: a call over 9 rows
//! reads the weights once, not 9 times.
//!
//! # Kernel paths
//!
//! - [`KernelPath::Avx512Vnni`] (x86-64 with AVX-512 F/BW/VNNI): `vpdpbusd` multiplies unsigned
//!   by signed bytes, so the activations are offset by +128 (stored as `u8`), and the
//!   accumulator starts at `-128 · Σ w` (computed once per weight register with another
//!   `vpdpbusd`), which cancels the offset exactly.
//! - [`KernelPath::Avx2`]: `vpmaddubsw` on `|w|` and `x · sign(w)` (pairs of products fit in
//!   `i16`: at most `2 · 128 · 127 < 32767`), then `vpmaddwd` by ones to `i32`.
//! - [`KernelPath::Scalar`]: portable Rust, the reference.
//!
//! NEON is not written yet: on aarch64 the scalar path runs.

use crate::error::{CandleError, Result};

/// Values per quantisation block.
pub const BLOCK: usize = 32;
/// Output features per tile (one SIMD lane each in the float accumulation).
pub const TILE: usize = 8;

/// Which implementation of the block dot products runs. Every path gives bit-identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KernelPath {
    /// Portable Rust (always available).
    Scalar,
    /// x86-64 AVX2 (`vpmaddubsw` / `vpmaddwd`).
    Avx2,
    /// x86-64 AVX-512 F + BW + VNNI (`vpdpbusd` on 512-bit registers).
    Avx512Vnni,
}

impl KernelPath {
    /// The fastest path this CPU supports (runtime detection).
    pub fn detect() -> Self {
        [KernelPath::Avx512Vnni, KernelPath::Avx2]
            .into_iter()
            .find(|p| p.is_available())
            .unwrap_or(KernelPath::Scalar)
    }

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            KernelPath::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512Vnni => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx2")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every path available on this CPU, the scalar one first.
    pub fn available() -> Vec<KernelPath> {
        [KernelPath::Scalar, KernelPath::Avx2, KernelPath::Avx512Vnni]
            .into_iter()
            .filter(|p| p.is_available())
            .collect()
    }
}

/// Quantises one block (`x.len() <= 32`; missing values count as 0) into `q` and returns the
/// scale `max|x| / 127` (0 for an all-zero block, whose quants are all 0).
pub fn quantize_block(x: &[f32], q: &mut [i8; BLOCK]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (i, qi) in q.iter_mut().enumerate() {
        let v = x.get(i).copied().unwrap_or(0.0) * inv;
        *qi = v.round().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// A `[rows, cols]` weight matrix in our 8-bit block format (see the module docs).
#[derive(Clone)]
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    tiles: usize,
    /// Blocks per row, padded to an even number.
    nb: usize,
    /// `[tiles][nb / 2][TILE][2 * BLOCK]`.
    qs: Vec<i8>,
    /// `[tiles][nb][TILE]`.
    scales: Vec<f32>,
}

impl std::fmt::Debug for Q8Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q8Matrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

fn blocks_for(cols: usize) -> usize {
    let nb = cols.div_ceil(BLOCK);
    nb + nb % 2
}

impl Q8Matrix {
    fn zeros(rows: usize, cols: usize) -> Self {
        let tiles = rows.div_ceil(TILE);
        let nb = blocks_for(cols);
        Q8Matrix {
            rows,
            cols,
            tiles,
            nb,
            qs: vec![0; tiles * nb * TILE * BLOCK],
            scales: vec![0.0; tiles * nb * TILE],
        }
    }

    #[inline]
    fn q_offset(&self, j: usize, b: usize) -> usize {
        let (t, f) = (j / TILE, j % TILE);
        ((t * (self.nb / 2) + b / 2) * TILE + f) * 2 * BLOCK + (b % 2) * BLOCK
    }

    #[inline]
    fn s_offset(&self, j: usize, b: usize) -> usize {
        let (t, f) = (j / TILE, j % TILE);
        (t * self.nb + b) * TILE + f
    }

    fn set_block(&mut self, j: usize, b: usize, scale: f32, q: &[i8; BLOCK]) {
        let o = self.q_offset(j, b);
        self.qs[o..o + BLOCK].copy_from_slice(q);
        let s = self.s_offset(j, b);
        self.scales[s] = scale;
    }

    /// Quantises a row-major `[rows, cols]` f32 matrix (32 values per block, see the module
    /// docs). This is an approximation of `data` (relative error per block about
    /// `1 / 254` of the block's largest magnitude).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `data.len() != rows * cols` or a size is 0.
    pub fn quantize(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        check_dims(rows, cols, data.len())?;
        let mut m = Self::zeros(rows, cols);
        let mut q = [0i8; BLOCK];
        for j in 0..rows {
            let row = &data[j * cols..(j + 1) * cols];
            for (b, chunk) in row.chunks(BLOCK).enumerate() {
                let s = quantize_block(chunk, &mut q);
                m.set_block(j, b, s, &q);
            }
        }
        Ok(m)
    }

    /// Imports a matrix stored in GGUF/ggml Q8_0 blocks (34 bytes each: an IEEE half scale,
    /// little-endian, then 32 signed quants), row-major `[rows, cols]`. Exact: every weight
    /// keeps its value (the half scale widens to `f32` without rounding).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `cols` is not a multiple of 32 or `bytes` has the
    /// wrong length.
    pub fn from_ggml_q8_0(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        if cols % BLOCK != 0 || rows == 0 {
            return Err(CandleError::InvalidArgument(format!(
                "Q8_0 matrix [{rows}, {cols}]: columns must be a positive multiple of 32"
            )));
        }
        let per_row = cols / BLOCK;
        if bytes.len() != rows * per_row * 34 {
            return Err(CandleError::InvalidArgument(format!(
                "Q8_0 matrix [{rows}, {cols}] needs {} bytes, got {}",
                rows * per_row * 34,
                bytes.len()
            )));
        }
        let mut m = Self::zeros(rows, cols);
        let mut q = [0i8; BLOCK];
        for (idx, blk) in bytes.chunks_exact(34).enumerate() {
            let (j, b) = (idx / per_row, idx % per_row);
            let scale = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
            for (qi, &byte) in q.iter_mut().zip(&blk[2..]) {
                *qi = byte as i8;
            }
            m.set_block(j, b, scale, &q);
        }
        Ok(m)
    }

    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of quants and scales held in memory (padding included).
    pub fn memory_bytes(&self) -> usize {
        self.qs.len() + 4 * self.scales.len()
    }

    /// Writes the dequantised row `j` (`scale * q`, `cols` values) into `out`.
    ///
    /// # Panics
    /// When `j >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        assert!(
            j < self.rows && out.len() == self.cols,
            "row or length out of range"
        );
        for (b, chunk) in out.chunks_mut(BLOCK).enumerate() {
            let o = self.q_offset(j, b);
            let s = self.scales[self.s_offset(j, b)];
            for (v, &q) in chunk.iter_mut().zip(&self.qs[o..o + BLOCK]) {
                *v = s * f32::from(q);
            }
        }
    }

    /// `out[r, j] = Σ_k x[r, k] · W[j, k]` for the `x.rows()` rows of `x`: `out` is resized to
    /// `[x.rows(), self.rows()]`, row-major. `threads >= 2` splits the tiles of output features
    /// between that many scoped threads; every output value is computed by the same code, so
    /// the result does not depend on `threads` or `path` (see the module docs).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `x` was quantised for another column count, or
    /// `path` is not available on this CPU.
    pub fn matmul(
        &self,
        x: &Q8Act,
        out: &mut Vec<f32>,
        path: KernelPath,
        threads: usize,
    ) -> Result<()> {
        if x.cols != self.cols {
            return Err(CandleError::InvalidArgument(format!(
                "activations have {} columns, matrix has {}",
                x.cols, self.cols
            )));
        }
        if !path.is_available() {
            return Err(CandleError::InvalidArgument(format!(
                "kernel path {path:?} is not available on this CPU"
            )));
        }
        let n = x.n;
        out.clear();
        out.resize(n * self.rows, 0.0);
        if n == 0 {
            return Ok(());
        }
        let threads = threads.clamp(1, self.tiles);
        if threads == 1 {
            let mut acc = vec![[0f32; TILE]; n];
            for t in 0..self.tiles {
                self.tile(t, x, &mut acc, path);
                self.scatter(t, &acc, out);
            }
            return Ok(());
        }
        let per = self.tiles.div_ceil(threads);
        let parts: Vec<Vec<[f32; TILE]>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|i| {
                    let range = (i * per).min(self.tiles)..((i + 1) * per).min(self.tiles);
                    s.spawn(move || {
                        let mut acc = vec![[0f32; TILE]; n];
                        let mut res = Vec::with_capacity(range.len() * n);
                        for t in range {
                            self.tile(t, x, &mut acc, path);
                            res.extend_from_slice(&acc);
                        }
                        res
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        for (i, part) in parts.iter().enumerate() {
            for (ti, acc) in part.chunks(n).enumerate() {
                self.scatter(i * per + ti, acc, out);
            }
        }
        Ok(())
    }

    fn scatter(&self, t: usize, acc: &[[f32; TILE]], out: &mut [f32]) {
        let j0 = t * TILE;
        let w = TILE.min(self.rows - j0);
        for (r, a) in acc.iter().enumerate() {
            out[r * self.rows + j0..r * self.rows + j0 + w].copy_from_slice(&a[..w]);
        }
    }

    /// Computes tile `t` for every row of `x` into `acc` (`[n][TILE]`).
    fn tile(&self, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]], path: KernelPath) {
        acc.iter_mut().for_each(|a| *a = [0.0; TILE]);
        match path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `matmul` checked `path.is_available()` (runtime CPU feature detection).
            KernelPath::Avx512Vnni => unsafe { x86::tile_avx512vnni(self, t, x, acc) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, AVX2 was detected.
            KernelPath::Avx2 => unsafe { x86::tile_avx2(self, t, x, acc) },
            _ => self.tile_scalar(t, x, acc),
        }
    }

    fn tile_scalar(&self, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        for b in 0..self.nb {
            let sw = &self.scales[(t * self.nb + b) * TILE..][..TILE];
            let base = (t * (self.nb / 2) + b / 2) * TILE * 2 * BLOCK + (b % 2) * BLOCK;
            for (r, a) in acc.iter_mut().enumerate() {
                let xq = &x.q[(r * self.nb + b) * BLOCK..][..BLOCK];
                let sx = x.scales[r * self.nb + b];
                let mut tot = [0i32; TILE];
                for (f, tf) in tot.iter_mut().enumerate() {
                    let wq = &self.qs[base + f * 2 * BLOCK..][..BLOCK];
                    *tf = wq
                        .iter()
                        .zip(xq)
                        .map(|(&w, &v)| i32::from(w) * i32::from(v))
                        .sum();
                }
                accumulate(a, &tot, sw, sx);
            }
        }
    }
}

/// Step 2 of the module docs, lane by lane: `a[f] += ((tot[f] as f32) * sw[f]) * sx`.
#[inline(always)]
fn accumulate(a: &mut [f32; TILE], tot: &[i32; TILE], sw: &[f32], sx: f32) {
    for f in 0..TILE {
        a[f] += (tot[f] as f32 * sw[f]) * sx;
    }
}

fn check_dims(rows: usize, cols: usize, len: usize) -> Result<()> {
    if rows == 0 || cols == 0 || len != rows * cols {
        return Err(CandleError::InvalidArgument(format!(
            "matrix [{rows}, {cols}] needs {} values, got {len}",
            rows * cols
        )));
    }
    Ok(())
}

/// IEEE 754 binary16 to f32 (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let man = f32::from(h & 0x3ff);
    match exp {
        0 => sign * man * (2f32).powi(-24),
        31 if man == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        e => sign * (1.0 + man / 1024.0) * (2f32).powi(e - 15),
    }
}

/// `n` activation rows quantised per block of 32 (scale `max|x| / 127`, see the module docs),
/// padded like the matrix they multiply. Reuse one value across calls to avoid allocations.
#[derive(Debug, Clone, Default)]
pub struct Q8Act {
    n: usize,
    cols: usize,
    nb: usize,
    /// `[n][nb][32]` signed quants.
    q: Vec<i8>,
    /// The same plus 128, as unsigned bytes (for `vpdpbusd`).
    u: Vec<u8>,
    /// `[n][nb]`.
    scales: Vec<f32>,
}

impl Q8Act {
    /// Quantises the row-major `[n, cols]` activations `x` (replacing the previous content).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `cols == 0` or `x.len()` is not a multiple of it.
    pub fn quantize(&mut self, x: &[f32], cols: usize) -> Result<()> {
        if cols == 0 || x.len() % cols != 0 {
            return Err(CandleError::InvalidArgument(format!(
                "{} activations do not form rows of {cols}",
                x.len()
            )));
        }
        let n = x.len() / cols;
        let nb = blocks_for(cols);
        self.n = n;
        self.cols = cols;
        self.nb = nb;
        self.q.clear();
        self.q.resize(n * nb * BLOCK, 0);
        self.scales.clear();
        self.scales.resize(n * nb, 0.0);
        let mut q = [0i8; BLOCK];
        for r in 0..n {
            for (b, chunk) in x[r * cols..(r + 1) * cols].chunks(BLOCK).enumerate() {
                self.scales[r * nb + b] = quantize_block(chunk, &mut q);
                self.q[(r * nb + b) * BLOCK..][..BLOCK].copy_from_slice(&q);
            }
        }
        self.u.clear();
        self.u.extend(self.q.iter().map(|&v| (v as u8) ^ 0x80));
        Ok(())
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.n
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{accumulate, Q8Act, Q8Matrix, BLOCK, TILE};
    use std::arch::x86_64::*;

    /// Sums each of 8 vectors of 8 `i32` lanes: lane `f` of the result is the sum of `d[f]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum8_avx2(d: &[__m256i; TILE]) -> __m256i {
        let h01 = _mm256_hadd_epi32(d[0], d[1]);
        let h23 = _mm256_hadd_epi32(d[2], d[3]);
        let h45 = _mm256_hadd_epi32(d[4], d[5]);
        let h67 = _mm256_hadd_epi32(d[6], d[7]);
        let h0123 = _mm256_hadd_epi32(h01, h23);
        let h4567 = _mm256_hadd_epi32(h45, h67);
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(h0123, h4567),
            _mm256_permute2x128_si256::<0x31>(h0123, h4567),
        )
    }

    /// AVX2 tile kernel (see the module docs). Callers must check that the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) fn tile_avx2(m: &Q8Matrix, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        let ones = _mm256_set1_epi16(1);
        let nb = m.nb;
        for b in 0..nb {
            let base = (t * (nb / 2) + b / 2) * TILE * 2 * BLOCK + (b % 2) * BLOCK;
            let wblk = &m.qs[base..base + (TILE - 1) * 2 * BLOCK + BLOCK];
            let mut w = [_mm256_setzero_si256(); TILE];
            let mut aw = [_mm256_setzero_si256(); TILE];
            for f in 0..TILE {
                let s = &wblk[f * 2 * BLOCK..f * 2 * BLOCK + BLOCK];
                // SAFETY: `s` holds exactly 32 bytes; unaligned load.
                w[f] = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
                aw[f] = _mm256_abs_epi8(w[f]);
            }
            let sw = &m.scales[(t * nb + b) * TILE..][..TILE];
            for (r, a) in acc.iter_mut().enumerate() {
                let xs = &x.q[(r * nb + b) * BLOCK..][..BLOCK];
                // SAFETY: `xs` holds exactly 32 bytes.
                let xv = unsafe { _mm256_loadu_si256(xs.as_ptr().cast()) };
                let mut d = [_mm256_setzero_si256(); TILE];
                for f in 0..TILE {
                    let sx = _mm256_sign_epi8(xv, w[f]);
                    d[f] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[f], sx), ones);
                }
                let mut tot = [0i32; TILE];
                // SAFETY: `tot` is 32 bytes; unaligned store.
                unsafe { _mm256_storeu_si256(tot.as_mut_ptr().cast(), hsum8_avx2(&d)) };
                accumulate_avx(a, &tot, sw, x.scales[r * nb + b]);
            }
        }
    }

    /// [`accumulate`] with 256-bit float vectors: the same element-wise multiply, multiply,
    /// add (no FMA), so the same bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn accumulate_avx(a: &mut [f32; TILE], tot: &[i32; TILE], sw: &[f32], sx: f32) {
        debug_assert!(sw.len() >= TILE);
        if sw.len() < TILE {
            accumulate(a, tot, sw, sx);
            return;
        }
        // SAFETY: all three arrays/slices hold at least 8 values; unaligned loads/stores.
        unsafe {
            let tf = _mm256_cvtepi32_ps(_mm256_loadu_si256(tot.as_ptr().cast()));
            let s = _mm256_mul_ps(
                _mm256_mul_ps(tf, _mm256_loadu_ps(sw.as_ptr())),
                _mm256_set1_ps(sx),
            );
            let av = _mm256_add_ps(_mm256_loadu_ps(a.as_ptr()), s);
            _mm256_storeu_ps(a.as_mut_ptr(), av);
        }
    }

    /// Interleaves and adds 32-bit lanes of `a` and `b` (first step of an 8-way reduction).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn r2(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    }

    /// Interleaves and adds 64-bit lanes of `a` and `b` (second step).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn r4(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    }

    /// AVX-512 VNNI tile kernel: two blocks (64 bytes) per `vpdpbusd` (see the module docs).
    /// Callers must check that the CPU has AVX-512 F, BW, VNNI and AVX2.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    pub(super) fn tile_avx512vnni(m: &Q8Matrix, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        let nb = m.nb;
        let c128 = _mm512_set1_epi8(-128); // 0x80 = 128 as the unsigned operand
        let zero = _mm512_setzero_si512();
        for p in 0..nb / 2 {
            let base = (t * (nb / 2) + p) * TILE * 2 * BLOCK;
            let wblk = &m.qs[base..base + TILE * 2 * BLOCK];
            let mut w = [zero; TILE];
            let mut nc = [zero; TILE];
            for f in 0..TILE {
                let s = &wblk[f * 2 * BLOCK..(f + 1) * 2 * BLOCK];
                // SAFETY: `s` holds exactly 64 bytes; unaligned load.
                w[f] = unsafe { _mm512_loadu_si512(s.as_ptr().cast()) };
                // -128 * (sum of each 4 weights), cancels the +128 offset of the activations.
                nc[f] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, w[f]));
            }
            let sw0 = &m.scales[(t * nb + 2 * p) * TILE..][..TILE];
            let sw1 = &m.scales[(t * nb + 2 * p + 1) * TILE..][..TILE];
            for (r, a) in acc.iter_mut().enumerate() {
                let xs = &x.u[(r * nb + 2 * p) * BLOCK..][..2 * BLOCK];
                // SAFETY: `xs` holds exactly 64 bytes.
                let xv = unsafe { _mm512_loadu_si512(xs.as_ptr().cast()) };
                let mut d = [zero; TILE];
                for f in 0..TILE {
                    d[f] = _mm512_dpbusd_epi32(nc[f], xv, w[f]);
                }
                // Lanes 0..8 of d[f] belong to block 2p, lanes 8..16 to block 2p + 1.
                // Per 128-bit chunk: [f0, f1, f2, f3] and [f4 .. f7] partial sums.
                let q0 = r4(r2(d[0], d[1]), r2(d[2], d[3]));
                let q1 = r4(r2(d[4], d[5]), r2(d[6], d[7]));
                // [f0-3 blk 2p, f0-3 blk 2p+1, f4-7 blk 2p, f4-7 blk 2p+1]
                let s = _mm512_add_epi32(
                    _mm512_shuffle_i32x4::<0x88>(q0, q1),
                    _mm512_shuffle_i32x4::<0xDD>(q0, q1),
                );
                // -> [f0-7 blk 2p, f0-7 blk 2p+1]
                let s = _mm512_shuffle_i32x4::<0xD8>(s, s);
                let mut tot = [0i32; 2 * TILE];
                // SAFETY: `tot` is 64 bytes; unaligned store.
                unsafe { _mm512_storeu_si512(tot.as_mut_ptr().cast(), s) };
                let (t0, t1) = tot.split_at(TILE);
                let t0: &[i32; TILE] = t0.try_into().unwrap_or(&[0; TILE]);
                let t1: &[i32; TILE] = t1.try_into().unwrap_or(&[0; TILE]);
                accumulate_avx(a, t0, sw0, x.scales[r * nb + 2 * p]);
                accumulate_avx(a, t1, sw1, x.scales[r * nb + 2 * p + 1]);
            }
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
    fn f16_conversion_is_exact() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
    }

    #[test]
    fn quantize_block_round_trips_within_half_step() {
        let mut s = 7;
        let x: Vec<f32> = (0..32).map(|_| lcg(&mut s)).collect();
        let mut q = [0; BLOCK];
        let d = quantize_block(&x, &mut q);
        for (v, &qi) in x.iter().zip(&q) {
            assert!((v - d * f32::from(qi)).abs() <= d * 0.5 + 1e-7);
        }
        let mut q0 = [1; BLOCK];
        assert_eq!(quantize_block(&[0.0; 5], &mut q0), 0.0);
        assert_eq!(q0, [0; BLOCK]);
    }

    #[test]
    fn ggml_import_keeps_values() {
        // One row of two blocks: scales 0.5 and -1.0 (f16 0x3800, 0xbc00).
        let mut bytes = vec![0x00, 0x38];
        bytes.extend((0..32).map(|i| i as u8));
        bytes.extend([0x00, 0xbc]);
        bytes.extend((0..32).map(|i| (-(i as i8)) as u8));
        let m = Q8Matrix::from_ggml_q8_0(1, 64, &bytes).unwrap();
        let mut row = vec![0.0; 64];
        m.dequantize_row(0, &mut row);
        assert_eq!(row[3], 1.5);
        assert_eq!(row[32 + 5], 5.0);
        assert!(Q8Matrix::from_ggml_q8_0(1, 64, &bytes[1..]).is_err());
    }
}
