//! Criterion benches of the fast int8 matmul (one gate+up-sized matrix, `[3072, 576]`, about
//! the size of one SmolLM2-135M MLP input projection) for n = 1, 9, 17 rows, every available
//! kernel path, one thread, beside the f32 path.
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo bench -p speculative-candle --bench fast_matmul
//! ```

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use speculative_candle::fast::{F32Matrix, KernelPath, Q8Act, Q8Matrix};

fn data(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn matmul(c: &mut Criterion) {
    let (rows, cols) = (3072, 576);
    let w = data(rows * cols, 1);
    let q = Q8Matrix::quantize(rows, cols, &w).expect("quantize");
    let f = F32Matrix::new(rows, cols, &w).expect("f32 matrix");
    let mut g = c.benchmark_group("matmul_3072x576");
    g.sample_size(20);
    g.measurement_time(std::time::Duration::from_secs(2));
    for n in [1usize, 9, 17] {
        let x = data(n * cols, 2);
        let mut act = Q8Act::default();
        act.quantize(&x, cols).expect("quantize activations");
        let mut out = Vec::new();
        for p in KernelPath::available() {
            g.bench_with_input(BenchmarkId::new(format!("q8_{p:?}"), n), &n, |b, _| {
                b.iter(|| q.matmul(&act, &mut out, p, 1).expect("matmul"))
            });
        }
        g.bench_with_input(BenchmarkId::new("q8_quantize_act", n), &n, |b, _| {
            b.iter(|| act.quantize(&x, cols).expect("quantize"))
        });
        g.bench_with_input(BenchmarkId::new("f32", n), &n, |b, _| {
            b.iter(|| f.matmul(&x, &mut out, 1).expect("matmul"))
        });
    }
    g.finish();
    // A matrix that stays in L2 (`[512, 576]`, 330 KB): the arithmetic alone.
    let (rows, cols) = (512, 576);
    let q = Q8Matrix::quantize(rows, cols, &data(rows * cols, 3)).expect("quantize");
    let mut g = c.benchmark_group("matmul_in_cache_512x576");
    g.sample_size(30);
    g.measurement_time(std::time::Duration::from_secs(1));
    g.warm_up_time(std::time::Duration::from_millis(300));
    for n in [1usize, 2, 5, 9, 17] {
        let mut act = Q8Act::default();
        act.quantize(&data(n * cols, 4), cols)
            .expect("quantize activations");
        let mut out = Vec::new();
        let p = KernelPath::detect();
        g.bench_with_input(BenchmarkId::new(format!("q8_{p:?}"), n), &n, |b, _| {
            b.iter(|| q.matmul(&act, &mut out, p, 1).expect("matmul"))
        });
    }
    g.finish();
}

criterion_group!(benches, matmul);
criterion_main!(benches);
