//! Compiles the C++ shim (csrc/) against the same libtorch as torch-sys, which reports its
//! location to crates that depend on it directly (`links = "tch"` → DEP_TCH_LIBTORCH_LIB).

use std::path::{Path, PathBuf};

/// A C++ build against libtorch's headers (under `torch`), with libtorch's own settings.
fn shim_build(torch: &Path) -> cc::Build {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        // The same ABI and glog settings as torch-sys.
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("GLOG_USE_GLOG_EXPORT", None)
        // libtorch is a release build: some of its classes have debug-only fields
        // (RecordFunction's `inputs_valid_`), so headers read without NDEBUG lay them out
        // differently from the library.
        .define("NDEBUG", None)
        // GCC would otherwise inline a CUDA-runtime call from a header into the object, which
        // the linker then cannot resolve (notes/libtorch.md).
        .flag("-fno-devirtualize-speculatively")
        .warnings(false);
    build
}

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys did not report libtorch's location (DEP_TCH_LIBTORCH_LIB)");
    let torch = PathBuf::from(lib)
        .parent()
        .expect("libtorch's lib directory has a parent")
        .to_path_buf();
    shim_build(&torch)
        .file("csrc/memory.cpp")
        .file("csrc/checkpoint.cpp")
        .file("csrc/stored_input.cpp")
        .file("csrc/autocast.cpp")
        .file("csrc/adam.cpp")
        .file("csrc/stack.cpp")
        .file("csrc/grad.cpp")
        .file("csrc/fused_loss.cpp")
        .file("csrc/step_in_backward.cpp")
        .file("csrc/op_trace.cpp")
        .file("csrc/busy_time.cpp")
        .file("csrc/cudnn.cpp")
        .compile("tchmem_shim");

    // The process group (csrc/dist.cpp): libtorch's ProcessGroupGloo, whose header includes
    // Gloo's, which pip's torch does not ship; gloo_declarations/ declares what it names.
    shim_build(&torch)
        .file("csrc/dist.cpp")
        .include("csrc/gloo_declarations")
        .define("USE_C10D_GLOO", None)
        .compile("tchmem_dist_shim");

    // The OOM observer, the allocation history and the memory fraction need CUDA headers:
    // torch's nvidia wheels have all but crt/, which scripts/setup installs (nvidia-cuda-crt).
    // Without them the runtime has none of them: it relies on the allocator's OOM counter, has
    // no timelines and cannot cap the allocator.
    println!("cargo::rustc-check-cfg=cfg(tchmem_cuda_headers)");
    println!("cargo:rerun-if-env-changed=TCHMEM_CUDA_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    // pip's wheels (nvidia-cuda-crt adds crt/), then a CUDA toolkit, as GPU servers have one.
    let candidates: Vec<PathBuf> = [
        std::env::var_os("TCHMEM_CUDA_INCLUDE").map(PathBuf::from),
        Some(torch.join("../nvidia/cu13/include")),
        std::env::var_os("CUDA_HOME").map(|home| PathBuf::from(home).join("include")),
        Some(PathBuf::from("/usr/local/cuda/include")),
    ]
    .into_iter()
    .flatten()
    .collect();
    let found = candidates.iter().find(|dir| {
        dir.join("crt/host_config.h").exists() && dir.join("cuda_runtime_api.h").exists()
    });
    if let Some(cuda_include) = found {
        shim_build(&torch)
            .file("csrc/oom_observer.cpp")
            .file("csrc/history.cpp")
            .file("csrc/memory_fraction.cpp")
            .file("csrc/alloc_trace.cpp")
            .include(cuda_include)
            .compile("tchmem_cuda_shim");
        println!("cargo:rustc-cfg=tchmem_cuda_headers");
    } else {
        println!(
            "cargo:warning=no CUDA headers in {} (pip install --no-deps nvidia-cuda-crt==13.0.88, or set TCHMEM_CUDA_INCLUDE): building without the OOM observer, the allocation history and the memory fraction",
            candidates
                .iter()
                .map(|dir| dir.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    // Programs built from this crate (examples, tests) must load libtorch_cuda themselves: cargo
    // does not pass tch's link arguments on, and the linker would drop the unreferenced library,
    // leaving tch without CUDA on a GPU machine (notes/libtorch.md). Cells get it from the
    // kernel's child instead.
    let lib = torch.join("lib");
    for kind in ["examples", "tests"] {
        for arg in [
            format!("-L{}", lib.display()),
            "-Wl,--no-as-needed".into(),
            "-ltorch_cuda".into(),
            "-lc10_cuda".into(),
            "-Wl,--as-needed".into(),
        ] {
            println!("cargo:rustc-link-arg-{kind}={arg}");
        }
    }
}
