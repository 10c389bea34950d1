//! `%` magics: lines at the top of a cell that talk to the kernel instead of running as Rust.
//!
//! Each magic's arguments are parsed by clap, so `--help` and error messages are uniform. Rust
//! code never starts with `%`, so a cell's leading `%` lines are always magics; the rest of the
//! cell, if any, runs as usual. A cell magic (`%%optimize`) is the first line of its cell and
//! takes the rest of the cell as its body: see [`cell_magic`].

pub mod distributed;
pub mod fit;
pub mod memprofile;
pub mod optimize;

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
    /// `%memprofile timeline on|off`: record a timeline for every later cell (or stop).
    Timeline(bool),
    /// `%memsnapshot PATH`: write the last timeline's snapshot pickle to PATH.
    Snapshot(String),
    /// `%memhistory`: the records of every cell so far.
    History,
    /// `%memsummary`: the allocator's counters after the last cell, as a table.
    Summary,
    /// `%memfree`: empty the allocator's cache.
    Free,
}

/// What a magic line produced when it is not a magic to apply.
#[derive(Debug, PartialEq, Eq)]
pub enum MagicReply {
    /// Help text (`--help`): shown, not an error.
    Help(String),
    /// A mistake: unknown magic, bad flag or value; the message says what to do.
    Error(String),
}

/// Show or set when the memory summary appears after a cell, or (`timeline on|off`) record an
/// allocation timeline for every later cell, as `%%memprofile` does for one.
#[derive(Parser)]
#[command(
    name = "%memprofile",
    no_binary_name = true,
    disable_version_flag = true,
    after_help = "Examples:\n  %memprofile always\n  %memprofile timeline on"
)]
struct MemProfileArgs {
    /// auto: after cells that changed memory; always: after every cell; off: never; timeline:
    /// allocation timelines for later cells (with on or off).
    mode: Option<ProfileArg>,
    /// After `timeline`: on or off.
    #[arg(value_name = "on|off")]
    switch: Option<Switch>,
}

/// `%memprofile`'s first argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ProfileArg {
    /// After cells that changed memory.
    Auto,
    /// After every cell.
    Always,
    /// Never.
    Off,
    /// Allocation timelines for later cells: `timeline on` or `timeline off`.
    Timeline,
}

/// on | off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Switch {
    /// Start.
    On,
    /// Stop.
    Off,
}

fn profile_magic(args: MemProfileArgs) -> Result<Magic, MagicReply> {
    let mode = |mode| match args.switch {
        None => Ok(Magic::Profile(Some(mode))),
        Some(_) => Err(MagicReply::Error(
            "%memprofile takes on|off only after `timeline` (%memprofile timeline on)".into(),
        )),
    };
    match args.mode {
        None => Ok(Magic::Profile(None)),
        Some(ProfileArg::Auto) => mode(ProfileMode::Auto),
        Some(ProfileArg::Always) => mode(ProfileMode::Always),
        Some(ProfileArg::Off) => mode(ProfileMode::Off),
        Some(ProfileArg::Timeline) => match args.switch {
            Some(switch) => Ok(Magic::Timeline(switch == Switch::On)),
            None => Err(MagicReply::Error(
                "say `%memprofile timeline on` or `%memprofile timeline off`".into(),
            )),
        },
    }
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

const MAGICS: &str = "%memprofile, %memhistory, %memsummary, %memsnapshot, %memestimate, \
                      %memfit, %memfree, %%memprofile, %%optimize, %%distributed";

/// Line magics that act on the training cell below them (the rest of the cell), or, with
/// nothing below, on the last training cell that ran.
const TRAINING_CELL_MAGICS: [&str; 2] = ["%memestimate", "%memfit"];

/// A cell magic and the code it applies to.
#[derive(Debug, PartialEq, Eq)]
pub struct CellMagicSource<'a> {
    /// The magic line, from `%%` (e.g. `%%optimize --amp bf16`).
    pub line: &'a str,
    /// The rest of the cell.
    pub body: &'a str,
    /// How many lines of the cell come before the body (line N of the body is line
    /// N + `body_offset` of the cell).
    pub body_offset: usize,
}

/// A parsed cell magic.
#[derive(Debug, PartialEq, Eq)]
pub enum CellMagic {
    /// `%%optimize …`: rewrite the training loop in the body.
    Optimize(optimize::OptimizeRequest),
    /// `%%memprofile …`: record the body's allocation timeline.
    MemProfile(memprofile::MemProfileRequest),
    /// `%memestimate …`: predict the training cell's peak.
    Estimate(fit::EstimateRequest),
    /// `%memfit …`: find the largest batch that fits.
    Fit(fit::FitRequest),
    /// `%%distributed --procs N`: run the body in N ranks of one process group.
    Distributed(distributed::DistributedRequest),
}

/// The cell magic of a cell whose first non-blank line starts with `%%`, if it has one.
pub fn cell_magic(cell: &str) -> Option<CellMagicSource<'_>> {
    let mut offset = 0;
    let mut rest = cell;
    loop {
        let (line, after) = match rest.split_once('\n') {
            Some((line, after)) => (line, Some(after)),
            None => (rest, None),
        };
        let trimmed = line.trim();
        let name = trimmed.split_whitespace().next().unwrap_or_default();
        if trimmed.starts_with("%%") || TRAINING_CELL_MAGICS.contains(&name) {
            return Some(CellMagicSource {
                line: trimmed,
                body: after.unwrap_or(""),
                body_offset: offset + 1,
            });
        }
        if !trimmed.is_empty() {
            return None;
        }
        offset += 1;
        rest = after?;
    }
}

