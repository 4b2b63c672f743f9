//! Whether this build of llama.cpp repacks weights for its CPU multi-row kernels (the
//! `CPU_REPACK` extra buffer type), which decides batch invariance on K-quant files.

use std::ffi::CStr;

use crate::engine::backend;
use crate::error::Result;

/// The names of the CPU backend's extra buffer types in this build of llama.cpp (for example
/// `CPU_REPACK`; empty when there are none). Weights a GGUF stores in a type that an extra
/// buffer type handles are converted into its layout at load time and multiplied by its kernels.
///
/// # Errors
/// [`crate::LlamaError::Backend`] as [`backend`].
pub fn cpu_extra_buffer_types() -> Result<Vec<String>> {
    backend()?;
    // SAFETY: plain queries of ggml's backend registry, initialised by `backend()`; every
    // pointer is checked for null before use, the array of buffer types ends with a null entry
    // (ggml's contract for `ggml_backend_dev_get_extra_bufts`), and the names are
    // NUL-terminated strings owned by ggml for the process lifetime.
    unsafe {
        let dev = llama_cpp_sys_2::ggml_backend_dev_by_type(
            llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_CPU,
        );
        if dev.is_null() {
            return Ok(Vec::new());
        }
        let reg = llama_cpp_sys_2::ggml_backend_dev_backend_reg(dev);
        if reg.is_null() {
            return Ok(Vec::new());
        }
        let f = llama_cpp_sys_2::ggml_backend_reg_get_proc_address(
            reg,
            c"ggml_backend_dev_get_extra_bufts".as_ptr(),
        );
        if f.is_null() {
            return Ok(Vec::new());
        }
        type GetExtra = unsafe extern "C" fn(
            llama_cpp_sys_2::ggml_backend_dev_t,
        )
            -> *mut llama_cpp_sys_2::ggml_backend_buffer_type_t;
        let get: GetExtra = std::mem::transmute::<*mut std::os::raw::c_void, GetExtra>(f);
        let mut p = get(dev);
        let mut names = Vec::new();
        while !p.is_null() && !(*p).is_null() {
            let name = llama_cpp_sys_2::ggml_backend_buft_name(*p);
            if !name.is_null() {
                names.push(CStr::from_ptr(name).to_string_lossy().into_owned());
            }
            p = p.add(1);
        }
        Ok(names)
    }
}

/// `true` when this build of llama.cpp repacks weights for its CPU kernels (an extra buffer type
/// named `CPU_REPACK`; llama.cpp's cmake option `GGML_CPU_REPACK`, on by default).
///
/// Batch invariance: on x86-64 with AVX2, Q4_0, Q4_K and IQ4_NL weights are then repacked into
/// interleaved blocks, and a call of `n` rows multiplies the first `n - n % 4` rows with the
/// repacked GEMM kernel and the rest with the GEMV kernel, which round differently. A row of a
/// `k + 1`-row verify call therefore need not carry, bit for bit, the logits of the same row
/// decoded alone (always GEMV). Measured on Gemma 3 270M's Q4_K_M file: a largest logit
/// difference above 2 and an argmax change at a near tie (`docs/llama-cpp.md`). A build with
/// `GGML_CPU_REPACK=OFF` (this repository's `.cargo/config.toml`) keeps the stored layout; on
/// that file its rows were then bit-identical to single rows in calls of up to 7 rows (verify
/// calls of draft length `k <= 6`), and not from 8 rows on (other multi-row kernels take over:
/// measured with `examples/batch_invariance.rs`), so greedy identity on such a file needs
/// `k <= 6` (for the adaptive policy, `max_draft <= 6`).
///
/// `.cargo/config.toml` applies only to builds inside this repository: a crate that depends on
/// `speculative-llama` gets llama.cpp's default (repacking on) unless its own environment or
/// `.cargo/config.toml` sets `GGML_CPU_REPACK=OFF`; this function says which build runs.
///
/// # Errors
/// [`crate::LlamaError::Backend`] as [`backend`].
pub fn cpu_weight_repacking() -> Result<bool> {
    Ok(cpu_extra_buffer_types()?.iter().any(|n| n == "CPU_REPACK"))
}
