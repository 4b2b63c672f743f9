//! Stand-in for the wgpu backend when the crate is built without feature `wgpu`: the same
//! public types, none of which can be constructed, and a constructor that reports why.

use std::marker::PhantomData;

use super::{Backend, DeviceBatch, unavailable};
use crate::error::Result;
use crate::verify::StepOutput;

pub(crate) const COMPILED: bool = false;

#[derive(Debug, Clone, Copy)]
enum Never {}

/// An engine's wgpu device and queue (feature `wgpu`; without it this type has no value).
#[derive(Debug, Clone)]
pub struct WgpuDevice {
    never: Never,
}

/// Target logits in a wgpu buffer (feature `wgpu`; without it this type has no value).
#[derive(Debug, Clone, Copy)]
pub struct WgpuLogits<'a> {
    never: Never,
    _buffer: PhantomData<&'a ()>,
}

impl WgpuLogits<'_> {
    /// Number of f32 elements (never called: the type has no value in this build).
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// `true` when empty (never called: the type has no value in this build).
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

pub(crate) struct WgpuVerifier {
    never: Never,
}

impl WgpuVerifier {
    pub(crate) fn new() -> Result<Self> {
        Err(unavailable(Backend::Wgpu, "built without feature `wgpu`"))
    }

    pub(crate) fn from_device(device: WgpuDevice) -> Result<Self> {
        match device.never {}
    }

    pub(crate) fn device_name(&self) -> String {
        match self.never {}
    }

    pub(crate) fn device(&self) -> &WgpuDevice {
        match self.never {}
    }

    pub(crate) fn read(&mut self, logits: WgpuLogits<'_>, _n: usize) -> Result<f32> {
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
        logits: WgpuLogits<'_>,
        _batch: &DeviceBatch<'_>,
        _qv: usize,
    ) -> Result<Vec<Result<StepOutput>>> {
        match logits.never {}
    }
}
