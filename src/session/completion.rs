//! Completion answers as Jupyter frontends want them: names to insert as the matches, and what
//! rust-analyzer knows about each (kind, signature) as metadata beside them.
//!
//! evcxr hands back rust-analyzer's insert text, which for functions is a call with the
//! parameter names filled in (`zeros(size, options)`): JupyterLab inserted that literally, and
//! 5,000 such entries made a popup wider than the window.

use evcxr::Completions;
use serde_json::{json, Value};

use super::positions::byte_to_char;
use super::CompletionOutcome;

/// One candidate: the name to insert and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// What the frontend inserts: an identifier (`zeros`), or a macro's name with `!`.
    pub name: String,
    /// rust-analyzer's kind, in Jupyter's words (`function`, `struct`, `module`, …).
    pub kind: String,
    /// The full form (`zeros(size, options)`), for the frontend to show beside the name.
    pub signature: String,
}

/// The name a completion inserts: its leading identifier (with a macro's `!`).
fn name_of(code: &str) -> &str {
    let end = code
        .char_indices()
        .find(|&(_, c)| !(c.is_alphanumeric() || c == '_'))
        .map_or(code.len(), |(i, c)| if c == '!' { i + 1 } else { i });
    if end == 0 {
        code
    } else {
        &code[..end]
    }
}

/// Turns evcxr's completions for `code` into names (once each, in rust-analyzer's order) and
/// their kinds and signatures.
pub fn from_evcxr(found: Completions, code: &str) -> CompletionOutcome {
    let items = found.completions.into_iter().map(|c| (c.code, c.kind));
    from_parts(items, found.start_offset, found.end_offset, code)
}

/// [`from_evcxr`] on its parts: (insert text, kind) pairs and the replaced byte range.
fn from_parts(
    items: impl Iterator<Item = (String, &'static str)>,
    start_byte: usize,
    end_byte: usize,
    code: &str,
) -> CompletionOutcome {
    let mut candidates: Vec<Candidate> = Vec::new();
    for (insert, kind) in items {
        let name = name_of(&insert).to_string();
        if candidates.iter().any(|c| c.name == name) {
            continue;
        }
        candidates.push(Candidate {
            name,
            kind: kind.to_string(),
            signature: insert,
        });
    }
    CompletionOutcome {
        start: byte_to_char(code, start_byte),
        end: byte_to_char(code, end_byte),
        matches: candidates.iter().map(|c| c.name.clone()).collect(),
        candidates,
    }
}

/// The reply's metadata: ipykernel's `_jupyter_types_experimental`, which JupyterLab shows as
/// each item's type.
pub fn metadata(outcome: &CompletionOutcome) -> serde_json::Map<String, Value> {
    let types: Vec<Value> = outcome
        .candidates
        .iter()
        .map(|c| {
            json!({
                "start": outcome.start,
                "end": outcome.end,
                "text": c.name,
                "type": c.kind,
                "signature": c.signature,
            })
        })
        .collect();
    let mut metadata = serde_json::Map::new();
    metadata.insert("_jupyter_types_experimental".into(), Value::Array(types));
    metadata
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(list: &[(&str, &'static str)]) -> impl Iterator<Item = (String, &'static str)> {
        list.iter()
            .map(|(code, kind)| (code.to_string(), *kind))
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn matches_are_names_and_signatures_go_to_metadata() {
        let code = "let x = Tensor::z";
        let outcome = from_parts(
            items(&[
                ("zeros(size, options)", "function"),
                ("zeros_like(self)", "function"),
                ("zero_grad();", "function"),
                ("println!(…)", "function"),
                ("Tensor", "class"),
                ("zeros(size, options)", "function"),
            ]),
            code.len() - 1,
            code.len(),
            code,
        );
        assert_eq!(
            outcome.matches,
            ["zeros", "zeros_like", "zero_grad", "println!", "Tensor"]
        );
        assert_eq!((outcome.start, outcome.end), (16, 17));
        let types = &metadata(&outcome)["_jupyter_types_experimental"];
        assert_eq!(types[0]["signature"], "zeros(size, options)");
        assert_eq!(types[0]["type"], "function");
        assert_eq!(types[4]["text"], "Tensor");
    }

    #[test]
    fn offsets_count_characters_after_non_ascii_text() {
        let code = "// 张量\nTensor::z";
        let outcome = from_parts(
            items(&[("zeros(size, options)", "function")]),
            code.len() - 1,
            code.len(),
            code,
        );
        let chars = code.chars().count();
        assert_eq!((outcome.start, outcome.end), (chars - 1, chars));
    }
}
