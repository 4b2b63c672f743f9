//! The CUDA backend: `kernels/verify.cu` compiled by NVRTC at run time, launched through cudarc.
//! The driver and NVRTC libraries are loaded dynamically, so the crate builds and its tests run
//! on machines without CUDA (they report [`crate::Error::BackendUnavailable`]).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg,
};

use super::pack::{self, Packed};
use super::{Backend, DeviceBatch, unavailable};
use crate::error::{Error, Result};
use crate::verify::StepOutput;

pub(crate) const COMPILED: bool = true;

fn err(reason: impl Into<String>) -> Error {
    unavailable(Backend::Cuda, reason)
}

/// An engine's CUDA stream (and through it, its context), for
/// [`super::GpuVerifier::with_cuda`]. Verification is enqueued on this stream, so it is ordered
/// after the engine's work that wrote the logits on the same stream.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    stream: Arc<CudaStream>,
}

impl CudaDevice {
    /// Verification runs on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Self {
        CudaDevice { stream }
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// Target logits in CUDA device memory: `[sum_b (k_b + 1), vocab]` f32.
#[derive(Debug, Clone, Copy)]
pub struct CudaLogits<'a> {
    ptr: u64,
    len: usize,
    _mem: PhantomData<&'a ()>,
}

impl<'a> CudaLogits<'a> {
    /// The logits held by `slice`, which must belong to the verifier's context; reads are
    /// ordered on the verifier's stream.
    pub fn from_slice(slice: &'a CudaSlice<f32>, stream: &CudaStream) -> Self {
        let (ptr, _sync) = slice.device_ptr(stream);
        CudaLogits {
            ptr,
            len: slice.len(),
            _mem: PhantomData,
        }
    }

    /// Logits at a raw device pointer (`CUdeviceptr`) of `len` f32 elements.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable f32 values in the verifier's context, alive and not
    /// written until the verify call returns (it synchronises its stream before returning).
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        CudaLogits {
            ptr,
            len,
            _mem: PhantomData,
        }
    }

    /// Number of f32 elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when there is no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Compiles the CUDA kernel source to PTX with NVRTC.
pub(crate) fn compile_ptx() -> Result<String> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(err("NVRTC library (libnvrtc) not found"));
    }
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        super::CUDA_SOURCE,
        cudarc::nvrtc::CompileOptions {
            fmad: Some(false),
            ..Default::default()
        },
    )
    .map_err(|e| err(format!("the CUDA kernel does not compile: {e}")))?;
    Ok(ptx.to_src())
}

pub(crate) struct CudaVerifier {
    dev: CudaDevice,
    stream: Arc<CudaStream>,
    func: CudaFunction,
    read_func: CudaFunction,
    name: String,
    globals: Option<CudaSlice<u32>>,
    d_globals: Option<CudaSlice<u32>>,
    d_params: Option<CudaSlice<u32>>,
    d_scratch: Option<CudaSlice<u32>>,
    d_out: Option<CudaSlice<u32>>,
    params: Option<CudaSlice<u32>>,
    q: Option<CudaSlice<f32>>,
    logits: Option<CudaSlice<f32>>,
    scratch: Option<CudaSlice<f32>>,
    out: Option<CudaSlice<u32>>,
}

fn upload<T: DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    data: &[T],
) -> Result<()> {
    reserve(stream, slot, data.len())?;
    let s = slot.as_mut().expect("allocated");
    let mut view = s.slice_mut(0..data.len());
    stream
        .memcpy_htod(data, &mut view)
        .map_err(|e| err(format!("upload failed: {e}")))
}

fn reserve<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<()> {
    let len = len.max(1);
    if slot.as_ref().is_some_and(|s| s.len() >= len) {
        return Ok(());
    }
    *slot = None;
    // SAFETY: every element the kernel reads is written first (uploads) or by the kernel.
    let s = unsafe { stream.alloc::<T>(len) }.map_err(|e| err(format!("alloc failed: {e}")))?;
    *slot = Some(s);
    Ok(())
}

