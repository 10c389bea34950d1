//! Where a dependency of the cells' crate keeps its sources, as cargo resolved it for the
//! compile directory: the registry's copy, or the offline bundle's vendored one. `--checkpoint`
//! reads a library's model from there (`tch::vision::resnet`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

/// What cargo answered so far, by crate: a folder, or none, with the lock file's modification
/// time then (a later `:dep` that rewrites the lock may bring the crate: a miss is asked again
/// only after it changed, so trials do not each wait for cargo).
#[derive(Debug, Default)]
pub(super) struct DependencySources(Mutex<HashMap<String, Answer>>);

/// A folder or none, and the lock file's modification time when cargo was asked.
type Answer = (Option<PathBuf>, Option<SystemTime>);

impl DependencySources {
    /// The folder holding the library root of `krate` (its library name, as cells `use` it:
    /// `tch`, `torch_sys`) among the dependencies of the crate in `workdir`; `None` where cargo
    /// does not know it without the network or changing the lock file (logged).
    pub(super) fn of(&self, workdir: &Path, krate: &str) -> Option<PathBuf> {
        let lock = std::fs::metadata(workdir.join("Cargo.lock"))
            .and_then(|m| m.modified())
            .ok();
        // A panic while asking cannot leave the map half-written: take it as it is.
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match known.get(krate) {
            Some((Some(folder), _)) => return Some(folder.clone()),
            Some((None, asked)) if *asked == lock => return None,
            _ => {}
        }
        let folder = ask_cargo(workdir, krate);
        known.insert(krate.to_string(), (folder.clone(), lock));
        folder
    }
}

fn ask_cargo(workdir: &Path, krate: &str) -> Option<PathBuf> {
    // --frozen: read the lock file as evcxr left it, offline, and never rewrite it. The host's
    // platform only: cargo's cache holds the packages builds for it needed, not those of
    // other platforms in the lock (windows-sys, wasi), which cargo metadata would ask for.
    let mut cargo = Command::new("cargo");
    cargo.args(["metadata", "--format-version", "1", "--frozen"]);
    if let Some(host) = host_triple() {
        cargo.args(["--filter-platform", &host]);
    }
    let output = cargo
        .arg("--manifest-path")
        .arg(workdir.join("Cargo.toml"))
        .current_dir(workdir)
        .output()
        .inspect_err(|error| tracing::info!("cargo metadata for {krate}'s sources: {error}"))
        .ok()?;
    if !output.status.success() {
        tracing::info!(
            "cargo metadata for {krate}'s sources: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
        return None;
    }
    let folder = library_folder(&output.stdout, krate);
    if folder.is_none() {
        tracing::info!(
            "cargo metadata lists no library named {krate} among the cells' dependencies"
        );
    }
    folder
}

/// The platform rustc builds for here (`x86_64-unknown-linux-gnu`), asked once.
fn host_triple() -> Option<String> {
    static HOST: OnceLock<Option<String>> = OnceLock::new();
    HOST.get_or_init(|| {
        let output = Command::new("rustc").arg("-vV").output().ok()?;
        let text = String::from_utf8(output.stdout).ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix("host: "))
            .map(str::to_string)
    })
    .clone()
}

/// The folder of the library root (`src/lib.rs`) of the package whose library target is named
/// `krate`, in cargo metadata's JSON.
fn library_folder(metadata: &[u8], krate: &str) -> Option<PathBuf> {
    let metadata: serde_json::Value = serde_json::from_slice(metadata).ok()?;
    let library = metadata["packages"]
        .as_array()?
        .iter()
        .flat_map(|package| package["targets"].as_array().into_iter().flatten())
        .find(|target| {
            let kinds = target["kind"].as_array();
            let is_lib = kinds.is_some_and(|kinds| {
                kinds
                    .iter()
                    .any(|k| matches!(k.as_str(), Some("lib" | "rlib")))
            });
            // Older cargo wrote a library's name with the package's hyphens.
            let name = target["name"].as_str().map(|n| n.replace('-', "_"));
            is_lib && name.as_deref() == Some(krate)
        })?;
    Some(
        Path::new(library["src_path"].as_str()?)
            .parent()?
            .to_path_buf(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crates_sources_are_found_by_its_library_targets_name() {
        // The runtime's package is tchmem-runtime, its library tchmem; torch-sys's is torch_sys.
        let metadata = br#"{"packages": [
            {"name": "tchmem-runtime", "targets": [
                {"name": "tchmem", "kind": ["lib"], "src_path": "/w/runtime/src/lib.rs"},
                {"name": "gpt_bench", "kind": ["example"], "src_path": "/w/runtime/examples/g.rs"}]},
            {"name": "torch-sys", "targets": [
                {"name": "build-script-build", "kind": ["custom-build"], "src_path": "/v/t/build.rs"},
                {"name": "torch_sys", "kind": ["lib"], "src_path": "/v/torch-sys-0.24.0/src/lib.rs"}]}]}"#;
        assert_eq!(
            library_folder(metadata, "torch_sys"),
            Some(PathBuf::from("/v/torch-sys-0.24.0/src"))
        );
        assert_eq!(
            library_folder(metadata, "tchmem"),
            Some(PathBuf::from("/w/runtime/src"))
        );
        assert_eq!(library_folder(metadata, "tchmem_runtime"), None);
        assert_eq!(library_folder(metadata, "gpt_bench"), None);
        assert_eq!(library_folder(b"not json", "tch"), None);
    }

    #[test]
    fn the_hosts_platform_is_rustcs() {
        let host = host_triple().expect("rustc runs here");
        assert!(host.split('-').count() >= 3, "{host}");
    }
}
