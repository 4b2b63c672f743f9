//! Our 8-bit block weight format and the multi-row, batch-invariant int8 matmul.
//!
//! # Format
//!
//! A [`Q8Matrix`] holds a `[rows, cols]` matrix (row `j` is output feature `j`) as blocks of
//! [`BLOCK`] = 32 signed 8-bit values with one `f32` scale each:
//! `w[j, 32 b + i] ≈ scale[j, b] · q[j, b, i]`. This is the idea of ggml's Q8_0 (one scale per
//! 32 weights); the in-memory layout is ours. Rows are grouped into tiles of [`TILE`] = 16
//! output features; for each tile and block the 512 quants are stored as 8 groups of 64 bytes,
//! group `g` holding bytes `4g .. 4g + 4` of the block for each of the 16 features in turn
//! (`[tile][block][g][feature][4]`), so one 64-byte load gives one 32-bit lane per feature.
//! Quants are stored offset by +128 as unsigned bytes (`u = q + 128`). Rows are padded to a
//! multiple of 16 and the last block of a row with zeros.
//!
//! Quantising (weights and activations) uses `scale = max|x| / 127` and
//! `q = round(x / scale)` with ties to even, clamped to `[-127, 127]`.
//!
//! # Arithmetic (identical in every kernel path)
//!
//! [`Q8Matrix::matmul`] computes `out[r, j] = Σ_k x[r, k] · W[j, k]` for `n` activation rows
//! already quantised per block ([`Q8Act`]). For every row `r`, feature `j` and block `b`:
//!
//! 1. the integer block dot product `t = Σ_i qx[r, b, i] · qw[j, b, i]` (exact in `i32`: at most
//!    `32 · 128 · 127`, which is also exactly representable in `f32`);
//! 2. `acc[r, j] = acc[r, j] + ((t as f32) · scale_w[j, b]) · scale_x[r, b]`: two rounded
//!    multiplications and one rounded addition, no fused multiply-add, blocks in increasing
//!    order starting from `acc = 0.0`.
//!
//! Step 1 is exact whatever the order of the 32 products, so each SIMD path may add them in any
//! order; step 2 is done element-wise (one SIMD lane per output feature) in the same order in
//! every path. The result for one row depends only on that row and the weights, never on `n`,
//! the thread count or the kernel path (tested bit for bit).
//!
//! Each tile's weight blocks are loaded once per block and used for all `n` rows: a call over 9
//! rows reads the weights from memory once, not 9 times. Because each SIMD lane is one output
//! feature, no horizontal reduction is needed (the layout idea is the "interleaved/repacked"
//! weight layouts of llama.cpp's CPU back-ends; the code is ours).
//!
//! # Kernel paths
//!
//! - [`KernelPath::Avx512Vnni`] (x86-64 with AVX-512 F/BW/VNNI): per block and row, 8
//!   `vpdpbusd` of the unsigned (offset) weights by a broadcast of 4 signed activation bytes; the
//!   accumulator starts at `-128 · Σ qx[r, b, ·]` (precomputed per activation block), which
//!   cancels the offset exactly. Rows run in register groups of up to 12 per tile (a tile's
//!   weights, at most 27 KB for SmolLM2, are re-read from L1 by later groups), and the next
//!   tile is prefetched while the current one is computed, which lets the arithmetic of a
//!   9-row call hide under the memory stream (see `x86::tile_avx512vnni`).
//! - [`KernelPath::Avx2`]: the weights are un-offset once per block, then `vpmaddubsw` of `|w|`
//!   by `x · sign(w)` (pairs of products fit in `i16`: at most `2 · 128 · 127 < 32767`) and
//!   `vpmaddwd` by ones into `i32`.
//! - [`KernelPath::NeonDotprod`] (aarch64 with the dot-product extension, FEAT_DotProd): the
//!   weights are un-offset once per block (`u ^ 0x80` is `q` as a signed byte), then per row
//!   and block 8 `sdot` by-element instructions (each lane one feature, the 4 activation bytes
//!   of a group taken from the activation block register by index) in 4 chains, added exactly.
//!   Rust 1.95 has no stable `vdotq_s32`, so `sdot` is written as inline assembly in a function
//!   compiled with the `dotprod` target feature.
//! - [`KernelPath::Neon`] (every aarch64 CPU): the same un-offset weights; `smull`/`smlal`
//!   multiply 8 weight bytes by the broadcast group of 4 activation bytes into `i16` and add the
//!   products of two groups (at most `2 · 128 · 127 = 32512 < 32767`: weights lie in
//!   `[-128, 127]`, activations in `[-127, 127]`), `sadalp` adds pairs into `i32` and a final
//!   `addp` gives one lane per feature.
//! - [`KernelPath::Scalar`]: portable Rust, the reference.
//!
//! The NEON paths do step 2 with `fmul`, `fmul`, `fadd` on 4 features at a time (never a
//! fused `fmla`); on AArch64 the Advanced SIMD and the scalar floating-point units both follow
//! the FPCR (round to nearest, no flush to zero on Linux), so the bits are those of the scalar
//! path. Activations are quantised by the portable code on aarch64.

use crate::error::{CandleError, Result};

