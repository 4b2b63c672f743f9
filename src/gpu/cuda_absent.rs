//! Stand-in for the CUDA backend when the crate is built without feature `cuda`: the same
//! public types, none of which can be constructed, and a constructor that reports why.

use std::marker::PhantomData;

use super::{Backend, DeviceBatch, unavailable};
use crate::error::Result;
use crate::verify::StepOutput;

pub(crate) const COMPILED: bool = false;

#[derive(Debug, Clone, Copy)]
enum Never {}

/// An engine's CUDA context and stream (feature `cuda`; without it this type has no value).
#[derive(Debug, Clone)]
pub struct CudaDevice {
    never: Never,
}

/// Target logits in a CUDA device memory (feature `cuda`; without it this type has no value).
#[derive(Debug, Clone, Copy)]
pub struct CudaLogits<'a> {
    never: Never,
    _buffer: PhantomData<&'a ()>,
}

impl CudaLogits<'_> {
    /// Number of f32 elements (never called: the type has no value in this build).
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// `true` when empty (never called: the type has no value in this build).
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

pub(crate) fn compile_ptx() -> Result<String> {
    Err(unavailable(Backend::Cuda, "built without feature `cuda`"))
}

pub(crate) struct CudaVerifier {
    never: Never,
}

impl CudaVerifier {
    pub(crate) fn new() -> Result<Self> {
        Err(unavailable(Backend::Cuda, "built without feature `cuda`"))
    }

    pub(crate) fn from_device(device: CudaDevice) -> Result<Self> {
        match device.never {}
    }

    pub(crate) fn device_name(&self) -> String {
        match self.never {}
    }

    pub(crate) fn device(&self) -> &CudaDevice {
        match self.never {}
    }

    pub(crate) fn read(&mut self, logits: CudaLogits<'_>, _n: usize) -> Result<f32> {
        match logits.never {}
    }

    pub(crate) fn verify_host(
        &mut self,
        _logits: &[f32],
        _batch: &DeviceBatch<'_>,
        _qv: usize,
    ) -> Result<Vec<Result<StepOutput>>> {
        match self.never {}
    }

    pub(crate) fn verify_device(
        &mut self,
        logits: CudaLogits<'_>,
        _batch: &DeviceBatch<'_>,
        _qv: usize,
    ) -> Result<Vec<Result<StepOutput>>> {
        match logits.never {}
    }
}
