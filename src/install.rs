//! `tchmem install`: writes the kernelspec (kernelspec/ holds the template and logos).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};

const TEMPLATE: &str = include_str!("../kernelspec/kernel.json");
const LOGO_32: &[u8] = include_bytes!("../kernelspec/logo-32x32.png");
const LOGO_64: &[u8] = include_bytes!("../kernelspec/logo-64x64.png");

/// Where and how to install.
#[derive(Args)]
#[command(group(clap::ArgGroup::new("location").args(["user", "sys_prefix", "prefix"])))]
pub struct InstallArgs {
    /// Install for the current user [the default] (in Jupyter's user data directory).
    #[arg(long)]
    user: bool,
    /// Install into the active Python environment ($VIRTUAL_ENV, $CONDA_PREFIX, else python3's
    /// sys.prefix).
    #[arg(long)]
    sys_prefix: bool,
    /// Install under DIR/share/jupyter/kernels.
    #[arg(long, value_name = "DIR")]
    prefix: Option<PathBuf>,
    /// Kernel name (the directory under kernels/).
    #[arg(long, default_value = "tchmem")]
    name: String,
    /// Name shown in Jupyter's launcher.
    #[arg(long, default_value = "Rust (tchmem)")]
    display_name: String,
    /// libtorch the kernel gives its cells [default: found as `tchmem kernel` would].
    #[arg(long, value_name = "DIR")]
    libtorch: Option<PathBuf>,
}

/// Writes the kernelspec and prints where it went.
pub fn install(args: &InstallArgs) -> anyhow::Result<()> {
    if args.name.is_empty()
        || !args
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        bail!(
            "--name must be letters, digits, '.', '_' or '-' (got {:?})",
            args.name
        );
    }
    let kernels = kernels_dir(args)?;
    let dir = kernels.join(&args.name);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let exe = std::env::current_exe()
        .and_then(|exe| exe.canonicalize())
        .context("cannot locate the tchmem binary")?;
    let libtorch = match crate::libtorch::find(args.libtorch.as_deref()) {
        Ok(found) => Some(found),
        Err(error) => {
            eprintln!(
                "warning: {error:#}\nThe kernel will run plain Rust until libtorch is found."
            );
            None
        }
    };
    let spec = render(&exe, libtorch.as_deref(), &args.display_name)?;
    std::fs::write(
        dir.join("kernel.json"),
        serde_json::to_string_pretty(&spec)? + "\n",
    )?;
    std::fs::write(dir.join("logo-32x32.png"), LOGO_32)?;
    std::fs::write(dir.join("logo-64x64.png"), LOGO_64)?;
    println!("Installed kernelspec {} in {}", args.name, dir.display());
    Ok(())
}

/// The kernel.json for this binary and libtorch.
fn render(exe: &Path, libtorch: Option<&Path>, display_name: &str) -> anyhow::Result<Value> {
    let mut spec: Value = serde_json::from_str(TEMPLATE).context("kernelspec/kernel.json")?;
    let exe = exe.to_str().context("the binary's path is not UTF-8")?;
    spec["argv"][0] = json!(exe);
    spec["display_name"] = json!(display_name);
    if let Some(libtorch) = libtorch {
        // The kernel puts libtorch/lib on the cells' LD_LIBRARY_PATH itself.
        spec["env"]["LIBTORCH"] = json!(libtorch);
    }
    Ok(spec)
}

fn kernels_dir(args: &InstallArgs) -> anyhow::Result<PathBuf> {
    if let Some(prefix) = &args.prefix {
        return Ok(prefix.join("share/jupyter/kernels"));
    }
    if args.sys_prefix {
        return Ok(python_prefix()?.join("share/jupyter/kernels"));
    }
    Ok(user_data_dir()?.join("kernels"))
}

/// Jupyter's user data directory: $JUPYTER_DATA_DIR, else $XDG_DATA_HOME/jupyter, else
/// ~/.local/share/jupyter (Linux).
fn user_data_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("JUPYTER_DATA_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME") {
        return Ok(PathBuf::from(dir).join("jupyter"));
    }
    let home = std::env::var_os("HOME").context("HOME is not set; use --prefix DIR")?;
    Ok(PathBuf::from(home).join(".local/share/jupyter"))
}

fn python_prefix() -> anyhow::Result<PathBuf> {
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(dir) = std::env::var_os(var) {
            return Ok(PathBuf::from(dir));
        }
    }
    let output = Command::new("python3")
        .args(["-c", "import sys; print(sys.prefix)"])
        .output()
        .context("--sys-prefix needs python3 on PATH (or use --prefix DIR)")?;
    if !output.status.success() {
        bail!("python3 could not report sys.prefix; use --prefix DIR");
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&output.stdout).trim(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_runs_this_binary_with_the_connection_file_and_libtorch() {
        let spec = render(
            Path::new("/opt/bin/tchmem"),
            Some(Path::new("/opt/torch")),
            "Rust",
        )
        .unwrap();
        assert_eq!(
            spec["argv"],
            json!([
                "/opt/bin/tchmem",
                "kernel",
                "--connection-file",
                "{connection_file}"
            ])
        );
        assert_eq!(spec["language"], "rust");
        assert_eq!(spec["interrupt_mode"], "message");
        assert_eq!(spec["env"]["LIBTORCH"], "/opt/torch");
    }

    #[test]
    fn logos_are_png() {
        for logo in [LOGO_32, LOGO_64] {
            assert_eq!(&logo[..8], b"\x89PNG\r\n\x1a\n");
        }
    }
}
