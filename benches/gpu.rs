//! GPU verification cost as a ratio to one read of the logits on the same device.
//!
//! For each backend that is available (`SPECULATIVE_BENCH_BACKENDS`, default `wgpu,cuda`) and each
//! configuration of the grid (batch 1, 16, 64, 256; k = 4, 8; vocab 49,152 and 151,936; greedy and
//! stochastic with temperature 0.8 and top-p 0.9), the logits `[batch * (k + 1), vocab]` are
//! placed in device memory once; criterion then times
//! - `read`: the read-once reduction kernel over the same logits (`GpuVerifier::read_*`), and
//! - `verify`: `GpuVerifier::verify_*` on the device-resident logits (parameter upload, kernel,
//!   readback of the small results, assembly of the outputs on the host).
//!
//! At the end a table of medians and the ratio verify / read is printed and written to
//! `$OUT/gpu-bench.md` (or `target/gpu-bench.md`). On a software driver (lavapipe) only batch 1
//! and 16, k = 4, vocab 49,152 run (`SPECULATIVE_BENCH_FULL=1` forces the whole grid): those
//! figures are functional only.
//!
//! `cargo bench -p speculative --features wgpu --bench gpu` (add `cuda` for the CUDA backend).

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use speculative::gpu::{Backend, DeviceBatch, GpuVerifier};
use speculative::{DraftProbs, SamplingConfig, SequenceParams};

struct Case {
    batch: usize,
    k: usize,
    vocab: usize,
    greedy: bool,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "b{}_k{}_v{}_{}",
            self.batch,
            self.k,
            self.vocab,
            if self.greedy { "greedy" } else { "topp" }
        )
    }
}

fn grid(full: bool) -> Vec<Case> {
    let (batches, ks, vocabs): (&[usize], &[usize], &[usize]) = if full {
        (&[1, 16, 64, 256], &[4, 8], &[49_152, 151_936])
    } else {
        (&[1, 16], &[4], &[49_152])
    };
    let mut v = Vec::new();
    for &vocab in vocabs {
        for &k in ks {
            for &batch in batches {
                for greedy in [true, false] {
                    v.push(Case {
                        batch,
                        k,
                        vocab,
                        greedy,
                    });
                }
            }
        }
    }
    v
}

fn logits(n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (h & 0xffff) as f32 / 4096.0 - 8.0
        })
        .collect()
}

/// Device-resident logits of one backend: the two timed operations.
trait Resident {
    fn read(&mut self, n: usize) -> f32;
    fn verify(&mut self, batch: &DeviceBatch<'_>) -> usize;
}

struct WgpuRes {
    gpu: GpuVerifier,
    buf: speculative::gpu::wgpu::Buffer,
}

impl WgpuRes {
    fn new(mut gpu: GpuVerifier, data: &[f32]) -> Self {
        use speculative::gpu::wgpu;
        use speculative::gpu::wgpu::util::DeviceExt;
        let dev = gpu.wgpu_device().expect("wgpu").clone();
        // SAFETY: f32 slice viewed as bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, data.len() * 4) };
        let buf = dev
            .device()
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("bench logits"),
                contents: bytes,
                usage: wgpu::BufferUsages::STORAGE,
            });
        let _ = gpu.read_wgpu(speculative::gpu::WgpuLogits::new(&buf), 1);
        WgpuRes { gpu, buf }
    }
}

impl Resident for WgpuRes {
    fn read(&mut self, n: usize) -> f32 {
        self.gpu
            .read_wgpu(speculative::gpu::WgpuLogits::new(&self.buf), n)
            .unwrap()
    }
    fn verify(&mut self, batch: &DeviceBatch<'_>) -> usize {
        let out = self
            .gpu
            .verify_wgpu(speculative::gpu::WgpuLogits::new(&self.buf), batch)
            .unwrap();
        out.iter().map(|r| r.as_ref().unwrap().tokens.len()).sum()
    }
}

#[cfg(feature = "cuda")]
mod cuda_res {
    use super::*;
    use speculative::gpu::CudaLogits;
    use speculative::gpu::cudarc::driver::CudaSlice;

    pub struct CudaRes {
        pub gpu: GpuVerifier,
        pub buf: CudaSlice<f32>,
    }

    impl CudaRes {
        pub fn new(gpu: GpuVerifier, data: &[f32]) -> Self {
            let stream = gpu.cuda_device().expect("cuda").stream().clone();
            let buf = stream.clone_htod(data).unwrap();
            CudaRes { gpu, buf }
        }
    }

