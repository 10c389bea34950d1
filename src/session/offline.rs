//! Cargo offline while the prelude runs (see `Session::run_prelude`).

use std::path::Path;

use crate::cell_error::CellError;

/// evcxr's command that puts `--offline` on each cargo command it runs.
pub const OFFLINE_ON: &str = ":offline 1";
/// And takes it off again, for the `:dep` lines of the user's cells.
pub const OFFLINE_OFF: &str = ":offline 0";

/// What evcxr writes as the slot's cargo configuration when cargo is online.
const ONLINE_CONFIG: &str = "\n[net]\noffline = false\n";

/// Writes the compile slot's cargo configuration back to online. evcxr writes `:offline`'s
/// setting there (`<slot>/.cargo/config.toml`) only when it next compiles, and its `:dep` checks
/// run cargo in the slot, which reads the file: after the prelude, a `:dep` line in the user's
/// first cell would otherwise still be checked offline.
pub fn write_online(slot: &Path) -> std::io::Result<()> {
    let folder = slot.join(".cargo");
    std::fs::create_dir_all(&folder)?;
    std::fs::write(folder.join("config.toml"), ONLINE_CONFIG)
}

/// Whether the prelude failed because cargo, offline, lacked a crate it would have fetched:
/// cargo's offline failures end with a reminder that it ran with `--offline`.
pub fn needs_the_network(error: &CellError) -> bool {
    let offline = |text: &str| text.contains("--offline");
    offline(&error.evalue) || error.traceback.iter().any(|line| offline(line))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell_error::ErrorName;

    #[test]
    fn the_slots_cargo_configuration_is_written_back_online() {
        let slot = std::env::temp_dir().join(format!("tchmem-offline-{}", std::process::id()));
        let config = slot.join(".cargo/config.toml");
        std::fs::create_dir_all(config.parent().unwrap()).unwrap();
        // As evcxr leaves it after compiling the prelude offline.
        std::fs::write(&config, "\n[net]\noffline = true\n").unwrap();
        write_online(&slot).unwrap();
        let written = std::fs::read_to_string(&config).unwrap();
        assert!(written.contains("offline = false") && !written.contains("true"));
        std::fs::remove_dir_all(slot).unwrap();
    }

    #[test]
    fn only_cargos_offline_failures_send_the_prelude_online() {
        // What cargo 1.95 prints for a crate missing from its cache (evcxr keeps its lines).
        let missing = CellError {
            ename: ErrorName::Error,
            evalue: "no matching package named `not-cached` found".to_string(),
            traceback: vec![
                "location searched: crates.io index".to_string(),
                "As a reminder, you're using offline mode (--offline) which can sometimes cause \
                 surprising resolution failures, if this error is too confusing you may wish to \
                 retry without `--offline`."
                    .to_string(),
            ],
        };
        assert!(needs_the_network(&missing));
        let compile = CellError::new(
            ErrorName::CompilationError,
            "cannot find value `offline` in this scope".to_string(),
        );
        assert!(!needs_the_network(&compile));
    }
}
