//! Where an allocation was made, in the notebook's words: the first frame of its stack that is
//! in a cell's code, as "cell [7], line 4: model.forward(&xs)".
//!
//! Cells are compiled by evcxr into one generated crate (`src/lib.rs` of the compile
//! directory), which holds the running cell's code and the items of earlier cells. Frames carry
//! that file's lines (cells are built with line tables while stacks are recorded); each
//! generated line is found again, by its text, in the cells the kernel ran.

use std::collections::HashMap;

use super::snapshot::Frame;

/// The cells' code, for mapping generated lines back to cells.
#[derive(Debug, Clone, Default)]
pub struct CellSources {
    /// The generated crate's source as it was when the timeline's cell ran.
    generated: Vec<String>,
    /// Each line's text (trimmed) → where it came from: (execution count, 1-based line). A
    /// line in several cells counts as the latest cell's, and within it as its first.
    cell_lines: HashMap<String, (usize, usize)>,
}

/// Whether a frame's file is the generated crate's source (not a dependency's `src/lib.rs`).
/// libtorch's fast symbolizer gives the path as the line table has it, relative to the compile
/// directory, sometimes short of its first characters (on libtorch 2.11: "rc/lib.rs" for
/// "src/lib.rs", "root/.rustup/…" for "/root/.rustup/…").
fn is_generated(frame: &Frame) -> bool {
    let file = frame.filename.as_str();
    (file.len() >= "lib.rs".len() && "src/lib.rs".ends_with(file))
        || (file.ends_with("/src/lib.rs")
            && !["/registry/", "/vendor/", "/rustlib/"]
                .iter()
                .any(|dir| file.contains(dir)))
}

/// A Rust symbol as people write it: legacy mangling's escapes decoded and the hash dropped
/// (`ctx::run_user_code_6::_$u7b$$u7b$closure$u7d$$u7d$::hf08272eb2955fe30` →
/// `ctx::run_user_code_6::{{closure}}`).
pub fn readable_symbol(name: &str) -> String {
    let mut name = name;
    if let Some((head, hash)) = name.rsplit_once("::h") {
        if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) {
            name = head;
        }
    }
    const ESCAPES: [(&str, &str); 15] = [
        ("$u7b$", "{"),
        ("$u7d$", "}"),
        ("$LT$", "<"),
        ("$GT$", ">"),
        ("$u20$", " "),
        ("$RF$", "&"),
        ("$BP$", "*"),
        ("$C$", ","),
        ("$LP$", "("),
        ("$RP$", ")"),
        ("$u27$", "'"),
        ("$u5b$", "["),
        ("$u5d$", "]"),
        ("$u7e$", "~"),
        ("$SP$", "@"),
    ];
    // An escape at the start of a path segment comes with a `_` (`::_$u7b$`, `_$LT$`).
    let mut text = name.replace("::_$", "::$");
    if let Some(rest) = text.strip_prefix("_$") {
        text = format!("${rest}");
    }
    for (from, to) in ESCAPES {
        text = text.replace(from, to);
    }
    text.replace("..", "::")
}

impl CellSources {
    /// The sources: the generated crate's lines, and the code of the cells run so far, by
    /// execution count, the timeline's cell last.
    pub fn new(generated: Vec<String>, cells: &[(usize, String)]) -> CellSources {
        let mut cell_lines = HashMap::new();
        for (count, code) in cells.iter().rev() {
            for (i, line) in code.lines().enumerate() {
                let text = line.trim();
                if !text.is_empty() {
                    cell_lines
                        .entry(text.to_string())
                        .or_insert((*count, i + 1));
                }
            }
        }
        CellSources {
            generated,
            cell_lines,
        }
    }

    /// The cell line of generated line `line` (1-based): (execution count, line, text).
    fn find(&self, line: i64) -> Option<(usize, usize, String)> {
        let text = self
            .generated
            .get(usize::try_from(line).ok()?.checked_sub(1)?)?;
        let wanted = text.trim();
        if wanted.is_empty() {
            return None;
        }
        let &(count, line) = self.cell_lines.get(wanted)?;
        Some((count, line, wanted.to_string()))
    }

