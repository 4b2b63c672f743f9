//! The wgpu backend: the WGSL kernel of `kernels/verify.wgsl` on any wgpu device.

use super::pack::{self, Packed};
use super::{Backend, DeviceBatch, unavailable};
use crate::error::{Error, Result};
use crate::verify::StepOutput;

pub(crate) const COMPILED: bool = true;

/// An engine's wgpu device and queue, for [`super::GpuVerifier::with_wgpu`].
#[derive(Debug, Clone)]
pub struct WgpuDevice {
    device: wgpu::Device,
    queue: wgpu::Queue,
    name: String,
}

impl WgpuDevice {
    /// Wraps a device and its queue. Buffers passed to [`super::GpuVerifier::verify_wgpu`] must
    /// belong to this device and have `STORAGE` usage.
    pub fn new(device: wgpu::Device, queue: wgpu::Queue) -> Self {
        WgpuDevice {
            device,
            queue,
            name: "wgpu device".into(),
        }
    }

    /// The device.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }
}

/// Target logits in a wgpu buffer: `[sum_b (k_b + 1), vocab]` f32 starting at element `offset`.
#[derive(Debug, Clone, Copy)]
pub struct WgpuLogits<'a> {
    buffer: &'a wgpu::Buffer,
    offset: u64,
}

impl<'a> WgpuLogits<'a> {
    /// The logits start at the beginning of `buffer` (which needs `STORAGE` usage).
    pub fn new(buffer: &'a wgpu::Buffer) -> Self {
        WgpuLogits { buffer, offset: 0 }
    }

    /// The logits start at element `offset` (f32 elements, not bytes) of `buffer`.
    pub fn with_offset(buffer: &'a wgpu::Buffer, offset: u64) -> Self {
        WgpuLogits { buffer, offset }
    }

    /// Number of f32 elements from the offset to the end of the buffer.
    pub fn len(&self) -> usize {
        (self.buffer.size() / 4).saturating_sub(self.offset) as usize
    }

    /// `true` when no element follows the offset.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct Buf {
    buf: wgpu::Buffer,
    cap: u64,
}

pub(crate) struct WgpuVerifier {
    dev: WgpuDevice,
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    read_pipeline: wgpu::ComputePipeline,
    uniform: wgpu::Buffer,
    d_uniform: wgpu::Buffer,
    d_params: Option<Buf>,
    d_scratch: Option<Buf>,
    d_out: Option<Buf>,
    logits: Option<Buf>,
    q: Option<Buf>,
    params: Option<Buf>,
    scratch: Option<Buf>,
    out: Option<Buf>,
    readback: Option<Buf>,
}

fn err(reason: impl Into<String>) -> Error {
    unavailable(Backend::Wgpu, reason)
}