/// Values per quantisation block.
pub const BLOCK: usize = 32;
/// Output features per tile (one SIMD lane each in the float accumulation).
pub const TILE: usize = 16;
/// Bytes of one tile-block: `TILE` features × `BLOCK` quants.
const TB: usize = TILE * BLOCK;

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
    /// aarch64 Advanced SIMD, present on every aarch64 CPU (`smull` / `smlal` / `sadalp`).
    Neon,
    /// aarch64 Advanced SIMD with the dot-product extension (`sdot`; optional from Armv8.2-A,
    /// mandatory from Armv8.4-A).
    NeonDotprod,
}

impl KernelPath {
    /// The fastest path this CPU supports (runtime detection).
    pub fn detect() -> Self {
        [
            KernelPath::Avx512Vnni,
            KernelPath::Avx2,
            KernelPath::NeonDotprod,
            KernelPath::Neon,
        ]
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
            }
            #[cfg(target_arch = "aarch64")]
            KernelPath::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            KernelPath::NeonDotprod => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            // The paths of other architectures.
            _ => false,
        }
    }

    /// Every path available on this CPU, the scalar one first.
    pub fn available() -> Vec<KernelPath> {
        [
            KernelPath::Scalar,
            KernelPath::Avx2,
            KernelPath::Avx512Vnni,
            KernelPath::Neon,
            KernelPath::NeonDotprod,
        ]
        .into_iter()
        .filter(|p| p.is_available())
        .collect()
    }
}

/// Round to nearest, ties to even, for `|v| < 2^22` (adding and subtracting `1.5 · 2^23`
/// leaves no fraction bits); plain adds, so it vectorises on any x86-64.
#[inline(always)]
fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// Quantises one block (`x.len() <= 32`; missing values count as 0) into `q` and returns the
/// scale `max|x| / 127` (0 for an all-zero block, whose quants are all 0).
pub fn quantize_block(x: &[f32], q: &mut [i8; BLOCK]) -> f32 {
    quantize_block_inline(x, q)
}

#[inline(always)]
fn quantize_block_inline(x: &[f32], q: &mut [i8; BLOCK]) -> f32 {
    let mut v = [0f32; BLOCK];
    let len = x.len().min(BLOCK);
    v[..len].copy_from_slice(&x[..len]);
    // The maximum is exact in any order, so 8 running maxima give the same value as one.
    let mut m = [0f32; 8];
    for c in v.chunks_exact(8) {
        for i in 0..8 {
            m[i] = m[i].max(c[i].abs());
        }
    }
    let amax = m.iter().fold(0f32, |a, &b| a.max(b));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (qi, a) in q.iter_mut().zip(&v) {
        *qi = round_even(a * inv).clamp(-127.0, 127.0) as i32 as i8;
    }
    scale
}

/// Output buffers of [`quantize_rows`] (the fields of [`Q8Act`]).
struct ActBufs<'a> {
    q: &'a mut [i8],
    scales: &'a mut [f32],
    corr: &'a mut [i32],
}

