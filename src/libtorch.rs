//! Finding libtorch, and loading its CUDA half into the child that runs cells.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::bail;

/// Where the project's setup script puts its venv with pip torch (see README).
pub fn default_venv() -> PathBuf {
    std::env::var_os("TCHMEM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("venv"))
}

/// `$XDG_CACHE_HOME/tchmem` or `~/.cache/tchmem`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("tchmem")
}

/// Finds libtorch: `explicit` if given, else `$LIBTORCH`, else torch in the project venv, else
/// the torch that `python3` imports. The result is checked to hold `lib/libtorch_cpu.so`.
pub fn find(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    let candidates = explicit
        .map(Path::to_path_buf)
        .into_iter()
        .chain(std::env::var_os("LIBTORCH").map(PathBuf::from))
        .chain(std::iter::once_with(|| venv_torch(&default_venv())).flatten())
        // Asked only when nothing before it holds libtorch: `import torch` takes seconds.
        .chain(std::iter::once_with(python_torch).flatten());
    let mut tried = Vec::new();
    for candidate in candidates {
        if candidate.join("lib/libtorch_cpu.so").is_file() {
            return Ok(candidate);
        }
        tried.push(candidate.display().to_string());
    }
    bail!(
        "libtorch not found (tried: {}). Run `scripts/setup` to install pip torch 2.11.0 into \
         the project venv, or set LIBTORCH to a libtorch 2.11 directory (one holding \
         lib/libtorch_cpu.so), or pass --libtorch DIR.",
        if tried.is_empty() {
            "nothing".into()
        } else {
            tried.join(", ")
        }
    )
}

fn venv_torch(venv: &Path) -> Option<PathBuf> {
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    lib.flatten()
        .map(|entry| entry.path().join("site-packages/torch"))
        .find(|torch| torch.is_dir())
}

fn python_torch() -> Option<PathBuf> {
    let output = Command::new("python3")
        .args([
            "-c",
            "import os, torch; print(os.path.dirname(torch.__file__))",
        ])
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
}

/// Whether libtorch's CUDA library is loaded into this process.
#[derive(Debug, Clone)]
pub enum CudaLibrary {
    /// Loaded from this path, with its symbols global.
    Loaded(PathBuf),
    /// This libtorch has no CUDA library (a CPU-only build), or libtorch was not located.
    Absent(String),
    /// The library is there but could not be loaded.
    Failed(String),
}

impl CudaLibrary {
    /// One line for reports.
    pub fn describe(&self) -> String {
        match self {
            CudaLibrary::Loaded(path) => format!("loaded {}", path.display()),
            CudaLibrary::Absent(why) => format!("absent: {why}"),
            CudaLibrary::Failed(why) => format!("failed: {why}"),
        }
    }
}

/// Loads `libtorch_cuda.so` with `RTLD_GLOBAL`. Cells are shared libraries that link only what
/// the linker kept, which never includes libtorch_cuda; without this `tch::Cuda::is_available()`
/// is false even on a GPU machine.
pub fn load_cuda_globally() -> CudaLibrary {
    let Some(libtorch) = std::env::var_os("LIBTORCH") else {
        return CudaLibrary::Absent("LIBTORCH is not set".into());
    };
    let path = Path::new(&libtorch).join("lib/libtorch_cuda.so");
    if !path.is_file() {
        return CudaLibrary::Absent(format!("{} does not exist", path.display()));
    }
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
    // SAFETY: libtorch's initialisers are safe to run; the library stays loaded for good.
    match unsafe { libloading::os::unix::Library::open(Some(&path), flags) } {
        Ok(library) => {
            std::mem::forget(library);
            CudaLibrary::Loaded(path)
        }
        Err(error) => CudaLibrary::Failed(error.to_string()),
    }
}