impl WgpuVerifier {
    pub(crate) fn new() -> Result<Self> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
            apply_limit_buckets: false,
        }))
        .map_err(|e| {
            err(format!(
                "no wgpu adapter found (Vulkan, Metal or DX12): {e}"
            ))
        })?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("speculative"),
            required_features: wgpu::Features::empty(),
            required_limits: limits,
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| err(format!("cannot open the wgpu device: {e}")))?;
        let mut dev = WgpuDevice::new(device, queue);
        dev.name = format!(
            "{} ({:?}, {} {})",
            info.name, info.backend, info.driver, info.driver_info
        );
        Self::from_device(dev)
    }

    /// The verifier on `dev`: compiles the kernels ([`verify_pipeline`], [`read_pipeline`];
    /// a validation error is reported, not panicked) and creates the two uniform buffers.
    pub(crate) fn from_device(dev: WgpuDevice) -> Result<Self> {
        let device = &dev.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let (layout, pipeline) = verify_pipeline(device);
        let read_pipeline = read_pipeline(device);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(err(format!("the WGSL kernel does not compile: {e}")));
        }
        let globals = |label| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: 64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let uniform = globals("speculative globals");
        let d_uniform = globals("speculative draft globals");
        Ok(WgpuVerifier {
            d_uniform,
            d_params: None,
            d_scratch: None,
            d_out: None,
            dev,
            pipeline,
            layout,
            read_pipeline,
            uniform,
            logits: None,
            q: None,
            params: None,
            scratch: None,
            out: None,
            readback: None,
        })
    }

    pub(crate) fn device_name(&self) -> String {
        self.dev.name.clone()
    }

    pub(crate) fn device(&self) -> &WgpuDevice {
        &self.dev
    }

    /// One read of `n` logits (the benchmark baseline); returns their sum.
    pub(crate) fn read(&mut self, logits: WgpuLogits<'_>, n: usize) -> Result<f32> {
        if n > logits.len() {
            return Err(Error::ShapeMismatch {
                what: "logits",
                expected: n,
                actual: logits.len(),
            });
        }
        let groups = (n.div_ceil(256)).clamp(1, 4096) as u32;
        let dev = &self.dev.device;
        let prm = [n as u32, logits.offset as u32, groups, 0u32];
        let ubuf = dev.create_buffer(&wgpu::BufferDescriptor {
            label: Some("speculative read params"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.dev.queue.write_buffer(&ubuf, 0, as_bytes(&prm));
        let bytes = groups as u64 * 4;
        ensure(
            dev,
            &mut self.out,
            bytes,
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            "out",
        );
        ensure(
            dev,
            &mut self.readback,
            bytes,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            "readback",
        );
        let obuf = &self.out.as_ref().expect("allocated").buf;
        let rbuf = &self.readback.as_ref().expect("allocated").buf;
        let bind = dev.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("speculative read"),
            layout: &self.read_pipeline.get_bind_group_layout(0),
            entries: &[entry(0, &ubuf), entry(1, logits.buffer), entry(2, obuf)],
        });
        let mut enc = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("speculative read"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&self.read_pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        }
        enc.copy_buffer_to_buffer(obuf, 0, rbuf, 0, bytes);
        self.dev.queue.submit([enc.finish()]);
        let out = readback(dev, rbuf, bytes)?;
        Ok(out.iter().map(|&b| f32::from_bits(b)).sum())
    }

    pub(crate) fn verify_host(
        &mut self,
        logits: &[f32],
        batch: &DeviceBatch<'_>,
        qv: usize,
    ) -> Result<Vec<Result<StepOutput>>> {
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let bytes = (logits.len().max(1) * 4) as u64;
        ensure(&self.dev.device, &mut self.logits, bytes, usage, "logits");
        let buf = &self.logits.as_ref().expect("allocated").buf;
        if !logits.is_empty() {
            self.dev.queue.write_buffer(buf, 0, as_bytes(logits));
        }
        let buf = buf.clone();
        self.run(&buf, 0, batch, qv, Some(logits))
    }

    pub(crate) fn verify_device(
        &mut self,
        logits: WgpuLogits<'_>,
        batch: &DeviceBatch<'_>,
        qv: usize,
    ) -> Result<Vec<Result<StepOutput>>> {
        self.run(logits.buffer, logits.offset, batch, qv, None)
    }

    /// One verify call: packs the batch on the host, checks the buffer sizes against the
    /// device's binding limit, allocates and uploads ([`Self::prepare_buffers`]), records the
    /// draft pass of draft logits ([`Self::encode_draft_pass`]) and the main pass, then reads the
    /// results back and assembles them on the host.
    fn run(
        &mut self,
        logits: &wgpu::Buffer,
        offset: u64,
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
        let offset = u32::try_from(offset).map_err(|_| Error::BatchTooLarge {
            backend: "wgpu",
            what: "logits offset",
            size: offset,
            limit: u32::MAX as u64,
        })?;
        let sizes = Sizes::of(&p, d.as_ref(), batch.vocab_size, qv);
        sizes.check(
            logits.size(),
            (q.len() * 4) as u64,
            self.dev.device.limits().max_storage_buffer_binding_size,
        )?;
        self.prepare_buffers(&sizes, q, &p);
        p.globals[10] = offset;
        let dev = self.dev.device.clone();
        let mut enc = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("speculative verify"),
        });
        let q_bind = match d.as_mut() {
            Some(d) => {
                let dout = self.encode_draft_pass(&mut enc, d, &sizes);
                p.globals[14] = (d.n_rows * pack::OUT_WORDS) as u32;
                dout
            }
            None => self.q.as_ref().expect("allocated").buf.clone(),
        };
        let pbuf = &self.params.as_ref().expect("allocated").buf;
        self.dev.queue.write_buffer(pbuf, 0, as_bytes(&p.params));
        let obuf = self.out.as_ref().expect("allocated").buf.clone();
        self.dispatch(
            &mut enc,
            &self.uniform,
            &mut p,
            logits,
            &q_bind,
            pbuf,
            &self.scratch.as_ref().expect("allocated").buf,
            &obuf,
        );
        let rbuf = self.readback.as_ref().expect("allocated").buf.clone();
        enc.copy_buffer_to_buffer(&obuf, 0, &rbuf, 0, sizes.out);
        if d.is_some() {
            let dout = &self.d_out.as_ref().expect("allocated").buf;
            enc.copy_buffer_to_buffer(dout, 0, &rbuf, sizes.out, sizes.d_status);
        }
        self.dev.queue.submit([enc.finish()]);
        let all = readback(&dev, &rbuf, sizes.out + sizes.d_status)?;
        let (out, dstat) = all.split_at(p.out_words());
        let errs = d
            .as_ref()
            .map(|d| pack::draft_errors(d, dstat))
            .unwrap_or_default();
        Ok(pack::assemble(p, pre, batch, out, errs))
    }

    /// [`Self::run`]: grows the main pass's buffers (q, params, scratch, out, readback) to
    /// `sizes` and uploads the q data.
    fn prepare_buffers(&mut self, sizes: &Sizes, q: &[f32], p: &Packed) {
        let dev = self.dev.device.clone();
        let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let out_usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
        ensure(&dev, &mut self.q, (q.len() * 4) as u64, storage, "q");
        let pb = (p.params.len() * 4) as u64;
        ensure(&dev, &mut self.params, pb, storage, "params");
        ensure(
            &dev,
            &mut self.scratch,
            sizes.scratch,
            wgpu::BufferUsages::STORAGE,
            "scratch",
        );
        ensure(&dev, &mut self.out, sizes.out, out_usage, "out");
        let rb_usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        ensure(
            &dev,
            &mut self.readback,
            sizes.out + sizes.d_status,
            rb_usage,
            "readback",
        );
        self.dev.queue.write_buffer(
            self.q.as_ref().map(|b| &b.buf).expect("allocated"),
            0,
            as_bytes(q),
        );
    }

    /// [`Self::run`]: grows the draft pass's buffers, uploads its params and records its
    /// launch (the draft logits are the `logits` of the draft pass; its q binding is unused).
    /// Returns its output buffer, the main pass's q.
    fn encode_draft_pass(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        d: &mut Packed,
        sizes: &Sizes,
    ) -> wgpu::Buffer {
        let dev = self.dev.device.clone();
        let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let out_usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
        let dpb = (d.params.len() * 4) as u64;
        ensure(&dev, &mut self.d_params, dpb, storage, "draft params");
        ensure(
            &dev,
            &mut self.d_scratch,
            sizes.d_scratch,
            wgpu::BufferUsages::STORAGE,
            "draft scratch",
        );
        ensure(&dev, &mut self.d_out, sizes.d_out, out_usage, "draft out");
        let dparams = &self.d_params.as_ref().expect("allocated").buf;
        self.dev.queue.write_buffer(dparams, 0, as_bytes(&d.params));
        let dout = self.d_out.as_ref().expect("allocated").buf.clone();
        let qbuf = self.q.as_ref().expect("allocated").buf.clone();
        self.dispatch(
            enc,
            &self.d_uniform,
            d,
            &qbuf,
            &qbuf,
            dparams,
            &self.d_scratch.as_ref().expect("allocated").buf,
            &dout,
        );
        dout
    }

    /// Records one launch of the verification kernel (verify or draft pass) into `enc`.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        enc: &mut wgpu::CommandEncoder,
        uniform: &wgpu::Buffer,
        p: &mut Packed,
        logits: &wgpu::Buffer,
        qbuf: &wgpu::Buffer,
        pbuf: &wgpu::Buffer,
        sbuf: &wgpu::Buffer,
        obuf: &wgpu::Buffer,
    ) {
        let rows = p.n_rows as u32;
        let (gx, gy) = if rows <= 65_535 {
            (rows, 1)
        } else {
            (65_535, rows.div_ceil(65_535))
        };
        p.globals[12] = gx;
        self.dev
            .queue
            .write_buffer(uniform, 0, as_bytes(&p.globals));
        let bind = self
            .dev
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("speculative verify"),
                layout: &self.layout,
                entries: &[
                    entry(0, uniform),
                    entry(1, logits),
                    entry(2, qbuf),
                    entry(3, pbuf),
                    entry(4, sbuf),
                    entry(5, obuf),
                ],
            });
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("speculative verify"),
            timestamp_writes: None,
        });
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(gx, gy, 1);
    }
}

