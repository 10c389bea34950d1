//! The batch size of a training cell: the one number `%memfit`, `%memestimate` and
//! `%%optimize --fit` vary. Looked for in this order:
//! 1. a `let` or `const` at the top level of the cell (or of the one block the cell is) whose
//!    name contains "batch", bound to an integer literal: `let batch_size: i64 = 16;` (a const
//!    from an earlier cell is brought in front of the cell by [`super::earlier`]);
//! 2. the literal a data iterator is made with: `m.train_iter(256)`, `Iter2::new(xs, ys, 64)`,
//!    `data.iter_shuffle(seq_len, 64)`;
//! 3. the first dimension of the tensors a loop makes with a literal shape
//!    (`Tensor::randn([64, 784], …)`), when every such tensor in the loops has the same one.
//!
//! Literals are replaced in the cell's text (not reprinted), so every other line, comment and
//! line number stays as the user wrote it.

use std::collections::BTreeSet;

use syn::visit::{self, Visit};
use syn::{Expr, Item, Lit, Stmt};

use super::cell::{self, line_of};
use super::syntax::{segments, single_name, strip_parens};
use super::Refusal;

/// The batch size found in a cell: one number, written at one or more places.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchBinding {
    /// What the messages call it: the bound name (`batch_size`), or the call the literal is an
    /// argument of (`train_iter(…)`).
    pub name: String,
    /// Its value in the cell.
    pub value: u64,
    /// The 1-based line of the cell its first place is on.
    pub line: usize,
    /// Where the literal is written (every place has the same value).
    sites: Vec<Site>,
    /// The code a user writes to set it, around the value: `let batch_size = ` and `;`.
    form: (String, String),
}

/// One place a batch literal is written.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Site {
    /// The 1-based line.
    line: usize,
    /// Where the literal's digits are on that line: char columns [start, end).
    columns: (usize, usize),
    /// The literal's suffix (`i64` of `16i64`), kept when the value is replaced.
    suffix: String,
}

impl BatchBinding {
    /// The code that sets the batch to `value`, for suggestions (`let batch_size = 12;`,
    /// `train_iter(12)`).
    pub fn written(&self, value: u64) -> String {
        format!("{}{value}{}", self.form.0, self.form.1)
    }
}

/// What to write in the cell, for the messages.
const HOW: &str = "bind the batch size to a name with `batch` in it, at the top level of the \
                   cell or as a const in an earlier cell, as an integer literal (`let \
                   batch_size: i64 = 16;`), and use that name where the batch is made";

/// The batch size of `src`, or a refusal that says what to write.
pub fn find(src: &str) -> Result<BatchBinding, Refusal> {
    let parsed = cell::parse(src)?;
    // The cell's top level, or the block a cell wraps itself in (so that what it allocates is
    // freed when it ends).
    let stmts = match parsed.block.stmts.as_slice() {
        [Stmt::Expr(Expr::Block(block), _)] => &block.block.stmts,
        stmts => stmts,
    };
    let not_literal = match named(stmts)? {
        Named::Found(binding) => return Ok(binding),
        Named::NotLiteral(refusal) => Some(refusal),
        Named::None => None,
    };
    match literal_sites(&parsed.block) {
        Ok(binding) => Ok(binding),
        // A binding named like the batch but computed says more than "no literal".
        Err(refusal) => Err(not_literal.unwrap_or(refusal)),
    }
}

/// What the named bindings of a cell say about its batch.
enum Named {
    Found(BatchBinding),
    /// Only bindings that are not integer literals: why each cannot be varied.
    NotLiteral(Refusal),
    None,
}

