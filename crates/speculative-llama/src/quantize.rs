//! Re-quantizing a GGUF file with llama.cpp's own quantizer, for a weight format whose
//! multi-row kernels make verify calls cheap.

use std::ffi::CString;
use std::path::Path;

use crate::error::{LlamaError, Result};

/// A weight format of [`quantize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Quantization {
    /// 8-bit blocks (`Q8_0`): close to the source weights. On x86 llama.cpp multiplies Q8_0
    /// weights by several rows at once (llamafile's sgemm), so a verify call of `k + 1` rows
    /// costs far less than `k + 1` single steps.
    Q8_0,
    /// 4-bit blocks without offsets (`Q4_0`): smaller and lossier; llama.cpp repacks Q4_0 for
    /// multi-row AVX2 kernels.
    Q4_0,
}

impl Quantization {
    /// The name used in file names and on command lines: `q8_0`, `q4_0`.
    pub fn name(self) -> &'static str {
        match self {
            Quantization::Q8_0 => "q8_0",
            Quantization::Q4_0 => "q4_0",
        }
    }

    /// Parses [`Quantization::name`] (case-insensitive).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" | "q8" => Some(Quantization::Q8_0),
            "q4_0" => Some(Quantization::Q4_0),
            _ => None,
        }
    }
}

/// Writes `dst`, the model of `src` with its weight matrices quantized to `to` by llama.cpp's
/// quantizer (`llama_model_quantize`, which dequantizes already-quantized weights first, so a
/// Q4_1 file can become Q8_0; the tied token embedding keeps its type). Takes a few seconds for
/// a 135M-parameter model.
///
/// Why: llama.cpp's CPU backend has no multi-row kernel for some formats (Q4_1 among them), so
/// a verify call of `k + 1` rows costs about `k + 1` single steps and speculation cannot pay
/// off; see `docs/llama-cpp.md` for the cost curves. The result is another model (a
/// re-quantization of the weights), so compare speculative and plain decoding on the same file.
///
/// # Errors
/// [`LlamaError::Load`] for a missing `src`; [`LlamaError::Text`] for a path that is not valid
/// UTF-8 or holds a NUL; [`LlamaError::Quantize`] when llama.cpp fails (set
/// `SPECULATIVE_LLAMA_LOG=1` for its log).
pub fn quantize(src: &Path, dst: &Path, to: Quantization, threads: usize) -> Result<()> {
    if !src.is_file() {
        return Err(LlamaError::Load {
            path: src.to_path_buf(),
            reason: "no such file".into(),
        });
    }
    crate::engine::backend()?;
    let c = |p: &Path| {
        p.to_str()
            .and_then(|s| CString::new(s).ok())
            .ok_or_else(|| LlamaError::Text(format!("path {}", p.display())))
    };
    let (src_c, dst_c) = (c(src)?, c(dst)?);
    // SAFETY: default parameters from llama.cpp; every pointer field stays null.
    let mut params = unsafe { llama_cpp_sys_2::llama_model_quantize_default_params() };
    params.nthread = i32::try_from(threads.max(1)).unwrap_or(1);
    params.ftype = match to {
        Quantization::Q8_0 => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q8_0,
        Quantization::Q4_0 => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_0,
    };
    params.allow_requantize = true;
    // SAFETY: both paths are NUL-terminated and outlive the call; `params` is initialised.
    let code =
        unsafe { llama_cpp_sys_2::llama_model_quantize(src_c.as_ptr(), dst_c.as_ptr(), &params) };
    if code != 0 {
        let _ = std::fs::remove_file(dst);
        return Err(LlamaError::Quantize {
            path: src.to_path_buf(),
            code,
        });
    }
    Ok(())
}

/// The path of `src` quantized to `to`, made by [`quantize`] on first use and reused after:
/// `<stem>.requant-<to>.gguf` beside `src` (or in the system's temporary folder when that
/// directory is not writable). A file older than `src` is made again.
///
/// # Errors
/// As [`quantize`].
pub fn quantized_copy(src: &Path, to: Quantization, threads: usize) -> Result<std::path::PathBuf> {
    let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let name = format!("{stem}.requant-{}.gguf", to.name());
    let beside = src.parent().map(|d| d.join(&name));
    let fresh = |p: &Path| {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((m(p), m(src)), (Some(a), Some(b)) if a >= b)
    };
    for candidate in beside
        .iter()
        .cloned()
        .chain([std::env::temp_dir().join(&name)])
    {
        if fresh(&candidate) {
            return Ok(candidate);
        }
    }
    // Written under a temporary name and renamed, so a crash never leaves half a file behind.
    let mut last = None;
    for dst in beside.into_iter().chain([std::env::temp_dir().join(&name)]) {
        let tmp = dst.with_extension(format!("tmp{}", std::process::id()));
        match quantize(src, &tmp, to, threads) {
            Ok(()) => {
                std::fs::rename(&tmp, &dst)
                    .map_err(|e| LlamaError::Text(format!("{}: {e}", dst.display())))?;
                return Ok(dst);
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| LlamaError::Text("no place to write the quantized file".into())))
}
