//! Completions of paths (`tch::Tensor::`, `tch::nn::`) remembered from the code analysis, for
//! the moments it cannot answer at once: while it loads the crate graph after a start (seconds:
//! a frontend gives up after one), and while a cell runs on the engine thread.
//!
//! A path's members depend only on the crates cells use, so they are kept in a file under the
//! compile slots' root (shared by every slot, written by `tchmem prepare` too) and keyed by the
//! prelude that declared those crates: a start after set-up answers its first Tab from the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::completion::Candidate;
use super::positions::{byte_to_char, char_to_byte};
use super::CompletionOutcome;

/// The paths remembered at a start (the analysis is asked for each once it has loaded).
pub const WARM_PATHS: [&str; 8] = [
    "tch::",
    "tch::Tensor::",
    "tch::nn::",
    "tch::Kind::",
    "tch::Device::",
    "tch::vision::",
    "tchmem::",
    "std::collections::",
];

/// The crates whose paths are remembered: their members change only with the prelude (a cell's
/// own modules change with every cell).
const REMEMBERED_CRATES: [&str; 5] = ["tch", "tchmem", "std", "core", "alloc"];

/// The file's name, under the slots' root.
const FILE_NAME: &str = "completion-paths.json";

/// What the file holds.
#[derive(Default, Serialize, Deserialize)]
struct Stored {
    /// The prelude the members were found under.
    key: String,
    /// Each path (ending in `::`) with its members, in the analysis' order.
    paths: BTreeMap<String, Vec<StoredCandidate>>,
}

#[derive(Clone, Serialize, Deserialize)]
struct StoredCandidate {
    name: String,
    kind: String,
    signature: String,
}

/// The remembered paths of one set of crates.
pub struct PathCompletions {
    file: Option<PathBuf>,
    stored: Mutex<Stored>,
}

/// A path at a cursor: `tch::Tensor::ze` is the path `tch::Tensor::` and the partial `ze`.
#[derive(Debug, PartialEq, Eq)]
pub struct PathAt<'a> {
    /// The path up to its last `::`, included.
    pub path: &'a str,
    /// What is typed after it.
    pub partial: &'a str,
    /// Byte offset of the partial in the code.
    pub partial_start: usize,
}

/// The path that ends at byte `cursor` of `code`, if the text there is one.
pub fn path_at(code: &str, cursor: usize) -> Option<PathAt<'_>> {
    let before = code.get(..cursor)?;
    let start = before
        .char_indices()
        .rev()
        .take_while(|&(_, c)| c.is_alphanumeric() || c == '_' || c == ':')
        .last()
        .map_or(cursor, |(i, _)| i);
    let word = &before[start..];
    let split = word.rfind("::")? + 2;
    let path = &word[..split];
    let first = path.chars().next()?;
    let well_formed = (first.is_alphabetic() || first == '_')
        && path[..split - 2]
            .split("::")
            .all(|segment| !segment.is_empty() && !segment.contains(':'));
    (well_formed && !word[split..].contains(':')).then(|| PathAt {
        path,
        partial: &word[split..],
        partial_start: start + split,
    })
}

impl PathCompletions {
    /// The paths remembered under `root` for `key` (none when the file is missing, unreadable or
    /// of another prelude). `root` `None` keeps them in memory only.
    pub fn load(root: Option<&Path>, key: &str) -> PathCompletions {
        let file = root.map(|root| root.join(FILE_NAME));
        let stored = file
            .as_ref()
            .and_then(|file| std::fs::read(file).ok())
            .and_then(|bytes| serde_json::from_slice::<Stored>(&bytes).ok())
            .filter(|stored| stored.key == key)
            .unwrap_or_else(|| Stored {
                key: key.to_string(),
                paths: BTreeMap::new(),
            });
        PathCompletions {
            file,
            stored: Mutex::new(stored),
        }
    }

    fn stored(&self) -> std::sync::MutexGuard<'_, Stored> {
        self.stored.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `path`'s members are remembered.
    pub fn knows(&self, path: &str) -> bool {
        self.stored().paths.contains_key(path)
    }

    /// The path at the cursor (a character index) when it is one of a remembered crate that
    /// is not remembered yet.
    pub fn unseen_path(&self, code: &str, cursor: usize) -> Option<String> {
        let at = path_at(code, char_to_byte(code, cursor))?;
        let krate = at.path.split("::").next().unwrap_or_default();
        (REMEMBERED_CRATES.contains(&krate) && !self.knows(at.path)).then(|| at.path.to_string())
    }