/// The top-level `let`/`const` bindings named like a batch size.
fn named(stmts: &[Stmt]) -> Result<Named, Refusal> {
    let mut found: Vec<BatchBinding> = Vec::new();
    let mut not_literal: Vec<(String, usize)> = Vec::new();
    for stmt in stmts {
        let (name, expr, form) = match stmt {
            Stmt::Local(local) => {
                let Some(init) = &local.init else { continue };
                let Some(name) = single_name(&local.pat) else {
                    continue;
                };
                let form = (format!("let {name} = "), ";".to_string());
                (name, &*init.expr, form)
            }
            Stmt::Item(Item::Const(item)) => {
                let name = item.ident.to_string();
                let ty = quote::ToTokens::to_token_stream(&*item.ty).to_string();
                let form = (format!("const {name}: {ty} = "), ";".to_string());
                (name, &*item.expr, form)
            }
            _ => continue,
        };
        if !name.to_lowercase().contains("batch") {
            continue;
        }
        match int_literal(expr) {
            Some(site) => found.push(BatchBinding {
                name,
                value: site.1,
                line: site.0.line,
                sites: vec![site.0],
                form,
            }),
            None => not_literal.push((name, line_of(syn::spanned::Spanned::span(expr)))),
        }
    }
    match found.len() {
        1 => Ok(Named::Found(found.remove(0))),
        0 => Ok(match not_literal.first() {
            Some((name, line)) => Named::NotLiteral(Refusal::at(
                *line,
                format!("`{name}` is not bound to an integer literal; to vary the batch, {HOW}"),
            )),
            None => Named::None,
        }),
        _ => {
            let preferred: Vec<&BatchBinding> = found
                .iter()
                .filter(|b| matches!(b.name.as_str(), "batch_size" | "batch" | "BATCH_SIZE"))
                .collect();
            if let [one] = preferred.as_slice() {
                return Ok(Named::Found((*one).clone()));
            }
            let names: Vec<String> = found
                .iter()
                .map(|b| format!("`{}` (line {})", b.name, b.line))
                .collect();
            Err(Refusal::at(
                found[1].line,
                format!(
                    "several bindings could be the batch size: {}; name the one that is \
                     `batch_size`",
                    names.join(", ")
                ),
            ))
        }
    }
}

/// A batch literal passed to a data iterator or a tensor factory.
struct Candidate {
    site: Site,
    value: u64,
    /// `train_iter(`, `)`: the call around the literal, for the messages.
    form: (String, String),
    /// An iterator's batch argument (not a tensor's shape).
    iterator: bool,
    /// Inside a loop's body.
    in_loop: bool,
}

/// Tensor factories whose first shape dimension is the batch when data is made in a loop.
const FACTORIES: [&str; 8] = [
    "randn", "rand", "randint", "zeros", "ones", "empty", "full", "randperm",
];

/// The batch from literals: an iterator's batch argument, else the first dimension of the
/// tensors the loops make (the same in all of them).
fn literal_sites(block: &syn::Block) -> Result<BatchBinding, Refusal> {
    struct Finder {
        loops: usize,
        found: Vec<Candidate>,
    }
    impl<'a> Visit<'a> for Finder {
        fn visit_expr(&mut self, expr: &'a Expr) {
            if let Some(candidate) = candidate(expr, self.loops > 0) {
                self.found.push(candidate);
            }
            match expr {
                Expr::ForLoop(l) => {
                    self.visit_expr(&l.expr);
                    self.loops += 1;
                    self.visit_block(&l.body);
                    self.loops -= 1;
                }
                Expr::While(_) | Expr::Loop(_) => {
                    self.loops += 1;
                    visit::visit_expr(self, expr);
                    self.loops -= 1;
                }
                _ => visit::visit_expr(self, expr),
            }
        }
    }
    let mut finder = Finder {
        loops: 0,
        found: Vec::new(),
    };
    finder.visit_block(block);
    let all = finder.found;
    let iterators: Vec<&Candidate> = all.iter().filter(|c| c.iterator).collect();
    let in_loops: Vec<&Candidate> = all.iter().filter(|c| !c.iterator && c.in_loop).collect();
    let chosen = if !iterators.is_empty() {
        iterators
    } else if !in_loops.is_empty() {
        in_loops
    } else {
        all.iter().collect()
    };
    let values: BTreeSet<u64> = chosen.iter().map(|c| c.value).collect();
    match values.len() {
        0 => Err(Refusal::new(
            format!(
                "no batch size found in the cell: {HOW}. A loop whose every step runs on the \
                 same tensors (the whole dataset, a style transfer's image) has no batch to \
                 vary: `%%memprofile` on the cell shows a step's peak and where it goes; where \
                 every step reads a whole dataset through a field (`m.train_images`), \
                 `%%optimize --accumulate K --compare 2` shows what splitting it into K \
                 micro-batches saves"
            ),
            None,
        )),
        1 => {
            let first = chosen[0];
            Ok(BatchBinding {
                name: format!("{}…{}", first.form.0, first.form.1),
                value: first.value,
                line: first.site.line,
                sites: chosen.iter().map(|c| c.site.clone()).collect(),
                form: first.form.clone(),
            })
        }
        _ => {
            let places: Vec<String> = chosen
                .iter()
                .map(|c| {
                    format!(
                        "`{}{}{}` (line {})",
                        c.form.0, c.value, c.form.1, c.site.line
                    )
                })
                .collect();
            Err(Refusal::at(
                chosen[0].site.line,
                format!(
                    "several literals could be the batch size: {}; {HOW}",
                    places.join(", ")
                ),
            ))
        }
    }
}