/// Maps `bytes` of `rbuf` after the submitted work and returns them as words.
fn readback(dev: &wgpu::Device, rbuf: &wgpu::Buffer, bytes: u64) -> Result<Vec<u32>> {
    let slice = rbuf.slice(..bytes);
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    dev.poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| err(format!("device poll failed: {e}")))?;
    rx.recv()
        .map_err(|e| err(format!("readback lost: {e}")))?
        .map_err(|e| err(format!("readback failed: {e}")))?;
    let out: Vec<u32> = {
        let view = slice
            .get_mapped_range()
            .map_err(|e| err(format!("readback map failed: {e}")))?;
        view.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    rbuf.unmap();
    Ok(out)
}

fn entry(binding: u32, buf: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: buf.as_entire_binding(),
    }
}

/// The verification kernel (`verify_rows` of [`super::WGSL_SOURCE`]) and its bind group
/// layout: binding 0 the globals (uniform), 1-3 read-only storage (logits, q, params), 4-5
/// read-write storage (scratch, out).
fn verify_pipeline(device: &wgpu::Device) -> (wgpu::BindGroupLayout, wgpu::ComputePipeline) {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("speculative verify"),
        source: wgpu::ShaderSource::Wgsl(super::WGSL_SOURCE.into()),
    });
    let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    };
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("speculative verify"),
        entries: &[
            wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            },
            storage(1, true),
            storage(2, true),
            storage(3, true),
            storage(4, false),
            storage(5, false),
        ],
    });
    let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some("speculative verify"),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: 0,
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("speculative verify"),
        layout: Some(&pl),
        module: &module,
        entry_point: Some("verify_rows"),
        compilation_options: Default::default(),
        cache: None,
    });
    (layout, pipeline)
}