    /// An answer from the remembered members when `code` has a known path at the cursor (a
    /// character index): those whose names start with what is typed (ignoring case), in the
    /// analysis' order. `None` otherwise.
    pub fn answer(&self, code: &str, cursor: usize) -> Option<CompletionOutcome> {
        let byte = char_to_byte(code, cursor);
        let at = path_at(code, byte)?;
        let stored = self.stored();
        let members = stored.paths.get(at.path)?;
        let partial = at.partial.to_lowercase();
        let candidates: Vec<Candidate> = members
            .iter()
            .filter(|c| c.name.to_lowercase().starts_with(&partial))
            .map(|c| Candidate {
                name: c.name.clone(),
                kind: c.kind.clone(),
                signature: c.signature.clone(),
            })
            .collect();
        Some(CompletionOutcome {
            matches: candidates.iter().map(|c| c.name.clone()).collect(),
            start: byte_to_char(code, at.partial_start),
            end: cursor,
            candidates,
        })
    }

    /// Remembers `path`'s members (the analysis' answer for the path with nothing typed after
    /// it) and writes the file. An empty answer is not kept: the analysis may not have loaded.
    pub fn remember(&self, path: &str, members: &[Candidate]) {
        if members.is_empty() {
            return;
        }
        let json = {
            let mut stored = self.stored();
            stored.paths.insert(
                path.to_string(),
                members
                    .iter()
                    .map(|c| StoredCandidate {
                        name: c.name.clone(),
                        kind: c.kind.clone(),
                        signature: c.signature.clone(),
                    })
                    .collect(),
            );
            serde_json::to_vec(&*stored)
        };
        if let (Some(file), Ok(json)) = (&self.file, json) {
            // Written aside and renamed: kernels in other slots read the same file.
            let aside = file.with_extension(format!("json.{}", std::process::id()));
            let written = std::fs::write(&aside, json).and_then(|()| std::fs::rename(&aside, file));
            if let Err(error) = written {
                tracing::debug!("could not keep completions in {}: {error}", file.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(name: &str) -> Candidate {
        Candidate {
            name: name.into(),
            kind: "function".into(),
            signature: format!("{name}(…)"),
        }
    }

    #[test]
    fn finds_the_path_and_the_partial_at_the_cursor() {
        let code = "let t = tch::Tensor::ze";
        assert_eq!(
            path_at(code, code.len()),
            Some(PathAt {
                path: "tch::Tensor::",
                partial: "ze",
                partial_start: code.len() - 2
            })
        );
        assert_eq!(path_at("x.ze", 4), None);
        assert_eq!(path_at("tch", 3), None);
        assert_eq!(path_at("a:::b", 5), None);
        assert_eq!(path_at("::b", 3), None);
        let empty = path_at("tch::", 5).unwrap();
        assert_eq!((empty.path, empty.partial), ("tch::", ""));
    }

    #[test]
    fn answers_known_paths_by_prefix_in_the_analysis_order() {
        let paths = PathCompletions::load(None, "prelude");
        assert!(paths.answer("tch::Tensor::ze", 15).is_none());
        paths.remember(
            "tch::Tensor::",
            &[
                candidate("zeros"),
                candidate("sum"),
                candidate("Zeta"),
                candidate("zero_"),
            ],
        );
        let code = "// 张量\ntch::Tensor::ze";
        let cursor = code.chars().count();
        let answer = paths.answer(code, cursor).unwrap();
        assert_eq!(answer.matches, ["zeros", "Zeta", "zero_"]);
        assert_eq!((answer.start, answer.end), (cursor - 2, cursor));
        assert_eq!(answer.candidates[0].signature, "zeros(…)");
        assert!(paths.answer("tch::nn::Li", 11).is_none());
        assert_eq!(
            paths.unseen_path("tch::nn::Li", 11).as_deref(),
            Some("tch::nn::")
        );
        assert_eq!(paths.unseen_path("tch::Tensor::z", 14), None);
        assert_eq!(paths.unseen_path("my_module::f", 12), None);
    }

    #[test]
    fn the_file_is_shared_and_belongs_to_one_prelude() {
        let root = std::env::temp_dir().join(format!("tchmem-paths-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let first = PathCompletions::load(Some(&root), "prelude A");
        first.remember("tch::nn::", &[candidate("Linear")]);
        first.remember("tch::Kind::", &[]);
        let again = PathCompletions::load(Some(&root), "prelude A");
        assert!(again.knows("tch::nn::"));
        assert!(!again.knows("tch::Kind::"));
        assert_eq!(again.answer("tch::nn::Li", 11).unwrap().matches, ["Linear"]);
        let other = PathCompletions::load(Some(&root), "prelude B");
        assert!(!other.knows("tch::nn::"));
        std::fs::remove_dir_all(root).unwrap();
    }
}
