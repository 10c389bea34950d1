//! `%` magics: lines at the top of a cell that talk to the kernel instead of running as Rust.
//!
//! Each magic's arguments are parsed by clap, so `--help` and error messages are uniform. Rust
//! code never starts with `%`, so a cell's leading `%` lines are always magics; the rest of the
//! cell, if any, runs as usual.

use clap::{Parser, ValueEnum};

/// When the memory summary is shown after a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ProfileMode {
    /// After cells that changed memory (allocated, reserved or peak on CUDA; watched tensors on
    /// CPU).
    #[default]
    Auto,
    /// After every cell.
    Always,
    /// Never (records are still kept for %memhistory).
    Off,
}

/// A parsed magic.
#[derive(Debug, PartialEq, Eq)]
pub enum Magic {
    /// `%memprofile [MODE]`: set (or show) when memory is shown.
    Profile(Option<ProfileMode>),
    /// `%memhistory`: the records of every cell so far.
    History,
    /// `%memsummary`: the allocator's counters after the last cell, as a table.
    Summary,
}

/// What a magic line produced when it is not a magic to apply.
#[derive(Debug, PartialEq, Eq)]
pub enum MagicReply {
    /// Help text (`--help`): shown, not an error.
    Help(String),
    /// A mistake: unknown magic, bad flag or value; the message says what to do.
    Error(String),
}

/// Show or set when the memory summary appears after a cell.
#[derive(Parser)]
#[command(
    name = "%memprofile",
    no_binary_name = true,
    disable_version_flag = true
)]
struct MemProfileArgs {
    /// auto: after cells that changed memory; always: after every cell; off: never.
    mode: Option<ProfileMode>,
}

/// Show the memory record of every cell run so far, as a table.
#[derive(Parser)]
#[command(
    name = "%memhistory",
    no_binary_name = true,
    disable_version_flag = true
)]
struct MemHistoryArgs {}

/// Show the CUDA caching allocator's counters after the last cell that ran code, as a table
/// (PyTorch's memory_summary, readable in a notebook).
#[derive(Parser)]
#[command(
    name = "%memsummary",
    no_binary_name = true,
    disable_version_flag = true
)]
struct MemSummaryArgs {}

const MAGICS: &str = "%memprofile, %memhistory, %memsummary";

/// Splits a cell into its leading magic lines and the code after them.
pub fn split(cell: &str) -> (Vec<&str>, &str) {
    let mut magics = Vec::new();
    let mut rest = cell;
    loop {
        let trimmed = rest.trim_start_matches([' ', '\t', '\r', '\n']);
        if !trimmed.starts_with('%') {
            return (magics, rest);
        }
        let (line, after) = trimmed.split_once('\n').unwrap_or((trimmed, ""));
        magics.push(line.trim_end());
        rest = after;
    }
}

/// Parses one magic line (starting with `%`).
pub fn parse(line: &str) -> Result<Magic, MagicReply> {
    let mut words = line.split_whitespace();
    let name = words.next().unwrap_or_default();
    let args: Vec<&str> = words.collect();
    match name {
        "%memprofile" => MemProfileArgs::try_parse_from(&args)
            .map(|a| Magic::Profile(a.mode))
            .map_err(reply),
        "%memhistory" => MemHistoryArgs::try_parse_from(&args)
            .map(|_| Magic::History)
            .map_err(reply),
        "%memsummary" => MemSummaryArgs::try_parse_from(&args)
            .map(|_| Magic::Summary)
            .map_err(reply),
        other => Err(MagicReply::Error(format!(
            "unknown magic {other}; tchmem knows {MAGICS} (each takes --help). \
             evcxr's own commands start with ':' (:help lists them)."
        ))),
    }
}

fn reply(error: clap::Error) -> MagicReply {
    use clap::error::ErrorKind;
    let text = error.render().to_string();
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            MagicReply::Help(text)
        }
        _ => MagicReply::Error(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_percent_lines_are_magics_and_the_rest_is_code() {
        let (magics, rest) = split("%memprofile off\n%memhistory\nlet x = 1;\n");
        assert_eq!(magics, vec!["%memprofile off", "%memhistory"]);
        assert_eq!(rest, "let x = 1;\n");
        let (magics, rest) = split("let y = 5 % 3;");
        assert!(magics.is_empty());
        assert_eq!(rest, "let y = 5 % 3;");
    }

    #[test]
    fn memprofile_modes_help_and_mistakes() {
        assert_eq!(
            parse("%memprofile always"),
            Ok(Magic::Profile(Some(ProfileMode::Always)))
        );
        assert_eq!(parse("%memprofile"), Ok(Magic::Profile(None)));
        assert!(
            matches!(parse("%memprofile --help"), Err(MagicReply::Help(h)) if h.contains("auto"))
        );
        let Err(MagicReply::Error(bad)) = parse("%memprofile sometimes") else {
            panic!()
        };
        assert!(
            bad.contains("invalid value 'sometimes'") && bad.contains("always"),
            "{bad}"
        );
        let Err(MagicReply::Error(flag)) = parse("%memprofile --fast") else {
            panic!()
        };
        assert!(flag.contains("--fast"), "{flag}");
    }

    #[test]
    fn unknown_magics_list_the_known_ones() {
        let Err(MagicReply::Error(message)) = parse("%timeit 1 + 1") else {
            panic!()
        };
        assert!(message.contains("%memprofile") && message.contains("%timeit"));
    }
}
