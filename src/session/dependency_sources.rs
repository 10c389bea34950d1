//! Where a dependency of the cells' crate keeps its sources, as cargo resolved it for the
//! compile directory: the registry's copy, or the offline bundle's vendored one. `--checkpoint`
//! reads a library's model from there (`tch::vision::resnet`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// The answers so far, by crate (one `cargo metadata` per crate and session).
#[derive(Debug, Default)]
pub(super) struct DependencySources(Mutex<HashMap<String, Option<PathBuf>>>);

impl DependencySources {
    /// The `src/` folder of `krate` (its library name: `tch`, `half`) among the dependencies of
    /// the crate in `workdir`; `None` where cargo does not know it without the network or
    /// changing the lock file.
    pub(super) fn of(&self, workdir: &Path, krate: &str) -> Option<PathBuf> {
        // A panic while asking cannot leave the map half-written: take it as it is.
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        known
            .entry(krate.to_string())
            .or_insert_with(|| ask_cargo(workdir, krate))
            .clone()
    }
}

fn ask_cargo(workdir: &Path, krate: &str) -> Option<PathBuf> {
    // --frozen: read the lock file as evcxr left it, offline; never rewrite it.
    let output = Command::new("cargo")
        .args([
            "metadata",
            "--format-version",
            "1",
            "--frozen",
            "--manifest-path",
        ])
        .arg(workdir.join("Cargo.toml"))
        .current_dir(workdir)
        .output()
        .inspect_err(|error| tracing::debug!("cargo metadata for {krate}'s sources: {error}"))
        .ok()?;
    if !output.status.success() {
        tracing::debug!(
            "cargo metadata for {krate}'s sources: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
        return None;
    }
    source_folder(&output.stdout, krate)
}

/// The `src/` beside the manifest of the package whose library is `krate`, in cargo metadata's
/// JSON.
fn source_folder(metadata: &[u8], krate: &str) -> Option<PathBuf> {
    let metadata: serde_json::Value = serde_json::from_slice(metadata).ok()?;
    let package = metadata["packages"].as_array()?.iter().find(|package| {
        package["name"].as_str().map(|n| n.replace('-', "_")) == Some(krate.into())
    })?;
    let manifest = Path::new(package["manifest_path"].as_str()?);
    Some(manifest.parent()?.join("src"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crates_sources_are_found_by_its_library_name() {
        let metadata = br#"{"packages": [
            {"name": "half", "manifest_path": "/r/half-2.4.1/Cargo.toml"},
            {"name": "torch-sys", "manifest_path": "/v/torch-sys-0.24.0/Cargo.toml"}]}"#;
        assert_eq!(
            source_folder(metadata, "torch_sys"),
            Some(PathBuf::from("/v/torch-sys-0.24.0/src"))
        );
        assert_eq!(
            source_folder(metadata, "half"),
            Some(PathBuf::from("/r/half-2.4.1/src"))
        );
        assert_eq!(source_folder(metadata, "tch"), None);
        assert_eq!(source_folder(b"not json", "tch"), None);
    }
}