/// Quantises whole activation rows (`x` is `[n, cols]`, `nb` blocks per row) as laid out in
/// [`Q8Act`]; compiled with AVX2 where available (element-wise, same bits).
fn quantize_rows(x: &[f32], cols: usize, nb: usize, out: ActBufs<'_>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F was detected at run time.
        unsafe { x86::quantize_rows_avx512(x, cols, nb, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected at run time.
        unsafe { quantize_rows_avx2(x, cols, nb, out) };
        return;
    }
    quantize_rows_generic(x, cols, nb, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_rows_avx2(x: &[f32], cols: usize, nb: usize, out: ActBufs<'_>) {
    quantize_rows_generic(x, cols, nb, out);
}

#[inline(always)]
fn quantize_rows_generic(x: &[f32], cols: usize, nb: usize, out: ActBufs<'_>) {
    for (r, row) in x.chunks_exact(cols).enumerate() {
        for (b, chunk) in row.chunks(BLOCK).enumerate() {
            let i = r * nb + b;
            let qb: &mut [i8; BLOCK] = match (&mut out.q[i * BLOCK..(i + 1) * BLOCK]).try_into() {
                Ok(qb) => qb,
                Err(_) => return,
            };
            out.scales[i] = quantize_block_inline(chunk, qb);
            let mut sum = 0i32;
            for &v in qb.iter() {
                sum += i32::from(v);
            }
            out.corr[i] = -128 * sum;
        }
    }
}

/// A `[rows, cols]` weight matrix in our 8-bit block format (see the module docs).
#[derive(Clone)]
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    tiles: usize,
    /// Blocks per row.
    nb: usize,
    /// `[tiles][nb][8 groups][TILE][4]`, quants + 128.
    qs: Vec<u8>,
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

impl Q8Matrix {
    fn zeros(rows: usize, cols: usize) -> Self {
        let tiles = rows.div_ceil(TILE);
        let nb = cols.div_ceil(BLOCK);
        Q8Matrix {
            rows,
            cols,
            tiles,
            nb,
            qs: vec![0x80; tiles * nb * TB],
            scales: vec![0.0; tiles * nb * TILE],
        }
    }

    /// Offset of quant `i` of block `b` of row `j`.
    #[inline]
    fn q_index(&self, j: usize, b: usize, i: usize) -> usize {
        let (t, f) = (j / TILE, j % TILE);
        (t * self.nb + b) * TB + (i / 4) * TILE * 4 + f * 4 + i % 4
    }

    #[inline]
    fn s_index(&self, j: usize, b: usize) -> usize {
        let (t, f) = (j / TILE, j % TILE);
        (t * self.nb + b) * TILE + f
    }

    fn set_block(&mut self, j: usize, b: usize, scale: f32, q: &[i8; BLOCK]) {
        for (i, &v) in q.iter().enumerate() {
            let o = self.q_index(j, b, i);
            self.qs[o] = (v as u8) ^ 0x80;
        }
        let s = self.s_index(j, b);
        self.scales[s] = scale;
    }

    /// Quantises a row-major `[rows, cols]` f32 matrix (32 values per block, see the module
    /// docs). This is an approximation of `data` (error per value at most half a step,
    /// `max|block| / 254`).
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
    /// [`CandleError::InvalidArgument`] when `cols` is not a positive multiple of 32, `rows` is
    /// 0, or `bytes` has the wrong length.
    pub fn from_ggml_q8_0(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) || rows == 0 || cols == 0 {
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

    /// Writes the dequantised row `j` (`scale · q`, `cols` values) into `out`.
    ///
    /// # Panics
    /// When `j >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        assert!(
            j < self.rows && out.len() == self.cols,
            "row or length out of range"
        );
        for (b, chunk) in out.chunks_mut(BLOCK).enumerate() {
            let s = self.scales[self.s_index(j, b)];
            for (i, v) in chunk.iter_mut().enumerate() {
                let q = (self.qs[self.q_index(j, b, i)] ^ 0x80) as i8;
                *v = s * f32::from(q);
            }
        }
    }

    /// `out[r, j] = Σ_k x[r, k] · W[j, k]` for the `x.rows()` rows of `x`: `out` is resized to
    /// `[x.rows(), self.rows()]`, row-major. `threads >= 2` splits the tiles of output features
    /// with one persistent helper thread (more than 2 counts as 2; no thread is spawned per
    /// call, see `pool`); every output value is computed by the same code, so
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
        // Two threads: the caller and the persistent helper of `pool` (no spawn per call), the
        // tiles handed out in halves by an atomic counter (a helper that has not started yet
        // leaves both halves to the caller). Each tile is computed by the same code whichever
        // thread takes it, so the bits do not change.
        let next = std::sync::atomic::AtomicUsize::new(0);
        let dst = SyncPtr(out.as_mut_ptr());
        let chunk = self.tiles.div_ceil(CHUNKS).max(1);
        let job = |_part: usize| {
            let mut acc = vec![[0f32; TILE]; n];
            loop {
                let t0 = next.fetch_add(chunk, std::sync::atomic::Ordering::Relaxed);
                if t0 >= self.tiles {
                    break;
                }
                for t in t0..(t0 + chunk).min(self.tiles) {
                    self.tile(t, x, &mut acc, path);
                    // SAFETY: `out` holds `n * rows` values and outlives `run2`; tile `t`
                    // writes only its own columns `16 t ..`, and each tile is taken once.
                    unsafe { self.scatter_raw(t, &acc, dst) };
                }
            }
        };
        super::pool::run2(&job);
        Ok(())
    }

    /// [`Self::scatter`] through a raw pointer to the `[n, rows]` output.
    ///
    /// # Safety
    /// `dst` must point to `acc.len() * rows` writable values, not accessed concurrently at
    /// tile `t`'s columns.
    unsafe fn scatter_raw(&self, t: usize, acc: &[[f32; TILE]], dst: SyncPtr) {
        unsafe {
            let j0 = t * TILE;
            let w = TILE.min(self.rows - j0);
            for (r, a) in acc.iter().enumerate() {
                std::ptr::copy_nonoverlapping(a.as_ptr(), dst.0.add(r * self.rows + j0), w);
            }
        }
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
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above, NEON and the dot-product extension were detected.
            KernelPath::NeonDotprod => unsafe { neon::tile_dotprod(self, t, x, acc) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above, NEON was detected.
            KernelPath::Neon => unsafe { neon::tile_neon(self, t, x, acc) },
            _ => self.tile_scalar(t, x, acc),
        }
    }

    fn tile_scalar(&self, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        let nb = self.nb;
        for b in 0..nb {
            let wb = &self.qs[(t * nb + b) * TB..][..TB];
            let sw: &[f32; TILE] = self.scales[(t * nb + b) * TILE..][..TILE]
                .try_into()
                .unwrap_or(&[0.0; TILE]);
            for (r, a) in acc.iter_mut().enumerate() {
                let xq = &x.q[(r * nb + b) * BLOCK..][..BLOCK];
                let mut tot = [0i32; TILE];
                for (g, xg) in xq.chunks_exact(4).enumerate() {
                    let wg = &wb[g * TILE * 4..][..TILE * 4];
                    for (f, tf) in tot.iter_mut().enumerate() {
                        for (&u, &v) in wg[f * 4..f * 4 + 4].iter().zip(xg) {
                            *tf += (i32::from(u) - 128) * i32::from(v);
                        }
                    }
                }
                accumulate(a, &tot, sw, x.scales[r * nb + b]);
            }
        }
    }
}

/// Work items of a two-thread matmul: the two halves of the tiles, each claimed by whichever
/// thread comes first (contiguous halves keep each thread's next-tile prefetch in its own
/// range; measured faster than 4, 8 or 16 items).
const CHUNKS: usize = 2;

/// The output pointer shared by the two threads of a matmul (disjoint columns each).
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);

// SAFETY: the threads write disjoint elements through it (see `Q8Matrix::matmul`).
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

