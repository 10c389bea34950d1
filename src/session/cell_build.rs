//! How cells' own code is built: its optimisation level, its line tables and its edition.
//!
//! evcxr builds a cell and its dependencies with one profile (opt-level 2). A cell's own code is
//! small and its heavy work runs inside libtorch, so tchmem compiles the cell crate (evcxr's
//! `ctx`) at opt-level 0, through a profile override in a cargo config file above the compile
//! slots, while tch, torch-sys and the runtime stay optimised: statement cells then compile about
//! as fast as in evcxr_jupyter, although each also links tchmem's runtime
//! (`scripts/bench/vs-evcxr`). evcxr's `:opt` is answered here and sets the cells' level only;
//! passed to evcxr it would rebuild every dependency at the new level (minutes).
//!
//! Cells are edition 2021 unless a cell says `:edition 2024`: evcxr's cell crate is 2024 (its own
//! code in every cell needs it), and the session writes out 2021's rules where they differ (see
//! [`crate::cell_edition`]).

use std::path::{Path, PathBuf};

use crate::cell_syntax;

/// The level cells start at.
const DEFAULT_LEVEL: &str = "0";
/// Levels cargo accepts for `opt-level`.
const LEVELS: [&str; 6] = ["0", "1", "2", "3", "s", "z"];
/// The edition cells start with: tch's and its examples'.
pub const DEFAULT_EDITION: &str = "2021";
/// Editions `:edition` accepts (2018 code reads as 2021 where cells differ).
const EDITIONS: [&str; 3] = ["2018", "2021", "2024"];

/// How cells are built: the level and line tables in the cargo config file that cargo reads
/// above a slot, the edition in the session.
pub struct CellBuild {
    config: PathBuf,
    level: String,
    /// Cells keep line tables (for `%%memprofile --stacks`, whose frames then name cell lines).
    line_tables: bool,
    edition: String,
}

impl CellBuild {
    /// Sets cells under the slot directory `slot` to the default level and edition. The config
    /// file is shared by the slots under one root (kernels running at once), so the last `:opt`
    /// wins for all of them; the edition is this session's.
    pub fn start(slot: &Path) -> std::io::Result<CellBuild> {
        let root = slot.parent().unwrap_or(slot);
        let build = CellBuild {
            config: root.join(".cargo").join("config.toml"),
            level: DEFAULT_LEVEL.to_string(),
            line_tables: false,
            edition: DEFAULT_EDITION.to_string(),
        };
        build.write()?;
        Ok(build)
    }

    /// Whether cells are read with edition 2024's rules (else 2021's are written out).
    pub fn edition_2024(&self) -> bool {
        self.edition == "2024"
    }

    fn write(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(self.config.parent().unwrap_or(Path::new(".")))?;
        std::fs::write(
            &self.config,
            format!(
                "# Written by tchmem (src/session/cell_build.rs): the optimisation level of cells'\n\
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

    /// Answers the `:opt` and `:edition` commands among the evcxr command lines at the top of
    /// `code` (`:opt N` sets the level, `:opt` alone toggles between 0 and 2, as in evcxr;
    /// `:edition 2024` the cells' edition, `:edition` alone tells it). Returns the code with
    /// those lines blanked (so that line numbers stay) and what to tell the user.
    pub fn take_commands(&mut self, code: &str) -> (String, Vec<Result<String, String>>) {
        let mut said = Vec::new();
        let mut lines = Vec::new();
        let mut leading = true;
        for line in code.split('\n') {
            leading = leading && cell_syntax::is_before_rust(line);
            let command = |name: &str| {
                line.trim()
                    .strip_prefix(name)
                    .filter(|rest| rest.is_empty() || rest.starts_with(' '))
                    .map(str::trim)
            };
            match (command(":opt"), command(":edition")) {
                (Some(argument), _) if leading => said.push(self.set(argument)),
                (_, Some(argument)) if leading => said.push(self.set_edition(argument)),
                _ => {
                    lines.push(line);
                    continue;
                }
            }
            lines.push("");
        }
        (lines.join("\n"), said)
    }

    fn set_edition(&mut self, argument: &str) -> Result<String, String> {
        let edition = match argument {
            "" => self.edition.clone(),
            edition if EDITIONS.contains(&edition) => edition.to_string(),
            other => {
                return Err(format!(
                    ":edition takes one of {}; got `{other}`",
                    EDITIONS.join(", ")
                ))
            }
        };
        self.edition = edition;
        Ok(format!(
            "Edition: {} (cells' own code; tchmem starts cells at {DEFAULT_EDITION}, the edition \
             of tch and its examples)",
            self.edition
        ))
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
        let mut cell_opt = CellBuild::start(&slot).unwrap();
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

    #[test]
    fn cells_are_edition_2021_until_a_cell_says_otherwise() {
        let root = std::env::temp_dir().join(format!("tchmem-edition-{}", std::process::id()));
        let mut build = CellBuild::start(&root.join("slot-0")).unwrap();
        assert!(!build.edition_2024());
        let (code, said) = build.take_commands(":edition 2024\nlet x = 1;");
        assert_eq!(code, "\nlet x = 1;");
        assert!(said[0].as_ref().unwrap().starts_with("Edition: 2024"));
        assert!(build.edition_2024());
        let (_, said) = build.take_commands(":edition");
        assert!(said[0].as_ref().unwrap().starts_with("Edition: 2024"));
        let (_, said) = build.take_commands(":edition 2027");
        assert!(said[0].as_ref().unwrap_err().contains("2018, 2021, 2024"));
        let (_, said) = build.take_commands(":edition 2021");
        assert!(said[0].is_ok() && !build.edition_2024());
        let (code, said) = build.take_commands(":editions\n1");
        assert!(said.is_empty() && code == ":editions\n1");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
