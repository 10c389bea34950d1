//! Closures bound at a cell's top level, kept anyway.
//!
//! evcxr keeps every top-level variable between cells, so it must write its type, and a
//! closure's type cannot be written: it refuses the cell ("The variable `f` is a closure, which
//! cannot be persisted"). A closure can be kept boxed, as `Box<dyn Fn(A) -> R>`, once its
//! signature is known, and the compiler knows it: the cell is compiled, never run, inside
//! `if false { … }` with the closure passed to a generic function whose return type spells the
//! signature, and rustc names it in the mismatch with `()`. Whether it is `Fn`, `FnMut` or only
//! `FnOnce` takes a second compile (rustc reports E0525 only when the types check). The cell
//! then runs with the `let` boxed and its untyped parameters typed as the compiler inferred them
//! (a closure coerced to `dyn Fn(&T)` needs its parameters written to accept every lifetime).

use syn::spanned::Spanned;
use syn::{Expr, Pat};

use super::top_let::{self, TopLet};

/// The variable named by evcxr's "The variable `f` is a closure, which cannot be persisted."
pub fn closure_variable(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("The variable `")?;
    let (variable, rest) = rest.split_once('`')?;
    rest.starts_with(" is a closure").then_some(variable)
}

/// A top-level `let name = |…| …;`, as offsets into the cell; its marks are just after each
/// parameter's pattern, for those without a type (`None`: typed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClosureLet(TopLet);

impl ClosureLet {
    /// How many parameters the closure takes.
    pub fn arity(&self) -> usize {
        self.0.marks.len()
    }
}

/// The top-level `let variable = <closure>;` of the cell, if it has one.
pub fn find(code: &str, variable: &str) -> Option<ClosureLet> {
    top_let::find(code, variable, untyped_params).map(ClosureLet)
}

/// Where a type goes after each untyped parameter of a closure; `None` for another value.
fn untyped_params(value: &Expr) -> Option<Vec<Option<proc_macro2::LineColumn>>> {
    let Expr::Closure(closure) = value else {
        return None;
    };
    Some(
        closure
            .inputs
            .iter()
            .map(|param| (!matches!(param, Pat::Type(_))).then(|| param.span().end()))
            .collect(),
    )
}

/// The cell with `move` written before each closure bound at its top level that borrows (no
/// `move`), and those closures' names; `None` when it has none, or when one of them changes a
/// variable from outside it (`steps += 1`, `&mut v`): moved, it would change its own copy of an
/// integer while the cell's stays as it was, with no error. A closure kept between cells cannot
/// borrow the cell's variables (rustc's E0373, "closure may outlive the current function"), as
/// tch-rs's examples' closures over a dataset do once pasted into a cell; moved, it owns what it
/// uses.
pub fn moved(code: &str) -> Option<(String, Vec<String>)> {
    let found = top_let::all(code, borrowing_closure)?;
    let mut code = code.to_string();
    let mut names = Vec::new();
    // From the last, so that earlier offsets stay where they were.
    for (name, closure) in found.into_iter().rev() {
        // No position: the closure changes a variable from outside it.
        let at = closure.marks.first().copied().flatten()?;
        code.insert_str(at, "move ");
        names.insert(0, name);
    }
    (!names.is_empty()).then_some((code, names))
}

/// For a closure that borrows (no `move`): where `move` goes (its first `|`), or no position
/// when it changes a variable from outside it; `None` for another value.
fn borrowing_closure(value: &Expr) -> Option<Vec<Option<proc_macro2::LineColumn>>> {
    let Expr::Closure(closure) = value else {
        return None;
    };
    closure
        .capture
        .is_none()
        .then(|| vec![(!changes_outside(closure)).then(|| closure.or1_token.span().start())])
}