impl CudaVerifier {
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(err("CUDA driver library (libcuda) not found"));
        }
        let ctx = CudaContext::new(0).map_err(|e| err(format!("no CUDA device 0: {e}")))?;
        Self::from_device(CudaDevice::new(ctx.default_stream()))
    }

    pub(crate) fn from_device(dev: CudaDevice) -> Result<Self> {
        let ptx = compile_ptx()?;
        let ctx = dev.stream.context().clone();
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| err(format!("cannot load the kernel: {e}")))?;
        let func = module
            .load_function("verify_rows")
            .map_err(|e| err(format!("kernel entry point missing: {e}")))?;
        let read_func = module
            .load_function("read_logits")
            .map_err(|e| err(format!("kernel entry point missing: {e}")))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        Ok(CudaVerifier {
            stream: dev.stream.clone(),
            dev,
            func,
            read_func,
            name,
            globals: None,
            d_globals: None,
            d_params: None,
            d_scratch: None,
            d_out: None,
            params: None,
            q: None,
            logits: None,
            scratch: None,
            out: None,
        })
    }

    pub(crate) fn device_name(&self) -> String {
        self.name.clone()
    }

    pub(crate) fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// One read of `n` logits (the benchmark baseline); returns their sum.
    pub(crate) fn read(&mut self, logits: CudaLogits<'_>, n: usize) -> Result<f32> {
        if n > logits.len() {
            return Err(Error::ShapeMismatch {
                what: "logits",
                expected: n,
                actual: logits.len(),
            });
        }
        let groups = n.div_ceil(256).clamp(1, 4096);
        let st = self.stream.clone();
        reserve(&st, &mut self.q, groups)?;
        let out = self.q.as_mut().expect("allocated");
        let n64 = n as u64;
        let cfg = LaunchConfig {
            grid_dim: (groups as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(&self.read_func);
        b.arg(&logits.ptr).arg(&n64).arg(&mut *out);
        // SAFETY: `read_logits(const float*, unsigned long long, float*)`, `groups` outputs.
        unsafe { b.launch(cfg) }.map_err(|e| err(format!("kernel launch failed: {e}")))?;
        let host: Vec<f32> = st
            .clone_dtoh(&out.slice(0..groups))
            .map_err(|e| err(format!("readback failed: {e}")))?;
        st.synchronize()
            .map_err(|e| err(format!("stream synchronize failed: {e}")))?;
        Ok(host.iter().sum())
    }

    pub(crate) fn verify_host(
        &mut self,
        logits: &[f32],
        batch: &DeviceBatch<'_>,
        qv: usize,
    ) -> Result<Vec<Result<StepOutput>>> {
        upload(&self.stream, &mut self.logits, logits)?;
        let ptr = {
            let s = self.logits.as_ref().expect("allocated");
            let (p, _sync) = s.device_ptr(&self.stream);
            p
        };
        self.run(ptr, batch, qv, Some(logits))
    }

    pub(crate) fn verify_device(
        &mut self,
        logits: CudaLogits<'_>,
        batch: &DeviceBatch<'_>,
        qv: usize,
    ) -> Result<Vec<Result<StepOutput>>> {
        self.run(logits.ptr, batch, qv, None)
    }

    fn run(
        &mut self,
        logits: u64,
        batch: &DeviceBatch<'_>,
        qv: usize,
        host: Option<&[f32]>,
    ) -> Result<Vec<Result<StepOutput>>> {
        // DraftProbs::Logits: a draft pass (`d`) turns the draft-logit rows into dense q first.
        let pack::Prepared {
            pre,
            main: mut p,
            draft: mut d,
            q,
        } = pack::prepare(batch, qv, host)?;
        if p.n_rows == 0 {
            return Ok(pack::assemble(p, pre, batch, &[], Vec::new()));
        }
        let st = self.stream.clone();
        upload(&st, &mut self.q, q)?;
        let q_ptr = {
            let (ptr, _sync) = self.q.as_ref().expect("allocated").device_ptr(&st);
            ptr
        };
        let mut q_main = q_ptr;
        if let Some(d) = d.as_mut() {
            upload(&st, &mut self.d_params, &d.params)?;
            reserve(&st, &mut self.d_scratch, d.scratch_rows * qv)?;
            reserve(&st, &mut self.d_out, d.out_words())?;
            let (dp, ds, dout) = (
                self.d_params.as_ref().expect("allocated"),
                self.d_scratch.as_ref().expect("allocated"),
                self.d_out.as_ref().expect("allocated"),
            );
            let ptrs = [dp, ds, dout].map(|b| b.device_ptr(&st).0);
            // The draft logits (uploaded to `q`) are the `logits` of the draft pass.
            self.launch(&st, d, true, q_ptr, q_ptr, ptrs)?;
            p.globals[14] = (d.n_rows * pack::OUT_WORDS) as u32;
            q_main = ptrs[2];
        }
        upload(&st, &mut self.params, &p.params)?;
        reserve(&st, &mut self.scratch, p.scratch_rows * batch.vocab_size)?;
        reserve(&st, &mut self.out, p.out_words())?;
        let ptrs = [
            self.params.as_ref().expect("allocated").device_ptr(&st).0,
            self.scratch.as_ref().expect("allocated").device_ptr(&st).0,
            self.out.as_ref().expect("allocated").device_ptr(&st).0,
        ];
        self.launch(&st, &mut p, false, logits, q_main, ptrs)?;
        let out = self.out.as_ref().expect("allocated");
        let out_host: Vec<u32> = st
            .clone_dtoh(&out.slice(0..p.out_words()))
            .map_err(|e| err(format!("readback failed: {e}")))?;
        let errs = match d.as_ref() {
            Some(d) => {
                let dout = self.d_out.as_ref().expect("allocated");
                let stat: Vec<u32> = st
                    .clone_dtoh(&dout.slice(0..d.n_rows * pack::OUT_WORDS))
                    .map_err(|e| err(format!("readback failed: {e}")))?;
                pack::draft_errors(d, &stat)
            }
            None => Default::default(),
        };
        st.synchronize()
            .map_err(|e| err(format!("stream synchronize failed: {e}")))?;
        Ok(pack::assemble(p, pre, batch, &out_host, errs))
    }

    /// Launches the verification kernel (verify or draft pass); `bufs` are the device pointers
    /// of params, scratch and out.
    fn launch(
        &mut self,
        st: &Arc<CudaStream>,
        p: &mut Packed,
        draft: bool,
        logits: u64,
        q: u64,
        bufs: [u64; 3],
    ) -> Result<()> {
        let rows = p.n_rows as u32;
        let (gx, gy) = if rows <= 65_535 {
            (rows, 1)
        } else {
            (65_535, rows.div_ceil(65_535))
        };
        p.globals[12] = gx;
        let slot = if draft {
            &mut self.d_globals
        } else {
            &mut self.globals
        };
        upload(st, slot, &p.globals)?;
        let g = slot.as_ref().expect("allocated").device_ptr(st).0;
        let cfg = LaunchConfig {
            grid_dim: (gx, gy, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(&self.func);
        b.arg(&g)
            .arg(&logits)
            .arg(&q)
            .arg(&bufs[0])
            .arg(&bufs[1])
            .arg(&bufs[2]);
        // SAFETY: the argument list matches `verify_rows` in kernels/verify.cu (six pointers);
        // every buffer is at least as long as the indices the packed parameters produce.
        unsafe { b.launch(cfg) }.map_err(|e| err(format!("kernel launch failed: {e}")))?;
        Ok(())
    }
}