/// Parses a cell magic's line; the body must hold code.
pub fn parse_cell(source: &CellMagicSource<'_>) -> Result<CellMagic, MagicReply> {
    let mut words = source.line.split_whitespace();
    let name = words.next().unwrap_or_default();
    let args: Vec<&str> = words.collect();
    match name {
        "%%optimize" => {
            let request = optimize::parse_args(&args)?;
            if source.body.trim().is_empty() {
                return Err(MagicReply::Error(
                    "%%optimize rewrites the training loop below it, in the same cell; this \
                     cell has nothing after the %%optimize line. Put the loop's code under it."
                        .to_string(),
                ));
            }
            Ok(CellMagic::Optimize(request))
        }
        "%%memprofile" => {
            let request = memprofile::parse_args(&args)?;
            if source.body.trim().is_empty() {
                return Err(MagicReply::Error(
                    "%%memprofile records the code below it, in the same cell; this cell has \
                     nothing after the %%memprofile line."
                        .to_string(),
                ));
            }
            Ok(CellMagic::MemProfile(request))
        }
        "%%distributed" => {
            let request = distributed::parse_args(&args)?;
            if source.body.trim().is_empty() {
                return Err(MagicReply::Error(
                    "%%distributed runs the code below it, in the same cell, in every rank; this \
                     cell has nothing after the %%distributed line."
                        .to_string(),
                ));
            }
            Ok(CellMagic::Distributed(request))
        }
        "%memestimate" | "%%memestimate" => fit::parse_estimate(&args).map(CellMagic::Estimate),
        "%memfit" | "%%memfit" => fit::parse_fit(&args).map(CellMagic::Fit),
        other => Err(MagicReply::Error(format!(
            "unknown cell magic {other}; tchmem knows %%memprofile, %%optimize and \
             %%distributed (each takes --help). Line magics ({MAGICS}) start with a single %."
        ))),
    }
}

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
            .map_err(reply)
            .and_then(profile_magic),
        "%memsnapshot" => memprofile::parse_snapshot(&args).map(Magic::Snapshot),
        "%memhistory" => MemHistoryArgs::try_parse_from(&args)
            .map(|_| Magic::History)
            .map_err(reply),
        "%memsummary" => MemSummaryArgs::try_parse_from(&args)
            .map(|_| Magic::Summary)
            .map_err(reply),
        "%memfree" => fit::parse_free(&args).map(|_| Magic::Free),
        "%memestimate" | "%memfit" => Err(MagicReply::Error(format!(
            "{name} acts on a training cell: put it on the first line of the cell with the \
             loop (or alone in a cell, for the last training cell that ran)"
        ))),
        cell if cell.starts_with("%%") => Err(MagicReply::Error(format!(
            "{cell} is a cell magic: put it on the first line of the cell, above the code it \
             applies to"
        ))),
        other => Err(MagicReply::Error(format!(
            "unknown magic {other}; tchmem knows {MAGICS} (each takes --help). \
             evcxr's own commands start with ':' (:help lists them)."
        ))),
    }
}

pub(crate) fn reply(error: clap::Error) -> MagicReply {
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
        assert_eq!(parse("%memprofile timeline on"), Ok(Magic::Timeline(true)));
        assert_eq!(
            parse("%memprofile timeline off"),
            Ok(Magic::Timeline(false))
        );
        assert!(
            matches!(parse("%memprofile timeline"), Err(MagicReply::Error(e)) if e.contains("timeline on"))
        );
        assert!(matches!(
            parse("%memprofile always on"),
            Err(MagicReply::Error(_))
        ));
        assert_eq!(
            parse("%memsnapshot /tmp/a.pickle"),
            Ok(Magic::Snapshot("/tmp/a.pickle".into()))
        );
    }

    #[test]
    fn cell_magics_take_the_rest_of_the_cell() {
        let source = cell_magic("\n%%optimize --amp bf16\nlet x = 1;\nlet y = 2;\n").unwrap();
        assert_eq!(source.line, "%%optimize --amp bf16");
        assert_eq!(source.body, "let x = 1;\nlet y = 2;\n");
        assert_eq!(source.body_offset, 2);
        assert!(matches!(parse_cell(&source), Ok(CellMagic::Optimize(_))));
        assert_eq!(cell_magic("let x = 1;\n%%optimize"), None);
        assert_eq!(cell_magic("%memprofile off\nlet x = 1;"), None);
        assert_eq!(cell_magic(""), None);
        let Err(MagicReply::Error(empty)) =
            parse_cell(&cell_magic("%%optimize --amp bf16\n  \n").unwrap())
        else {
            panic!()
        };
        assert!(empty.contains("nothing after"), "{empty}");
        let Err(MagicReply::Error(unknown)) = parse_cell(&cell_magic("%%timeit\n1").unwrap())
        else {
            panic!()
        };
        assert!(unknown.contains("%%optimize"), "{unknown}");
        assert!(matches!(
            parse_cell(&cell_magic("%%optimize --help\n").unwrap()),
            Err(MagicReply::Help(_))
        ));
        let Err(MagicReply::Error(misplaced)) = parse("%%optimize --amp bf16") else {
            panic!()
        };
        assert!(misplaced.contains("first line"), "{misplaced}");
    }

    #[test]
    fn unknown_magics_list_the_known_ones() {
        let Err(MagicReply::Error(message)) = parse("%timeit 1 + 1") else {
            panic!()
        };
        assert!(message.contains("%memprofile") && message.contains("%timeit"));
    }
}