/// Whether `closure` assigns to, or borrows mutably, a variable it does not bind itself.
fn changes_outside(closure: &syn::ExprClosure) -> bool {
    use syn::visit::Visit;
    #[derive(Default)]
    struct Changes {
        bound: Vec<String>,
        changed: Vec<String>,
    }
    /// The variable an assignment's target or a `&mut` names (`v`, `v.field`, `v[i]`).
    fn root(expr: &Expr) -> Option<String> {
        match expr {
            Expr::Path(path) => path.path.get_ident().map(ToString::to_string),
            Expr::Field(field) => root(&field.base),
            Expr::Index(index) => root(&index.expr),
            Expr::Paren(paren) => root(&paren.expr),
            _ => None,
        }
    }
    impl<'a> Visit<'a> for Changes {
        fn visit_pat_ident(&mut self, pat: &'a syn::PatIdent) {
            self.bound.push(pat.ident.to_string());
            syn::visit::visit_pat_ident(self, pat);
        }
        fn visit_expr_assign(&mut self, assign: &'a syn::ExprAssign) {
            self.changed.extend(root(&assign.left));
            syn::visit::visit_expr_assign(self, assign);
        }
        fn visit_expr_binary(&mut self, binary: &'a syn::ExprBinary) {
            if crate::cell_syntax::is_compound_assign(&binary.op) {
                self.changed.extend(root(&binary.left));
            }
            syn::visit::visit_expr_binary(self, binary);
        }
        fn visit_expr_reference(&mut self, reference: &'a syn::ExprReference) {
            if reference.mutability.is_some() {
                self.changed.extend(root(&reference.expr));
            }
            syn::visit::visit_expr_reference(self, reference);
        }
    }
    let mut changes = Changes::default();
    changes.visit_expr_closure(closure);
    changes
        .changed
        .iter()
        .any(|name| !changes.bound.contains(name))
}