/// Step 2 of the module docs, lane by lane: `a[f] += ((tot[f] as f32) · sw[f]) · sx`.
#[inline(always)]
fn accumulate(a: &mut [f32; TILE], tot: &[i32; TILE], sw: &[f32; TILE], sx: f32) {
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
/// the last block of a row zero-padded. Reuse one value across calls to avoid allocations.
#[derive(Debug, Clone, Default)]
pub struct Q8Act {
    n: usize,
    cols: usize,
    nb: usize,
    /// `[n][nb][32]` signed quants.
    q: Vec<i8>,
    /// `[n][nb]` scales.
    scales: Vec<f32>,
    /// `[n][nb]`: `-128 · Σ q` of the block (cancels the weights' +128 offset).
    corr: Vec<i32>,
}

impl Q8Act {
    /// Quantises the row-major `[n, cols]` activations `x` (replacing the previous content).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `cols == 0` or `x.len()` is not a multiple of it.
    pub fn quantize(&mut self, x: &[f32], cols: usize) -> Result<()> {
        if cols == 0 || !x.len().is_multiple_of(cols) {
            return Err(CandleError::InvalidArgument(format!(
                "{} activations do not form rows of {cols}",
                x.len()
            )));
        }
        let n = x.len() / cols;
        let nb = cols.div_ceil(BLOCK);
        self.n = n;
        self.cols = cols;
        self.nb = nb;
        self.q.clear();
        self.q.resize(n * nb * BLOCK, 0);
        self.scales.clear();
        self.scales.resize(n * nb, 0.0);
        self.corr.clear();
        self.corr.resize(n * nb, 0);
        let bufs = ActBufs {
            q: &mut self.q,
            scales: &mut self.scales,
            corr: &mut self.corr,
        };
        quantize_rows(x, cols, nb, bufs);
        Ok(())
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.n
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ActBufs, BLOCK, Q8Act, Q8Matrix, TB, TILE};
    use std::arch::x86_64::*;

    /// AVX-512 activation quantiser: the operations of `quantize_block_inline` (maximum of
    /// `|x|`, `scale = amax / 127`, `inv = 1 / scale`, `round_even(x · inv)` by the same
    /// add-and-subtract, clamp) on two 16-lane halves of each block; the quants' sum is exact.
    #[target_feature(enable = "avx512f")]
    pub(super) fn quantize_rows_avx512(x: &[f32], cols: usize, nb: usize, out: ActBufs<'_>) {
        let magic = _mm512_set1_ps(12_582_912.0);
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for (r, row) in x.chunks_exact(cols).enumerate() {
            for b in 0..nb {
                let start = b * BLOCK;
                let len = (cols - start).min(BLOCK);
                let m0: __mmask16 = if len >= 16 { 0xffff } else { (1u16 << len) - 1 };
                let m1: __mmask16 = if len >= 32 {
                    0xffff
                } else if len > 16 {
                    (1u16 << (len - 16)) - 1
                } else {
                    0
                };
                let src = row[start..start + len].as_ptr();
                // SAFETY: masked loads read only the `len` values of this block.
                let (v0, v1) = unsafe {
                    (
                        _mm512_maskz_loadu_ps(m0, src),
                        _mm512_maskz_loadu_ps(m1, src.wrapping_add(16)),
                    )
                };
                let amax =
                    _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
                let scale = amax / 127.0;
                let inv = _mm512_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
                let q = |v: __m512| {
                    let t = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, inv), magic), magic);
                    _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, lo), hi))
                };
                let (q0, q1) = (q(v0), q(v1));
                let i = r * nb + b;
                let dst = &mut out.q[i * BLOCK..(i + 1) * BLOCK];
                // SAFETY: `dst` holds 32 bytes; each store writes 16.
                unsafe {
                    _mm_storeu_si128(dst.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q0));
                    _mm_storeu_si128(dst.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(q1));
                }
                out.scales[i] = scale;
                out.corr[i] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            }
        }
    }

    /// Reads 4 activation bytes as one little-endian `i32` (for a broadcast).
    #[inline(always)]
    fn group(xq: &[i8], g: usize) -> i32 {
        i32::from_le_bytes([
            xq[4 * g] as u8,
            xq[4 * g + 1] as u8,
            xq[4 * g + 2] as u8,
            xq[4 * g + 3] as u8,
        ])
    }

    /// AVX2 tile kernel (see the module docs): the 16 features as two halves of 8 lanes.
    /// Callers must check that the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) fn tile_avx2(m: &Q8Matrix, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        let ones = _mm256_set1_epi16(1);
        let off = _mm256_set1_epi8(-128);
        let nb = m.nb;
        for b in 0..nb {
            let wb = &m.qs[(t * nb + b) * TB..][..TB];
            for half in 0..2 {
                let mut w = [_mm256_setzero_si256(); 8];
                let mut aw = [_mm256_setzero_si256(); 8];
                for g in 0..8 {
                    let s = &wb[g * TILE * 4 + half * 32..][..32];
                    // SAFETY: `s` holds exactly 32 bytes; unaligned load.
                    let u = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
                    w[g] = _mm256_xor_si256(u, off);
                    aw[g] = _mm256_abs_epi8(w[g]);
                }
                let sws = &m.scales[(t * nb + b) * TILE + half * 8..][..8];
                // SAFETY: `sws` holds exactly 8 floats.
                let sw = unsafe { _mm256_loadu_ps(sws.as_ptr()) };
                for (r, a) in acc.iter_mut().enumerate() {
                    let xq = &x.q[(r * nb + b) * BLOCK..][..BLOCK];
                    let mut tot = _mm256_setzero_si256();
                    for g in 0..8 {
                        let xv = _mm256_set1_epi32(group(xq, g));
                        let sx = _mm256_sign_epi8(xv, w[g]);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[g], sx), ones);
                        tot = _mm256_add_epi32(tot, p);
                    }
                    let v = _mm256_mul_ps(
                        _mm256_mul_ps(_mm256_cvtepi32_ps(tot), sw),
                        _mm256_set1_ps(x.scales[r * nb + b]),
                    );
                    let ah = &mut a[half * 8..half * 8 + 8];
                    // SAFETY: `ah` holds exactly 8 floats; unaligned load and store.
                    unsafe {
                        let s = _mm256_add_ps(_mm256_loadu_ps(ah.as_ptr()), v);
                        _mm256_storeu_ps(ah.as_mut_ptr(), s);
                    }
                }
            }
        }
    }

    /// AVX-512 VNNI tile kernel (see the module docs). Rows are processed in balanced groups
    /// of at most [`ROWS`] whose accumulators stay in registers for the whole tile (no
    /// load/store of partial sums); within a group each block's 8 weight vectors are loaded
    /// once and used for every row of the group (the first group reads them from memory, the
    /// others from L1). Per row and block: the offset correction, 8 `vpdpbusd` of the unsigned
    /// weights by broadcast groups of 4 activation bytes (4 chains, exact integer sums), then
    /// step 2 of the module docs. While a tile is computed, the next tile's weights are
    /// prefetched, spread evenly over all its groups' blocks, so the memory stream overlaps
    /// the arithmetic of every group. Callers must check that the CPU has AVX-512 F, BW and
    /// VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) fn tile_avx512vnni(m: &Q8Matrix, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        let n = acc.len();
        let nb = m.nb;
        assert!(
            n <= x.n
                && x.nb == nb
                && x.q.len() >= x.n * nb * BLOCK
                && x.scales.len() >= x.n * nb
                && x.corr.len() >= x.n * nb
                && m.qs.len() >= (t + 1) * nb * TB
                && m.scales.len() >= (t + 1) * nb * TILE
        );
        // Balanced groups of at most ROWS: 9 rows run as one group, 17 as 9 + 8.
        let per = n.div_ceil(n.div_ceil(ROWS).max(1));
        assert!(per <= ROWS);
        let mut r0 = 0;
        while r0 < n {
            let rows = (n - r0).min(per);
            let out = &mut acc[r0..r0 + rows];
            let grp = (r0 / per, n.div_ceil(per));
            // SAFETY: the assertions above bound every read of the group kernel (tile `t`'s
            // weights and scales, rows `r0 .. r0 + rows` of `x`); `out` holds `rows` rows and
            // `1 <= rows <= per <= ROWS`, so the last arm runs with `rows == ROWS`.
            unsafe {
                match rows {
                    1 => group_vnni::<1>(m, t, x, r0, out, grp),
                    2 => group_vnni::<2>(m, t, x, r0, out, grp),
                    3 => group_vnni::<3>(m, t, x, r0, out, grp),
                    4 => group_vnni::<4>(m, t, x, r0, out, grp),
                    5 => group_vnni::<5>(m, t, x, r0, out, grp),
                    6 => group_vnni::<6>(m, t, x, r0, out, grp),
                    7 => group_vnni::<7>(m, t, x, r0, out, grp),
                    8 => group_vnni::<8>(m, t, x, r0, out, grp),
                    9 => group_vnni::<9>(m, t, x, r0, out, grp),
                    10 => group_vnni::<10>(m, t, x, r0, out, grp),
                    11 => group_vnni::<11>(m, t, x, r0, out, grp),
                    12 => group_vnni::<12>(m, t, x, r0, out, grp),
                    _ => group_vnni::<ROWS>(m, t, x, r0, out, grp),
                }
            }
            r0 += rows;
        }
    }

    /// Rows per register group of [`tile_avx512vnni`].
    const ROWS: usize = 12;

    /// `R` rows from `r0` of tile `t`, group `g` of `groups`; callers guarantee the bounds
    /// checked in [`tile_avx512vnni`] and `out.len() == R`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn group_vnni<const R: usize>(
        m: &Q8Matrix,
        t: usize,
        x: &Q8Act,
        r0: usize,
        out: &mut [[f32; TILE]],
        (g, groups): (usize, usize),
    ) {
        unsafe {
            let nb = m.nb;
            let wq = m.qs.as_ptr().add(t * nb * TB);
            let ws = m.scales.as_ptr().add(t * nb * TILE);
            let xq = x.q.as_ptr().add(r0 * nb * BLOCK).cast::<i32>();
            let xs = x.scales.as_ptr().add(r0 * nb);
            let xc = x.corr.as_ptr().add(r0 * nb);
            // The next tile's weights, spread evenly over the blocks of all groups of this tile.
            let next = wq.wrapping_add(nb * TB);
            let span = groups * nb;
            let mut a = [_mm512_setzero_ps(); R];
            for b in 0..nb {
                let wb = wq.add(b * TB);
                let l = g * nb + b;
                let (lo, hi) = ((l * nb * TB / span) & !63, ((l + 1) * nb * TB / span) & !63);
                for off in (lo..hi).step_by(64) {
                    // A hint only: prefetching never faults, so an address past the end is fine.
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off).cast());
                }
                let mut w = [_mm512_setzero_si512(); 8];
                for (k, wk) in w.iter_mut().enumerate() {
                    *wk = _mm512_loadu_si512(wb.add(k * 64).cast());
                }
                let sw = _mm512_loadu_ps(ws.add(b * TILE));
                for (r, ar) in a.iter_mut().enumerate() {
                    let i = r * nb + b;
                    let xg = xq.add(i * (BLOCK / 4));
                    // Four independent chains (groups `g mod 4`), added exactly at the end.
                    let xv = |g: usize| _mm512_set1_epi32(xg.add(g).read_unaligned());
                    let t0 = _mm512_dpbusd_epi32(_mm512_set1_epi32(*xc.add(i)), w[0], xv(0));
                    let t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], xv(1));
                    let t2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2], xv(2));
                    let t3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[3], xv(3));
                    let t0 = _mm512_dpbusd_epi32(t0, w[4], xv(4));
                    let t1 = _mm512_dpbusd_epi32(t1, w[5], xv(5));
                    let t2 = _mm512_dpbusd_epi32(t2, w[6], xv(6));
                    let t3 = _mm512_dpbusd_epi32(t3, w[7], xv(7));
                    let tot = _mm512_add_epi32(_mm512_add_epi32(t0, t1), _mm512_add_epi32(t2, t3));
                    let v = _mm512_mul_ps(
                        _mm512_mul_ps(_mm512_cvtepi32_ps(tot), sw),
                        _mm512_set1_ps(*xs.add(i)),
                    );
                    *ar = _mm512_add_ps(*ar, v);
                }
            }
            for (o, ar) in out.iter_mut().zip(&a) {
                _mm512_storeu_ps(o.as_mut_ptr(), *ar);
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{BLOCK, Q8Act, Q8Matrix, TB, TILE};
    use std::arch::aarch64::*;
    use std::arch::asm;

    /// Features per 128-bit vector of `i32` / `f32` lanes.
    const QUAD: usize = 4;

    /// The 8 weight vectors of features `4 q .. 4 q + 4` of one tile-block (`wb`, [`TB`] bytes),
    /// un-offset to signed bytes: vector `g` holds bytes `4 g .. 4 g + 4` of the block for each
    /// of the 4 features in turn.
    #[inline]
    #[target_feature(enable = "neon")]
    fn quad_weights(wb: &[u8], q: usize) -> [int8x16_t; 8] {
        let off = vdupq_n_u8(0x80);
        let mut w = [vdupq_n_s8(0); 8];
        for (g, wg) in w.iter_mut().enumerate() {
            let s = &wb[g * TILE * 4 + q * 16..][..16];
            // SAFETY: `s` holds exactly 16 bytes; `vld1q_u8` needs no alignment.
            let u = unsafe { vld1q_u8(s.as_ptr()) };
            *wg = vreinterpretq_s8_u8(veorq_u8(u, off));
        }
        w
    }

    /// Row-block `i` of the activations as two vectors: groups 0-3 and groups 4-7.
    #[inline]
    #[target_feature(enable = "neon")]
    fn act_block(x: &Q8Act, i: usize) -> (int8x16_t, int8x16_t) {
        let xq = &x.q[i * BLOCK..][..BLOCK];
        // SAFETY: `xq` holds exactly 32 bytes; each unaligned load reads 16 of them.
        unsafe { (vld1q_s8(xq.as_ptr()), vld1q_s8(xq.as_ptr().add(16))) }
    }

    /// Step 2 of the module docs for 4 features (`a` starts at the first of them):
    /// `a[f] += ((tot[f] as f32) · sw[f]) · sx`, two multiplications then one addition, each
    /// rounded, as in the scalar path (no fused multiply-add).
    #[inline]
    #[target_feature(enable = "neon")]
    fn accumulate4(a: &mut [f32], tot: int32x4_t, sw: float32x4_t, sx: f32) {
        let a = &mut a[..QUAD];
        let v = vmulq_f32(vmulq_f32(vcvtq_f32_s32(tot), sw), vdupq_n_f32(sx));
        // SAFETY: `a` holds exactly 4 floats; unaligned load and store.
        unsafe { vst1q_f32(a.as_mut_ptr(), vaddq_f32(vld1q_f32(a.as_ptr()), v)) };
    }

    /// The 4 scales of features `4 q .. 4 q + 4` of one tile-block (`sws`, [`TILE`] floats).
    #[inline]
    #[target_feature(enable = "neon")]
    fn quad_scales(sws: &[f32], q: usize) -> float32x4_t {
        let s = &sws[q * QUAD..][..QUAD];
        // SAFETY: `s` holds exactly 4 floats; unaligned load.
        unsafe { vld1q_f32(s.as_ptr()) }
    }

    /// The exact block dot products of 4 features (lane `f`: `Σ_i w_f[i] · x[i]` over the 32
    /// bytes) with `sdot` by element: group `g` of the weights times the 4 bytes of group `g`
    /// of the activations (lane `g mod 4` of `x0` or `x1`), in 4 chains added at the end.
    #[inline]
    #[target_feature(enable = "neon,dotprod")]
    fn dot_sdot(w: &[int8x16_t; 8], x0: int8x16_t, x1: int8x16_t) -> int32x4_t {
        let (mut t0, mut t1) = (vdupq_n_s32(0), vdupq_n_s32(0));
        let (mut t2, mut t3) = (vdupq_n_s32(0), vdupq_n_s32(0));
        // SAFETY: `sdot` needs FEAT_DotProd, which this function is compiled for and which
        // callers of the kernel detected at run time; the instructions read and write only
        // the vector registers bound here (no memory, stack or flags).
        unsafe {
            asm!(
                "sdot {t0:v}.4s, {w0:v}.16b, {x0:v}.4b[0]",
                "sdot {t1:v}.4s, {w1:v}.16b, {x0:v}.4b[1]",
                "sdot {t2:v}.4s, {w2:v}.16b, {x0:v}.4b[2]",
                "sdot {t3:v}.4s, {w3:v}.16b, {x0:v}.4b[3]",
                "sdot {t0:v}.4s, {w4:v}.16b, {x1:v}.4b[0]",
                "sdot {t1:v}.4s, {w5:v}.16b, {x1:v}.4b[1]",
                "sdot {t2:v}.4s, {w6:v}.16b, {x1:v}.4b[2]",
                "sdot {t3:v}.4s, {w7:v}.16b, {x1:v}.4b[3]",
                t0 = inout(vreg) t0,
                t1 = inout(vreg) t1,
                t2 = inout(vreg) t2,
                t3 = inout(vreg) t3,
                w0 = in(vreg) w[0],
                w1 = in(vreg) w[1],
                w2 = in(vreg) w[2],
                w3 = in(vreg) w[3],
                w4 = in(vreg) w[4],
                w5 = in(vreg) w[5],
                w6 = in(vreg) w[6],
                w7 = in(vreg) w[7],
                x0 = in(vreg) x0,
                x1 = in(vreg) x1,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        vaddq_s32(vaddq_s32(t0, t1), vaddq_s32(t2, t3))
    }

    /// The same exact block dot products with baseline NEON: each activation group broadcast
    /// to all 4 features, `smull` / `smlal` of two groups into `i16` (at most
    /// `2 · 128 · 127 = 32512`, no overflow), `sadalp` into two `i32` lanes per feature (low
    /// halves: features 0 and 1, high halves: 2 and 3), and one `addp` to a lane per feature.
    #[inline]
    #[target_feature(enable = "neon")]
    fn dot_neon(w: &[int8x16_t; 8], x0: int8x16_t, x1: int8x16_t) -> int32x4_t {
        let (x0, x1) = (vreinterpretq_s32_s8(x0), vreinterpretq_s32_s8(x1));
        let xg = [
            vdupq_laneq_s32::<0>(x0),
            vdupq_laneq_s32::<1>(x0),
            vdupq_laneq_s32::<2>(x0),
            vdupq_laneq_s32::<3>(x0),
            vdupq_laneq_s32::<0>(x1),
            vdupq_laneq_s32::<1>(x1),
            vdupq_laneq_s32::<2>(x1),
            vdupq_laneq_s32::<3>(x1),
        ]
        .map(|v| vreinterpretq_s8_s32(v));
        let (mut lo, mut hi) = (vdupq_n_s32(0), vdupq_n_s32(0));
        for (wp, xp) in w.chunks_exact(2).zip(xg.chunks_exact(2)) {
            let pl = vmlal_s8(
                vmull_s8(vget_low_s8(wp[0]), vget_low_s8(xp[0])),
                vget_low_s8(wp[1]),
                vget_low_s8(xp[1]),
            );
            let ph = vmlal_high_s8(vmull_high_s8(wp[0], xp[0]), wp[1], xp[1]);
            lo = vpadalq_s16(lo, pl);
            hi = vpadalq_s16(hi, ph);
        }
        vpaddq_s32(lo, hi)
    }

    /// Dot-product tile kernel (see the module docs): per block, the 16 features as 4 quads;
    /// each quad's weights are loaded and un-offset once and used for every row. Callers must
    /// check that the CPU has NEON and FEAT_DotProd.
    #[target_feature(enable = "neon,dotprod")]
    pub(super) fn tile_dotprod(m: &Q8Matrix, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        let nb = m.nb;
        for b in 0..nb {
            let wb = &m.qs[(t * nb + b) * TB..][..TB];
            let sws = &m.scales[(t * nb + b) * TILE..][..TILE];
            for q in 0..TILE / QUAD {
                let w = quad_weights(wb, q);
                let sw = quad_scales(sws, q);
                for (r, a) in acc.iter_mut().enumerate() {
                    let i = r * nb + b;
                    let (x0, x1) = act_block(x, i);
                    accumulate4(&mut a[q * QUAD..], dot_sdot(&w, x0, x1), sw, x.scales[i]);
                }
            }
        }
    }

    /// Baseline NEON tile kernel: the loops of [`tile_dotprod`] with [`dot_neon`]. Callers
    /// must check that the CPU has NEON (every aarch64 CPU does).
    #[target_feature(enable = "neon")]
    pub(super) fn tile_neon(m: &Q8Matrix, t: usize, x: &Q8Act, acc: &mut [[f32; TILE]]) {
        let nb = m.nb;
        for b in 0..nb {
            let wb = &m.qs[(t * nb + b) * TB..][..TB];
            let sws = &m.scales[(t * nb + b) * TILE..][..TILE];
            for q in 0..TILE / QUAD {
                let w = quad_weights(wb, q);
                let sw = quad_scales(sws, q);
                for (r, a) in acc.iter_mut().enumerate() {
                    let i = r * nb + b;
                    let (x0, x1) = act_block(x, i);
                    accumulate4(&mut a[q * QUAD..], dot_neon(&w, x0, x1), sw, x.scales[i]);
                }
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
    fn activation_quantiser_paths_agree() {
        let mut s = 11;
        for cols in [32, 45, 96, 160, 576] {
            let mut x: Vec<f32> = (0..3 * cols).map(|_| lcg(&mut s) * 4.0).collect();
            x[..cols.min(40)].iter_mut().for_each(|v| *v = 0.0);
            x[cols + 3] = 1e-30;
            x[2 * cols + 1] = -0.5;
            let nb = cols.div_ceil(BLOCK);
            let run = |f: &dyn Fn(ActBufs<'_>)| {
                let (mut q, mut sc, mut c) = (
                    vec![0i8; 3 * nb * BLOCK],
                    vec![0f32; 3 * nb],
                    vec![0i32; 3 * nb],
                );
                f(ActBufs {
                    q: &mut q,
                    scales: &mut sc,
                    corr: &mut c,
                });
                (q, sc.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), c)
            };
            let want = run(&|o| quantize_rows_generic(&x, cols, nb, o));
            assert_eq!(
                want,
                run(&|o| quantize_rows(&x, cols, nb, o)),
                "cols {cols}"
            );
        }
    }

    /// Every available kernel path, with 1 and 2 threads, gives the bits of the scalar path:
    /// random weights and activations (row and column counts that need padding), and extreme
    /// quants (imported Q8_0 weights of -128 and 127, whole blocks of -128, activations ±127).
    #[test]
    fn every_kernel_path_matches_scalar_bit_for_bit() {
        let paths = KernelPath::available();
        println!(
            "kernel paths on this CPU: {paths:?} (detected: {:?})",
            KernelPath::detect()
        );
        let mut s = 3;
        let mut mats = Vec::new();
        for (rows, cols) in [(16, 32), (13, 96), (40, 200), (3, 45)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
            mats.push(Q8Matrix::quantize(rows, cols, &w).unwrap());
        }
        let (rows, cols) = (20, 64);
        let mut bytes = Vec::new();
        for idx in 0..rows * cols / BLOCK {
            let j = idx / (cols / BLOCK);
            bytes.extend_from_slice(&[0x00, 0x3c]); // scale 1.0
            bytes.extend((0..32).map(|i| {
                if j.is_multiple_of(4) || (i + idx).is_multiple_of(3) {
                    0x80u8
                } else {
                    0x7f
                }
            }));
        }
        mats.push(Q8Matrix::from_ggml_q8_0(rows, cols, &bytes).unwrap());
        for m in &mats {
            let cols = m.cols();
            for n in [1, 2, 3, 5, 9, 12, 13, 17] {
                let mut x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 3.0).collect();
                if n == 3 {
                    // Rows of +1, of -1 and mixed: quants ±127.
                    for (i, v) in x.iter_mut().enumerate() {
                        *v = match i / cols {
                            0 => 1.0,
                            1 => -1.0,
                            _ if i.is_multiple_of(5) => -1.0,
                            _ => 1.0,
                        };
                    }
                }
                let mut act = Q8Act::default();
                act.quantize(&x, cols).unwrap();
                let mut want = Vec::new();
                m.matmul(&act, &mut want, KernelPath::Scalar, 1).unwrap();
                for &p in &paths {
                    for threads in [1, 2] {
                        let mut got = Vec::new();
                        m.matmul(&act, &mut got, p, threads).unwrap();
                        let same = got.len() == want.len()
                            && got
                                .iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{p:?}, {threads} threads, {m:?}, n = {n}");
                    }
                }
            }
        }
    }

    #[test]
    fn unavailable_paths_are_refused() {
        let m = Q8Matrix::quantize(2, 32, &[0.5; 64]).unwrap();
        let mut act = Q8Act::default();
        act.quantize(&[1.0; 32], 32).unwrap();
        let all = [
            KernelPath::Scalar,
            KernelPath::Avx2,
            KernelPath::Avx512Vnni,
            KernelPath::Neon,
            KernelPath::NeonDotprod,
        ];
        for p in all {
            let r = m.matmul(&act, &mut Vec::new(), p, 1);
            assert_eq!(r.is_ok(), p.is_available(), "{p:?}");
        }
        assert!(KernelPath::detect().is_available());
    }

    /// On aarch64 the NEON path is always available, and the dot-product path exactly when
    /// the CPU reports FEAT_DotProd (under qemu-user: `-cpu max` has it, `-cpu cortex-a53`
    /// does not).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_paths_are_detected_on_aarch64() {
        let dotprod = std::arch::is_aarch64_feature_detected!("dotprod");
        let paths = KernelPath::available();
        println!(
            "aarch64: dotprod {dotprod}, kernel paths {paths:?}, detected {:?}",
            KernelPath::detect()
        );
        assert!(paths.contains(&KernelPath::Neon));
        assert_eq!(paths.contains(&KernelPath::NeonDotprod), dotprod);
        assert!(!paths.contains(&KernelPath::Avx2) && !paths.contains(&KernelPath::Avx512Vnni));
        let best = if dotprod {
            KernelPath::NeonDotprod
        } else {
            KernelPath::Neon
        };
        assert_eq!(KernelPath::detect(), best);
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