/// `expr` as a batch literal's call: `x.train_iter(N)`, `x.iter_shuffle(.., N)`,
/// `Iter2::new(xs, ys, N)`, `Tensor::randn([N, ..], ..)`.
fn candidate(expr: &Expr, in_loop: bool) -> Option<Candidate> {
    let iterator = |lit: &Expr, method: &str, before: &str| {
        let (site, value) = int_literal(lit)?;
        Some(Candidate {
            site,
            value,
            form: (format!("{method}({before}"), ")".into()),
            iterator: true,
            in_loop,
        })
    };
    match expr {
        Expr::MethodCall(call) => {
            let method = call.method.to_string();
            match (method.as_str(), call.args.len()) {
                ("train_iter", 1) => iterator(&call.args[0], &method, ""),
                ("iter_shuffle", 2) => iterator(&call.args[1], &method, "…, "),
                _ => None,
            }
        }
        Expr::Call(call) => {
            let Expr::Path(func) = strip_parens(&call.func) else {
                return None;
            };
            let names = segments(&func.path);
            let tail: Vec<&str> = names.iter().rev().take(2).map(String::as_str).collect();
            match tail.as_slice() {
                ["new", "Iter2"] if call.args.len() == 3 => {
                    iterator(&call.args[2], "Iter2::new", "…, …, ")
                }
                [factory, "Tensor"] if FACTORIES.contains(factory) => {
                    let shape = call.args.iter().find_map(shape_array)?;
                    let (site, value) = int_literal(shape.elems.first()?)?;
                    Some(Candidate {
                        site,
                        value,
                        form: (format!("Tensor::{factory}(["), ", …])".into()),
                        iterator: false,
                        in_loop,
                    })
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// The `[..]` (or `&[..]`) array of a factory's arguments: its shape.
fn shape_array(arg: &Expr) -> Option<&syn::ExprArray> {
    match strip_parens(arg) {
        Expr::Array(array) => Some(array),
        Expr::Reference(reference) => match strip_parens(&reference.expr) {
            Expr::Array(array) => Some(array),
            _ => None,
        },
        _ => None,
    }
}

/// `src` with its batch size set to `value`.
#[cfg(test)]
pub fn with_batch(src: &str, value: u64) -> Result<String, Refusal> {
    let binding = find(src)?;
    Ok(replace(src, &binding, value))
}

/// `src` with every place of `binding`'s literal replaced by `value` (same suffixes).
pub fn replace(src: &str, binding: &BatchBinding, value: u64) -> String {
    let mut out = String::with_capacity(src.len() + 8);
    for (i, line) in src.split_inclusive('\n').enumerate() {
        // Right to left, so that a replacement does not move the columns of the next.
        let mut here: Vec<&Site> = binding.sites.iter().filter(|s| s.line == i + 1).collect();
        if here.is_empty() {
            out.push_str(line);
            continue;
        }
        here.sort_by_key(|s| std::cmp::Reverse(s.columns.0));
        let mut chars: Vec<char> = line.chars().collect();
        for site in here {
            let (start, end) = site.columns;
            let end = end.min(chars.len());
            let start = start.min(end);
            chars.splice(start..end, format!("{value}{}", site.suffix).chars());
        }
        out.extend(chars);
    }
    out
}

/// Whether a binding of `name` to `expr` is one `find` takes for the batch size: a name with
/// "batch" in it, bound to an integer literal.
pub(crate) fn is_batch_binding(name: &str, expr: &Expr) -> bool {
    name.to_lowercase().contains("batch") && int_literal(expr).is_some()
}

/// Where an integer literal is written and its value, if `expr` is one (on one line, as
/// integer literals are).
fn int_literal(expr: &Expr) -> Option<(Site, u64)> {
    let Expr::Lit(lit) = strip_parens(expr) else {
        return None;
    };
    let Lit::Int(int) = &lit.lit else { return None };
    let value = int.base10_parse::<u64>().ok()?;
    let span = int.span();
    let (start, end) = (span.start(), span.end());
    let site = Site {
        line: line_of(span),
        columns: (start.column, end.column),
        suffix: int.suffix().to_string(),
    };
    (start.line == end.line).then_some((site, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_binding_is_found_and_replaced_in_place() {
        let src = ":dep rand = \"0.8\"\nlet width = 64;\nlet batch_size: i64 = 16; // per step\n\
                   let x = Tensor::randn([batch_size, width], opts);\n";
        let binding = find(src).unwrap();
        assert_eq!(
            (binding.name.as_str(), binding.value, binding.line),
            ("batch_size", 16, 3)
        );
        let replaced = with_batch(src, 48).unwrap();
        assert_eq!(
            replaced,
            src.replace("batch_size: i64 = 16;", "batch_size: i64 = 48;")
        );
        // Suffixes and consts.
        let src = "const BATCH: i64 = 8_i64;\nlet n = 2;";
        assert_eq!(
            with_batch(src, 100).unwrap(),
            "const BATCH: i64 = 100i64;\nlet n = 2;"
        );
        // Non-ASCII text before the literal on its line.
        let src = "let é_batch = 4; // é\n";
        assert_eq!(with_batch(src, 5).unwrap(), "let é_batch = 5; // é\n");
    }

    #[test]
    fn an_iterators_batch_literal_is_the_batch_when_no_name_is() {
        // mnist's loop, as tch-rs writes it.
        let src = "let vs = nn::VarStore::new(Device::Cpu);\n\
                   for epoch in 1..200 {\n\
                   \x20   for (bimages, blabels) in m.train_iter(256).shuffle().to_device(vs.device()) {\n\
                   \x20       opt.backward_step(&loss);\n\
                   \x20   }\n\
                   }\n";
        let binding = find(src).unwrap();
        assert_eq!((binding.value, binding.line), (256, 3));
        assert_eq!(binding.name, "train_iter(…)");
        assert_eq!(binding.written(12), "train_iter(12)");
        assert_eq!(
            with_batch(src, 12).unwrap(),
            src.replace("train_iter(256)", "train_iter(12)")
        );
        // char-rnn's iterator, and Iter2 with its batch last.
        let binding = find("for b in data.iter_shuffle(seq_len + 1, 64) {}").unwrap();
        assert_eq!(
            (binding.value, binding.written(8)),
            (64, "iter_shuffle(…, 8)".into())
        );
        let src = "for (x, y) in Iter2::new(&xs, &ys, 32_i64).shuffle() {}";
        assert_eq!(with_batch(src, 4).unwrap(), src.replace("32_i64", "4i64"));
    }

    #[test]
    fn the_first_dimension_of_data_made_in_the_loop_is_the_batch() {
        // Weights made outside the loop do not count; every tensor made in it is resized.
        let src = "let w = Tensor::randn([784, 10], opts);\n\
                   for _ in 0..10 {\n\
                   \x20   let x = Tensor::randn([64, 784], opts); let y = Tensor::randint(10, &[64], opts);\n\
                   }\n";
        let binding = find(src).unwrap();
        assert_eq!((binding.value, binding.line), (64, 3));
        assert_eq!(
            with_batch(src, 7).unwrap(),
            src.replace("[64, 784]", "[7, 784]")
                .replace("&[64]", "&[7]")
        );
        // Two different first dimensions: say which, and what to write.
        let two = find("for _ in 0..3 {\n let x = Tensor::randn([8, 4], o);\n let h = Tensor::zeros([2, 8], o);\n}")
            .unwrap_err();
        assert!(
            two.message.contains("`Tensor::randn([8, …])` (line 2)"),
            "{two}"
        );
        assert!(two.message.contains("let batch_size"), "{two}");
        // A named binding wins over literals; a computed one is still said to be computed.
        let named = find("let batch_size = 4;\nfor b in m.train_iter(256) {}").unwrap();
        assert_eq!(
            (named.name.as_str(), named.written(5)),
            ("batch_size", "let batch_size = 5;".into())
        );
        let computed = find("let batch = n * 2;\nfor _ in 0..2 { f(); }").unwrap_err();
        assert!(computed.message.contains("not bound to an integer literal"));
    }

    #[test]
    fn a_missing_or_ambiguous_batch_binding_says_what_to_write() {
        let none = find("let x = 1;\nfor i in 0..3 {}").unwrap_err();
        assert!(none.message.contains("let batch_size: i64 = 16;"), "{none}");
        // A loop with no batch at all is pointed to the magic that measures it as it is.
        assert!(
            none.message
                .contains("has no batch to vary: `%%memprofile`"),
            "{none}"
        );
        let computed = find("let width = 8;\nlet batch = width * 2;").unwrap_err();
        assert_eq!(computed.line, Some(2));
        assert!(computed
            .message
            .contains("`batch` is not bound to an integer literal"));
        let two = find("let train_batch = 4;\nlet eval_batch = 8;").unwrap_err();
        assert!(two.message.contains("`train_batch` (line 1)"), "{two}");
        // The conventional name wins over others.
        let binding = find("let batch_size = 32;\nlet batches = 10;").unwrap();
        assert_eq!(binding.name, "batch_size");
        // Nested bindings are not the cell's batch size, but a cell wrapped in a block is read
        // inside it.
        assert!(find("fn f() { let batch = 3; }").is_err());
        assert!(find("let x = 1;\n{ let batch = 3; }").is_err());
        let src = "{\n    let batch: i64 = 3;\n    run(batch);\n}\n";
        assert_eq!(with_batch(src, 7).unwrap(), src.replace("= 3", "= 7"));
    }
}