    impl Resident for CudaRes {
        fn read(&mut self, n: usize) -> f32 {
            let st = self.gpu.cuda_device().unwrap().stream().clone();
            self.gpu
                .read_cuda(CudaLogits::from_slice(&self.buf, &st), n)
                .unwrap()
        }
        fn verify(&mut self, batch: &DeviceBatch<'_>) -> usize {
            let st = self.gpu.cuda_device().unwrap().stream().clone();
            let out = self
                .gpu
                .verify_cuda(CudaLogits::from_slice(&self.buf, &st), batch)
                .unwrap();
            out.iter().map(|r| r.as_ref().unwrap().tokens.len()).sum()
        }
    }
}

fn resident(backend: Backend, gpu: GpuVerifier, data: &[f32]) -> Box<dyn Resident> {
    match backend {
        #[cfg(feature = "cuda")]
        Backend::Cuda => Box::new(cuda_res::CudaRes::new(gpu, data)),
        _ => Box::new(WgpuRes::new(gpu, data)),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn bench(c: &mut Criterion) {
    let wanted = std::env::var("SPECULATIVE_BENCH_BACKENDS").unwrap_or("wgpu,cuda".into());
    let mut table = String::from(
        "| backend | device | batch | k | vocab | mode | read ms | verify ms | verify / read |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for (name, backend) in [("wgpu", Backend::Wgpu), ("cuda", Backend::Cuda)] {
        if !wanted.split(',').any(|w| w.trim() == name) {
            continue;
        }
        let device = match GpuVerifier::new(backend) {
            Ok(g) => g.device_name(),
            Err(e) => {
                eprintln!("skipped {name}: {e}");
                continue;
            }
        };
        let software = device.contains("llvmpipe") || device.contains("lavapipe");
        let full = !software || std::env::var("SPECULATIVE_BENCH_FULL").is_ok_and(|v| v == "1");
        eprintln!("{name}: {device} (full grid: {full})");
        let greedy_cfg = SamplingConfig::greedy();
        let topp_cfg = SamplingConfig::builder()
            .temperature(0.8)
            .top_p(0.9)
            .build()
            .unwrap();
        let cases = grid(full);
        // One device buffer per (batch, k, vocab), shared by the greedy and top-p cases.
        let mut last_shape = (0, 0, 0);
        let mut res: Option<Box<dyn Resident>> = None;
        let mut group = c.benchmark_group(format!("gpu_{name}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
        for case in &cases {
            let rows = case.batch * (case.k + 1);
            let n = rows * case.vocab;
            if (case.batch, case.k, case.vocab) != last_shape {
                drop(res.take());
                let gpu = GpuVerifier::new(backend).unwrap();
                res = Some(resident(backend, gpu, &logits(n)));
                last_shape = (case.batch, case.k, case.vocab);
            }
            let r = res.as_mut().unwrap();
            let drafts: Vec<u32> = (0..case.batch * case.k)
                .map(|i| (i * 7919 % case.vocab) as u32)
                .collect();
            let offsets: Vec<usize> = (0..=case.batch).map(|b| b * case.k).collect();
            let cfg = if case.greedy { &greedy_cfg } else { &topp_cfg };
            let seqs: Vec<SequenceParams<'_>> = (0..case.batch)
                .map(|b| SequenceParams::new(cfg, b as u64).position(100))
                .collect();
            let batch = DeviceBatch {
                vocab_size: case.vocab,
                draft_tokens: &drafts,
                draft_offsets: &offsets,
                draft_probs: DraftProbs::PointMass,
                sequences: &seqs,
                parents: None,
                schemes: None,
                ends: &[],
            };
            group.bench_function(format!("{}/read", case.name()), |b| b.iter(|| r.read(n)));
            group.bench_function(format!("{}/verify", case.name()), |b| {
                b.iter(|| r.verify(&batch))
            });
            // Medians measured back to back for the ratio.
            let reps = if software { 3 } else { 15 };
            let (mut tr, mut tv) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                let t = Instant::now();
                std::hint::black_box(r.read(n));
                tr.push(t.elapsed());
                let t = Instant::now();
                std::hint::black_box(r.verify(&batch));
                tv.push(t.elapsed());
            }
            let (mr, mv) = (median(tr), median(tv));
            table.push_str(&format!(
                "| {name} | {device} | {} | {} | {} | {} | {:.3} | {:.3} | {:.2} |\n",
                case.batch,
                case.k,
                case.vocab,
                if case.greedy {
                    "greedy"
                } else {
                    "top-p 0.9, T 0.8"
                },
                mr.as_secs_f64() * 1e3,
                mv.as_secs_f64() * 1e3,
                mv.as_secs_f64() / mr.as_secs_f64()
            ));
        }
        group.finish();
    }
    println!("\n{table}");
    let dir = std::env::var("OUT").unwrap_or_else(|_| "target".into());
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(format!("{dir}/gpu-bench.md"), &table);
}

criterion_group!(benches, bench);
criterion_main!(benches);
