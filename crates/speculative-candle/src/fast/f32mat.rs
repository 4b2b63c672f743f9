//! The exact path: f32 weights and a multi-row, batch-invariant f32 matmul.
//!
//! [`F32Matrix::matmul`] computes `out[r, j] = Σ_k x[r, k] · W[j, k]` with one running sum per
//! output value, `k` in increasing order from `0.0`, each step `acc = acc + x · w` (a rounded
//! multiply then a rounded add, no fused multiply-add). Output features are grouped in tiles of
//! 8 stored transposed (`[tile][k][8]`), so the compiler vectorises across the 8 features of a
//! tile (element-wise, which does not change any value) and each tile's weights are read once
//! for all rows. The value of one row never depends on the other rows or on `n`.

use crate::error::{CandleError, Result};

const TILE: usize = 8;

/// The output pointer shared by the two threads of a matmul (disjoint columns each).
struct OutPtr(*mut f32);

// SAFETY: the two threads write disjoint elements through it (see `F32Matrix::matmul`).
unsafe impl Sync for OutPtr {}

/// A `[rows, cols]` f32 weight matrix (see the module docs).
#[derive(Clone)]
pub struct F32Matrix {
    rows: usize,
    cols: usize,
    tiles: usize,
    /// `[tiles][cols][TILE]`, zero-padded rows.
    w: Vec<f32>,
}

impl std::fmt::Debug for F32Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("F32Matrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl F32Matrix {
    /// Builds the matrix from row-major `[rows, cols]` values (kept exactly).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `data.len() != rows * cols` or a size is 0.
    pub fn new(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        if rows == 0 || cols == 0 || data.len() != rows * cols {
            return Err(CandleError::InvalidArgument(format!(
                "matrix [{rows}, {cols}] needs {} values, got {}",
                rows * cols,
                data.len()
            )));
        }
        let tiles = rows.div_ceil(TILE);
        let mut w = vec![0f32; tiles * cols * TILE];
        for j in 0..rows {
            let (t, f) = (j / TILE, j % TILE);
            for k in 0..cols {
                w[(t * cols + k) * TILE + f] = data[j * cols + k];
            }
        }
        Ok(F32Matrix {
            rows,
            cols,
            tiles,
            w,
        })
    }

    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weights held in memory (padding included).
    pub fn memory_bytes(&self) -> usize {
        4 * self.w.len()
    }

    /// Writes row `j` (`cols` values) into `out`.
    ///
    /// # Panics
    /// When `j >= rows` or `out.len() != cols`.
    pub fn row(&self, j: usize, out: &mut [f32]) {
        assert!(
            j < self.rows && out.len() == self.cols,
            "row or length out of range"
        );
        let (t, f) = (j / TILE, j % TILE);
        for (k, v) in out.iter_mut().enumerate() {
            *v = self.w[(t * self.cols + k) * TILE + f];
        }
    }

    /// `out[r, j] = Σ_k x[r, k] · W[j, k]` for the `[n, cols]` row-major `x`; `out` is resized to
    /// `[n, rows]`. `threads >= 2` splits the tiles with one persistent helper thread (same
    /// values; more than 2 counts as 2).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `x.len()` is not a multiple of `cols`.
    pub fn matmul(&self, x: &[f32], out: &mut Vec<f32>, threads: usize) -> Result<()> {
        if !x.len().is_multiple_of(self.cols) {
            return Err(CandleError::InvalidArgument(format!(
                "{} activations do not form rows of {}",
                x.len(),
                self.cols
            )));
        }
        let n = x.len() / self.cols;
        out.clear();
        out.resize(n * self.rows, 0.0);
        if n == 0 {
            return Ok(());
        }
        let threads = threads.clamp(1, self.tiles);
        if threads == 1 {
            let mut acc = vec![[0f32; TILE]; n];
            for t in 0..self.tiles {
                self.tile(t, x, &mut acc);
                let j0 = t * TILE;
                let w = TILE.min(self.rows - j0);
                for (r, a) in acc.iter().enumerate() {
                    out[r * self.rows + j0..r * self.rows + j0 + w].copy_from_slice(&a[..w]);
                }
            }
            return Ok(());
        }
        // Two threads (the persistent helper of `super::pool`), halves of the tiles claimed
        // by an atomic counter; same code per tile, so the same values.
        let next = std::sync::atomic::AtomicUsize::new(0);
        let chunk = self.tiles.div_ceil(2);
        let dst = OutPtr(out.as_mut_ptr());
        let job = |_part: usize| {
            let dst = &dst;
            let mut acc = vec![[0f32; TILE]; n];
            loop {
                let t0 = next.fetch_add(chunk, std::sync::atomic::Ordering::Relaxed);
                if t0 >= self.tiles {
                    break;
                }
                for t in t0..(t0 + chunk).min(self.tiles) {
                    self.tile(t, x, &mut acc);
                    let j0 = t * TILE;
                    let w = TILE.min(self.rows - j0);
                    for (r, a) in acc.iter().enumerate() {
                        // SAFETY: `out` holds `n * rows` values and outlives `run2`; tile `t`
                        // writes only its own columns and each tile is taken once.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                a.as_ptr(),
                                dst.0.add(r * self.rows + j0),
                                w,
                            )
                        };
                    }
                }
            }
        };
        super::pool::run2(&job);
        Ok(())
    }

    fn tile(&self, t: usize, x: &[f32], acc: &mut [[f32; TILE]]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected at run time.
            unsafe { tile_avx2(self, t, x, acc) };
            return;
        }
        tile_generic(self, t, x, acc);
    }
}

/// The tile loop; compiled twice (plain and with AVX2 enabled). Only element-wise operations
/// across the 8 lanes, so both compilations give the same bits.
#[inline(always)]
fn tile_generic(m: &F32Matrix, t: usize, x: &[f32], acc: &mut [[f32; TILE]]) {
    let cols = m.cols;
    acc.iter_mut().for_each(|a| *a = [0.0; TILE]);
    let wt = &m.w[t * cols * TILE..(t + 1) * cols * TILE];
    for (k, wk) in wt.chunks_exact(TILE).enumerate() {
        let wk: &[f32; TILE] = wk.try_into().unwrap_or(&[0.0; TILE]);
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = x[r * cols + k];
            for f in 0..TILE {
                a[f] += xv * wk[f];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn tile_avx2(m: &F32Matrix, t: usize, x: &[f32], acc: &mut [[f32; TILE]]) {
    tile_generic(m, t, x, acc);
}