    /// The site of an allocation with `frames` (innermost first).
    pub fn site(&self, frames: &[Frame]) -> Option<String> {
        for frame in frames.iter().filter(|f| is_generated(f) && f.line > 0) {
            if let Some((count, line, text)) = self.find(frame.line) {
                return Some(format!("cell [{count}], line {line}: {text}"));
            }
        }
        // Without line tables: the cell's function (evcxr's `run_user_code_N`) or the innermost
        // frame outside libtorch, by name; allocations of autograd's own threads say so.
        frames
            .iter()
            .find(|f| f.name.contains("run_user_code"))
            .or_else(|| frames.iter().find(|f| is_user_symbol(&f.name)))
            .map(|f| readable_symbol(&f.name))
            .or_else(|| {
                frames
                    .iter()
                    .any(|f| f.name.contains("torch::autograd::Engine"))
                    .then(|| "autograd's backward pass (on its own thread)".to_string())
            })
    }
}

/// A frame worth naming when no line is known: not libtorch, the C++ or Rust runtime, nor
/// tch's generated bindings.
fn is_user_symbol(name: &str) -> bool {
    const SKIP: [&str; 5] = ["c10::", "at::", "torch::", "tch::wrappers", "torch_sys"];
    const START: [&str; 7] = ["std::", "__", "atg_", "core::", "alloc::", "_start", "??"];
    !name.is_empty()
        && !SKIP.iter().any(|p| name.contains(p))
        && !START.iter().any(|p| name.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: &str, filename: &str, line: i64) -> Frame {
        Frame {
            name: name.into(),
            filename: filename.into(),
            line,
        }
    }

    #[test]
    fn a_generated_line_is_named_by_the_cell_and_line_it_came_from() {
        let sources = CellSources::new(
            vec![
                "fn forward(x: &Tensor) -> Tensor {".into(),
                "    x.relu()".into(),
                "}".into(),
                "pub extern \"C\" fn run_user_code_3() {".into(),
                "let y = forward(&x);".into(),
            ],
            &[
                (
                    2,
                    "fn forward(x: &Tensor) -> Tensor {\n    x.relu()\n}".into(),
                ),
                (3, "\n// comment\nlet y = forward(&x);".into()),
            ],
        );
        // As libtorch 2.11's fast symbolizer names them (a character short, at times).
        let frames = [
            frame("at::relu", "/opt/torch/lib/libtorch_cpu.so", 107658604),
            frame("ctx::forward::h0123456789abcdef", "rc/lib.rs", 2),
            frame("core::ops::function::FnOnce::call_once", "root/.rustup/toolchains/stable/lib/rustlib/src/rust/library/core/src/ops/function.rs", 250),
            frame("ctx::run_user_code_3", "src/lib.rs", 5),
        ];
        assert_eq!(
            sources.site(&frames).as_deref(),
            Some("cell [2], line 2: x.relu()")
        );
        assert_eq!(
            sources.site(&frames[3..]).as_deref(),
            Some("cell [3], line 3: let y = forward(&x);")
        );
    }

    #[test]
    fn without_line_tables_the_cell_function_is_named() {
        let sources = CellSources::default();
        let frames = [
            frame("c10::cuda::alloc", "??", 0),
            frame("tch::wrappers::tensor::Tensor::relu", "??", 0),
            frame("ctx::run_user_code_7", "??", 0),
        ];
        assert_eq!(
            sources.site(&frames).as_deref(),
            Some("ctx::run_user_code_7")
        );
        assert_eq!(
            readable_symbol(
                "ctx::run_user_code_6::_$u7b$$u7b$closure$u7d$$u7d$::hf08272eb2955fe30"
            ),
            "ctx::run_user_code_6::{{closure}}"
        );
        assert_eq!(
            readable_symbol("_$LT$tch..nn..linear..Linear$u20$as$u20$tch..nn..module..Module$GT$::forward::h0123456789abcdef"),
            "<tch::nn::linear::Linear as tch::nn::module::Module>::forward"
        );
        let backward = [
            frame(
                "void torch::autograd::validate_outputs_impl<torch::autograd::Edge>(…)",
                "",
                0,
            ),
            frame("torch::autograd::Engine::thread_main(…)", "", 0),
        ];
        assert_eq!(
            sources.site(&backward).as_deref(),
            Some("autograd's backward pass (on its own thread)")
        );
        let registry = [frame(
            "tch::nn::linear",
            "/root/.cargo/registry/src/x/tch/src/lib.rs",
            9,
        )];
        assert!(!is_generated(&registry[0]));
    }
}
