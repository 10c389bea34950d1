//! The optimisation level of cells' own code.
//!
//! evcxr builds a cell and its dependencies with one profile (opt-level 2). A cell's own code is
//! small and its heavy work runs inside libtorch, so tchmem compiles the cell crate (evcxr's
//! `ctx`) at opt-level 0, through a profile override in a cargo config file above the compile
//! slots, while tch, torch-sys and the runtime stay optimised: statement cells then compile about
//! as fast as in evcxr_jupyter, although each also links tchmem's runtime
//! (`scripts/bench/vs-evcxr`). evcxr's `:opt` is answered here and sets the cells' level only;
//! passed to evcxr it would rebuild every dependency at the new level (minutes).

use std::path::{Path, PathBuf};

use crate::cell_syntax;

/// The level cells start at.
const DEFAULT_LEVEL: &str = "0";
/// Levels cargo accepts for `opt-level`.
const LEVELS: [&str; 6] = ["0", "1", "2", "3", "s", "z"];

/// The cells' optimisation level, kept in the cargo config file that cargo reads above a slot.
pub struct CellOpt {
    config: PathBuf,
    level: String,
    /// Cells keep line tables (for `%%memprofile --stacks`, whose frames then name cell lines).
    line_tables: bool,
}

impl CellOpt {
    /// Sets cells under the slot directory `slot` to the default level. The file is shared by the
    /// slots under one root (kernels running at once), so the last `:opt` wins for all of them.
    pub fn start(slot: &Path) -> std::io::Result<CellOpt> {
        let root = slot.parent().unwrap_or(slot);
        let cell_opt = CellOpt {
            config: root.join(".cargo").join("config.toml"),
            level: DEFAULT_LEVEL.to_string(),
            line_tables: false,
        };
        cell_opt.write()?;
        Ok(cell_opt)
    }

    fn write(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(self.config.parent().unwrap_or(Path::new(".")))?;
        std::fs::write(
            &self.config,
            format!(
                "# Written by tchmem (src/session/cell_opt.rs): the optimisation level of cells'\n\
                 # own code (evcxr's crate `ctx`); their dependencies keep evcxr's level. `:opt N`\n\
                 # in a cell changes it.\n\
                 [profile.dev.package.ctx]\nopt-level = {}\n{}",
                toml_level(&self.level),
                if self.line_tables {
                    // evcxr strips debug info from the whole profile; the cell crate keeps it.
                    "debug = \"line-tables-only\"\nstrip = \"none\"\n"
                } else {
                    ""
                }
            ),
        )
    }

    /// Builds the next cells with line tables (or without, the default: linking them costs
    /// time, since the standard library's come along).
    pub fn set_line_tables(&mut self, on: bool) -> std::io::Result<()> {
        if self.line_tables == on {
            return Ok(());
        }
        self.line_tables = on;
        self.write()
    }

    /// Answers the `:opt` commands among the evcxr command lines at the top of `code` (`:opt N`
    /// sets the level, `:opt` alone toggles between 0 and 2, as in evcxr). Returns the code with
    /// those lines blanked (so that line numbers stay) and what to tell the user.
    pub fn take_commands(&mut self, code: &str) -> (String, Vec<Result<String, String>>) {
        let mut said = Vec::new();
        let mut lines = Vec::new();
        let mut leading = true;
        for line in code.split('\n') {
            leading = leading && cell_syntax::is_before_rust(line);
            let argument = line
                .trim()
                .strip_prefix(":opt")
                .filter(|rest| rest.is_empty() || rest.starts_with(' '));
            match argument {
                Some(argument) if leading => {
                    said.push(self.set(argument.trim()));
                    lines.push("");
                }
                _ => lines.push(line),
            }
        }
        (lines.join("\n"), said)
    }

    fn set(&mut self, argument: &str) -> Result<String, String> {
        let level = match argument {
            "" if self.level == "2" => "0",
            "" => "2",
            level if LEVELS.contains(&level) => level,
            other => {
                return Err(format!(
                    ":opt takes one of {}; got `{other}`",
                    LEVELS.join(", ")
                ))
            }
        };
        let previous = std::mem::replace(&mut self.level, level.to_string());
        if let Err(error) = self.write() {
            self.level = previous;
            return Err(format!("could not set the level: {error}"));
        }
        Ok(format!(
            "Optimization: {level} (cells' own code; tch, torch-sys and the runtime stay \
             optimised)"
        ))
    }
}

/// Numbers are TOML integers, "s" and "z" strings.
fn toml_level(level: &str) -> String {
    if level.chars().all(|c| c.is_ascii_digit()) {
        level.to_string()
    } else {
        format!("\"{level}\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_start_unoptimised_and_opt_sets_or_toggles_their_level() {
        let root = std::env::temp_dir().join(format!("tchmem-cell-opt-{}", std::process::id()));
        let slot = root.join("slot-0");
        let mut cell_opt = CellOpt::start(&slot).unwrap();
        let config = root.join(".cargo/config.toml");
        assert!(std::fs::read_to_string(&config)
            .unwrap()
            .contains("[profile.dev.package.ctx]\nopt-level = 0\n"));

        let (code, said) = cell_opt.take_commands(":opt 2\nlet x = 1;\n:opt 3");
        assert_eq!(
            code, "\nlet x = 1;\n:opt 3",
            "only leading command lines are taken"
        );
        assert!(said[0].as_ref().unwrap().starts_with("Optimization: 2"));
        assert!(std::fs::read_to_string(&config)
            .unwrap()
            .contains("opt-level = 2\n"));

        let (_, said) = cell_opt.take_commands(":opt");
        assert!(said[0].as_ref().unwrap().starts_with("Optimization: 0"));
        let (_, said) = cell_opt.take_commands(":opt s");
        assert!(std::fs::read_to_string(&config)
            .unwrap()
            .contains("opt-level = \"s\"\n"));
        assert!(said[0].is_ok());
        let (_, said) = cell_opt.take_commands(":opt fast");
        assert!(said[0].as_ref().unwrap_err().contains("0, 1, 2, 3, s, z"));
        cell_opt.set_line_tables(true).unwrap();
        let text = std::fs::read_to_string(&config).unwrap();
        assert!(
            text.contains("opt-level = \"s\"\ndebug = \"line-tables-only\"\nstrip = \"none\"\n")
        );
        cell_opt.set_line_tables(false).unwrap();
        assert!(!std::fs::read_to_string(&config).unwrap().contains("debug"));
        let (code, said) = cell_opt.take_commands(":optional_thing\n1");
        assert!(said.is_empty() && code == ":optional_thing\n1");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