/// Generic parameters `A0, A1, …` for a closure of `arity` parameters.
fn generics(arity: usize) -> String {
    (0..arity)
        .map(|i| format!("A{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The cell, never run, with `variable` handed to a function whose type names its signature.
pub fn signature_probe(code: &str, variable: &str, arity: usize) -> String {
    let args = generics(arity);
    let comma = if arity == 0 { "" } else { ", " };
    format!(
        "{{ if false {{\n{code}\n;\n\
         fn __tchmem_signature<{args}{comma}R, F: FnOnce({args}) -> R>(_: &F) \
         -> ::std::marker::PhantomData<fn({args}) -> R> {{ ::std::marker::PhantomData }}\n\
         let _: () = __tchmem_signature(&{variable});\n}} }}"
    )
}

/// The cell, never run, asking whether `variable` is callable as `callable`: rustc's E0525 says
/// when it is not, and names what it is. It never compiles: evcxr commits a cell that compiles,
/// and a cell whose closure moves an earlier cell's variable (`move || v.len()`) moves it out of
/// the session, run or not. The error that stops it, [`PROBE_STOP`], is in a function of its own,
/// so the cell's own body is checked as it would be without it (E0525 needs its types to check).
pub fn callable_probe(code: &str, variable: &str, arity: usize, callable: Callable) -> String {
    let args = generics(arity);
    let comma = if arity == 0 { "" } else { ", " };
    format!(
        "{{ if false {{\n{code}\n;\n\
         fn __tchmem_callable<{args}{comma}R, F: {}({args}) -> R>(_: &F) {{}}\n\
         __tchmem_callable(&{variable});\n}}\n\
         fn __tchmem_probe_stop() {{ let {PROBE_STOP}: () = 0u8; }}\n}}",
        callable.trait_name()
    )
}

/// The name in the error that keeps a probe from compiling (see [`callable_probe`]).
pub const PROBE_STOP: &str = "__tchmem_probe_stops_here";

/// A closure's signature, as rustc writes its types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    pub params: Vec<String>,
    /// `None`: it returns `()`.
    pub output: Option<String>,
}

/// The signature rustc names in the probe's mismatch (`PhantomData<fn(&Tensor, i64) -> Tensor>`),
/// if every type in it is one a program can write.
pub fn signature(rendered: &str) -> Option<Signature> {
    // The note names types by their paths (`tch::Tensor`), which need no `use`; the label
    // by their names.
    let start = rendered
        .find("found struct `PhantomData<fn(")
        .map(|at| at + "found struct `".len())
        .or_else(|| rendered.find("PhantomData<fn("))?
        + "PhantomData<".len();
    // A literal's type not fixed by its use is the one Rust falls back to.
    let text = balanced(&rendered[start..])?
        .replace("{integer}", "i32")
        .replace("{float}", "f64");
    let text = text.as_str();
    let parsed: syn::TypeBareFn = syn::parse_str(text).ok()?;
    let writable = !text.contains('{') && !text.contains("impl ") && !has_infer(&parsed);
    let params = split_top_level(params_text(text)?);
    if !writable || parsed.inputs.len() != params.len() {
        return None;
    }
    let output = match parsed.output {
        syn::ReturnType::Default => None,
        syn::ReturnType::Type(..) => Some(output_text(text)?.to_string()),
    };
    Some(Signature {
        params: params.into_iter().map(str::to_string).collect(),
        output,
    })
}

/// `text` up to the `>` that closes the `<` before it.
fn balanced(text: &str) -> Option<&str> {
    let mut depth = 0i32;
    for (i, c) in text.char_indices() {
        match c {
            '<' | '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            // `->` is an arrow, not a closing angle bracket.
            '>' if text[..i].ends_with('-') => {}
            '>' if depth == 0 => return Some(&text[..i]),
            '>' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// Between `fn(` and the parenthesis that closes it.
fn params_text(bare_fn: &str) -> Option<&str> {
    let inner = bare_fn.strip_prefix("fn(")?;
    let mut depth = 0i32;
    for (i, c) in inner.char_indices() {
        match c {
            '<' | '(' | '[' => depth += 1,
            '>' if inner[..i].ends_with('-') => {}
            '>' | ']' => depth -= 1,
            ')' if depth == 0 => return Some(&inner[..i]),
            ')' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// After `fn(…) -> `.
fn output_text(bare_fn: &str) -> Option<&str> {
    let params = params_text(bare_fn)?;
    bare_fn["fn(".len() + params.len()..].strip_prefix(") -> ")
}

/// `text` split at the commas outside brackets, each part trimmed; empty text has no parts.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '<' | '(' | '[' => depth += 1,
            '>' if text[..i].ends_with('-') => {}
            '>' | ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if !text[start..].trim().is_empty() {
        parts.push(text[start..].trim());
    }
    parts
}

/// Whether a `_` (a type rustc could not infer) is in `ty`.
fn has_infer(ty: &syn::TypeBareFn) -> bool {
    use syn::visit::Visit;
    struct Finder(bool);
    impl<'a> Visit<'a> for Finder {
        fn visit_type_infer(&mut self, _: &'a syn::TypeInfer) {
            self.0 = true;
        }
    }
    let mut finder = Finder(false);
    finder.visit_type_bare_fn(ty);
    finder.0
}

/// Which of the call traits a closure is boxed as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callable {
    Fn,
    FnMut,
    FnOnce,
}

impl Callable {
    fn trait_name(self) -> &'static str {
        match self {
            Callable::Fn => "Fn",
            Callable::FnMut => "FnMut",
            Callable::FnOnce => "FnOnce",
        }
    }

    /// What rustc's E0525 says the closure only implements.
    pub fn from_e0525(rendered: &str) -> Option<Callable> {
        let named = rendered
            .split("this closure only implements `")
            .nth(1)?
            .split('`')
            .next()?;
        match named {
            "FnMut" => Some(Callable::FnMut),
            "FnOnce" => Some(Callable::FnOnce),
            _ => None,
        }
    }
}

/// The type the closure is kept as.
pub fn kept_as(signature: &Signature, callable: Callable) -> String {
    let output = signature
        .output
        .as_ref()
        .map(|o| format!(" -> {o}"))
        .unwrap_or_default();
    format!(
        "Box<dyn {}({}){output}>",
        callable.trait_name(),
        signature.params.join(", ")
    )
}

/// The cell with the closure's `let` boxed as `kept_as(signature, callable)` and its untyped
/// parameters typed.
pub fn boxed(code: &str, found: &ClosureLet, signature: &Signature, callable: Callable) -> String {
    // Insertions from the end, so that earlier offsets stay right.
    let found = &found.0;
    let mut inserts: Vec<(usize, String)> = vec![
        (
            found.pattern_end,
            format!(": {}", kept_as(signature, callable)),
        ),
        (found.value.0, "Box::new(".to_string()),
        (found.value.1, ")".to_string()),
    ];
    for (at, ty) in found.marks.iter().zip(&signature.params) {
        if let Some(at) = at {
            inserts.push((*at, format!(": {ty}")));
        }
    }
    inserts.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    let mut code = code.to_string();
    for (at, text) in inserts {
        code.insert_str(at, &text);
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_evcxr_message() {
        let message = "The variable `f` is a closure, which cannot be persisted.\nYou can however \
                       persist closures if you box them.";
        assert_eq!(closure_variable(message), Some("f"));
        assert_eq!(
            closure_variable("The variable `m` has type `impl Fn()`"),
            None
        );
    }

    #[test]
    fn signatures_are_read_from_rustc_with_nested_types() {
        let rendered = "error[E0308]: mismatched types\n = note: expected unit type `()`\n\
                        found struct `PhantomData<fn(&Tensor, (i64, Vec<f32>), [u8; 2]) -> \
                        Result<Vec<Tensor>, TchError>>`";
        assert_eq!(
            signature(rendered),
            Some(Signature {
                params: vec!["&Tensor".into(), "(i64, Vec<f32>)".into(), "[u8; 2]".into()],
                output: Some("Result<Vec<Tensor>, TchError>".into()),
            })
        );
        // The note's paths are preferred to the label's names; literals take Rust's fallback.
        let rendered = "expected `()`, found `PhantomData<fn(&Tensor, {float}) -> {integer}>`\n\
                        = note: expected unit type `()`\n     found struct \
                        `PhantomData<fn(&tch::Tensor, {float}) -> {integer}>`";
        assert_eq!(
            signature(rendered).map(|s| (s.params, s.output)),
            Some((
                vec!["&tch::Tensor".into(), "f64".into()],
                Some("i32".into())
            ))
        );
        let unit = signature("found struct `PhantomData<fn()>`").unwrap();
        assert_eq!((unit.params.len(), unit.output), (0, None));
        let returns_fn = signature("`PhantomData<fn(i64) -> fn(i64) -> i64>`").unwrap();
        assert_eq!(returns_fn.output.as_deref(), Some("fn(i64) -> i64"));
        // Types rustc could not infer, or cannot write, are not guessed.
        assert_eq!(signature("`PhantomData<fn(_) -> _>`"), None);
        assert_eq!(
            signature("`PhantomData<fn() -> {closure@src/lib.rs:3:9}>`"),
            None
        );
    }

    #[test]
    fn the_let_is_boxed_and_untyped_parameters_typed() {
        let code = "// 张量\nlet scale = 2.0;\nlet f = move |x: &Tensor, k| -> Tensor { x * k * scale };\nf";
        let found = find(code, "f").unwrap();
        assert_eq!(found.arity(), 2);
        let signature = Signature {
            params: vec!["&Tensor".into(), "f64".into()],
            output: Some("Tensor".into()),
        };
        assert_eq!(
            boxed(code, &found, &signature, Callable::Fn),
            "// 张量\nlet scale = 2.0;\nlet f: Box<dyn Fn(&Tensor, f64) -> Tensor> = \
             Box::new(move |x: &Tensor, k: f64| -> Tensor { x * k * scale });\nf"
        );
        let counter = "let mut n = 0;\nlet mut bump = move || { n += 1; n };";
        let found = find(counter, "bump").unwrap();
        let signature = Signature {
            params: vec![],
            output: Some("i32".into()),
        };
        assert!(boxed(counter, &found, &signature, Callable::FnMut)
            .ends_with("let mut bump: Box<dyn FnMut() -> i32> = Box::new(move || { n += 1; n });"));
        assert_eq!(find("let f = make_adder(1);", "f"), None);
        assert_eq!(find("{ let f = |x: i64| x; }", "f"), None);
    }

    #[test]
    fn closures_that_borrow_are_moved_and_named() {
        let code =
            "let n = 3;\nlet f = || n + 1;\nlet g = move |x: i32| x;\nlet h = |x: i32| x * n;";
        let (written, names) = moved(code).unwrap();
        assert_eq!(
            written,
            "let n = 3;\nlet f = move || n + 1;\nlet g = move |x: i32| x;\nlet h = move |x: i32| x * n;"
        );
        assert_eq!(names, ["f", "h"]);
        assert_eq!(moved("let g = move || 1;\n{ let k = || 2; }"), None);
        // Moved, a closure that changes a counter of the cell would change its own copy.
        assert_eq!(
            moved("let mut steps = 0;\nlet tick = || { steps += 1; };"),
            None
        );
        assert_eq!(
            moved("let mut v = vec![];\nlet push = || (&mut v).push(1);"),
            None
        );
        // What it binds itself it may change.
        let own = "let n = 2;\nlet f = |k: i32| { let mut t = k; t += n; t };";
        assert!(moved(own).is_some());
    }

    #[test]
    fn probes_name_the_variable_and_e0525_the_trait() {
        let probe = signature_probe("let f = |a, b| a + b;", "f", 2);
        assert!(probe.contains("F: FnOnce(A0, A1) -> R"), "{probe}");
        assert!(probe.contains("let _: () = __tchmem_signature(&f);"));
        assert!(callable_probe("let g = || 1;", "g", 0, Callable::Fn).contains("F: Fn() -> R"));
        let e0525 = "error[E0525]: expected a closure that implements the `Fn` trait, but this \
                     closure only implements `FnMut`";
        assert_eq!(Callable::from_e0525(e0525), Some(Callable::FnMut));
        assert_eq!(Callable::from_e0525("mismatched types"), None);
    }
}