/// The kernel that reads device logits back (`read_logits` of `kernels/read.wgsl`).
fn read_pipeline(device: &wgpu::Device) -> wgpu::ComputePipeline {
    let read_module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("speculative read"),
        source: wgpu::ShaderSource::Wgsl(include_str!("kernels/read.wgsl").into()),
    });
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("speculative read"),
        layout: None,
        module: &read_module,
        entry_point: Some("read_logits"),
        compilation_options: Default::default(),
        cache: None,
    })
}

/// The buffer sizes of one verify call, in bytes ([`WgpuVerifier::run`]).
struct Sizes {
    /// Main pass: scratch rows and output words.
    scratch: u64,
    out: u64,
    /// Draft pass: scratch rows, output words and its row statuses read back (0 without one).
    d_scratch: u64,
    d_out: u64,
    d_status: u64,
}

impl Sizes {
    /// The sizes of main pass `p` and draft pass `d` over rows `vocab` and `qv` wide.
    fn of(p: &Packed, d: Option<&Packed>, vocab: usize, qv: usize) -> Self {
        Sizes {
            scratch: (p.scratch_rows * vocab).max(1) as u64 * 4,
            out: (p.out_words() * 4) as u64,
            d_scratch: d.map_or(4, |d| (d.scratch_rows * qv).max(1) as u64 * 4),
            d_out: d.map_or(4, |d| (d.out_words() * 4) as u64),
            d_status: d.map_or(0, |d| (d.n_rows * pack::OUT_WORDS * 4) as u64),
        }
    }

    /// Every bound buffer within the device's binding limit `max_bind`.
    ///
    /// # Errors
    /// [`Error::BatchTooLarge`] naming the first buffer over it.
    fn check(&self, logits: u64, q: u64, max_bind: u64) -> Result<()> {
        for (what, size) in [
            ("logits", logits),
            ("scratch", self.scratch.max(self.d_scratch)),
            ("draft probabilities", q),
            ("draft output", self.d_out),
        ] {
            if size > max_bind {
                return Err(Error::BatchTooLarge {
                    backend: "wgpu",
                    what,
                    size,
                    limit: max_bind,
                });
            }
        }
        Ok(())
    }
}

fn ensure(
    dev: &wgpu::Device,
    slot: &mut Option<Buf>,
    bytes: u64,
    usage: wgpu::BufferUsages,
    label: &str,
) {
    let bytes = bytes.max(4).next_multiple_of(4);
    if slot.as_ref().is_some_and(|b| b.cap >= bytes) {
        return;
    }
    let cap = bytes.next_multiple_of(256);
    let buf = dev.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: cap,
        usage,
        mapped_at_creation: false,
    });
    *slot = Some(Buf { buf, cap });
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: only called with f32 and u32 slices (plain data, no padding).
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn wgsl_parses_and_validates() {
        let module = wgpu::naga::front::wgsl::parse_str(super::super::WGSL_SOURCE)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(super::super::WGSL_SOURCE)));
        wgpu::naga::valid::Validator::new(
            wgpu::naga::valid::ValidationFlags::all(),
            wgpu::naga::valid::Capabilities::empty(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}", e.emit_to_string(super::super::WGSL_SOURCE)));
    }
}
