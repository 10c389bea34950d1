//! Variables evcxr cannot keep between cells (it must name every variable's type): the cell
//! runs again with the type the compiler names written out (and the import rustc suggests for
//! it), or with the variable boxed (`impl Trait` values, closures).

use evcxr::{CommandContext, EvalCallbacks};

use super::streams::{CellOutput, OutputSink, StreamName};
use super::{closures, infer, opaque};

/// Compiles `cell`, a probe that runs nothing (its code sits in `if false { … }`): the compile
/// errors it gives (none when it compiled), or `None` when evcxr failed otherwise.
fn probe(
    context: &mut CommandContext,
    cell: &str,
    what: &str,
) -> Option<Vec<evcxr::CompilationError>> {
    match context.execute(cell) {
        Ok(_) => Some(Vec::new()),
        Err(evcxr::Error::CompilationErrors(errors)) => {
            tracing::debug!(
                "{what}: {:?}",
                errors.iter().map(|e| e.rendered()).collect::<Vec<_>>()
            );
            Some(errors)
        }
        Err(other) => {
            tracing::debug!("{what}: no compile errors to read: {other}");
            None
        }
    }
}

/// When evcxr's analysis could not type a variable the cell defines: the cell with the types
/// the compiler names written out (see [`infer`]), after telling the user; `None` when
/// the compiler cannot help either.
fn typed_by_compiler(
    context: &mut CommandContext,
    code: &str,
    message: &str,
    output: &OutputSink,
) -> Option<String> {
    let variable = infer::unknown_variable(message)?;
    let lets = infer::untyped_lets(code).unwrap_or_default();
    tracing::debug!("type probe for `{variable}`: untyped lets {lets:?}");
    if lets.is_empty() {
        return None;
    }
    let errors = probe(context, &infer::probe_cell(code, &lets), "type probe")?;
    let types: Vec<String> = errors
        .iter()
        .filter(|e| e.code() == Some("E0308"))
        .map(|e| infer::found_type(&e.rendered()))
        .collect::<Option<_>>()?;
    if types.len() != lets.len() {
        return None;
    }
    output(CellOutput::Stream(
        StreamName::Stderr,
        format!(
            "tchmem: the code analysis could not tell the type of `{variable}`; the compiler \
             names {}, so the cell runs with that written out (a type the cell has not \
             imported needs a `use`, or write the type yourself)\n",
            lets.iter()
                .zip(&types)
                .map(|(l, t)| format!("`{}: {t}`", l.probe))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ));
    Some(infer::annotate(code, &lets, &types))
}

/// When evcxr refuses to keep a variable of `impl Trait` type: the cell with it boxed (see
/// [`opaque`]), after telling the user.
fn opaque_boxed(code: &str, message: &str, output: &OutputSink) -> Option<String> {
    let (variable, ty) = opaque::opaque_variable(message)?;
    let boxed = opaque::box_variable(code, variable, ty)?;
    output(CellOutput::Stream(
        StreamName::Stderr,
        format!(
            "tchmem: `{variable}` has type `{ty}`, which cannot be named to keep it between \
             cells: it is kept as `{}`\n",
            opaque::kept_as(ty)
        ),
    ));
    Some(boxed)
}

/// When evcxr refuses to keep a closure bound at the cell's top level: the cell with it boxed
/// (see [`closures`]), after two compiles that run nothing ask rustc its signature and which
/// call trait it implements, and after telling the user; `None` when the compiler cannot name the
/// signature (the user's error then stands).
fn closure_boxed(
    context: &mut CommandContext,
    code: &str,
    message: &str,
    output: &OutputSink,
) -> Option<String> {
    let variable = closures::closure_variable(message)?;
    let found = closures::find(code, variable)?;
    let signature_probe = closures::signature_probe(code, variable, found.arity());
    let signature = probe(context, &signature_probe, "closure probe")?
        .iter()
        .find(|e| e.code() == Some("E0308"))
        .and_then(|e| closures::signature(&e.rendered()))?;
    let callable_probe =
        closures::callable_probe(code, variable, found.arity(), closures::Callable::Fn);
    let errors = probe(context, &callable_probe, "closure callable probe")?;
    // Warnings come too, and evcxr adds an error of its own, without a rendering.
    let errors: Vec<String> = errors
        .iter()
        .filter(|e| e.level() == "error")
        .map(|e| e.rendered())
        .filter(|rendered| !rendered.is_empty() && !rendered.contains(closures::PROBE_STOP))
        .collect();
    let callable = if errors.is_empty() {
        closures::Callable::Fn
    } else {
        errors
            .iter()
            .find_map(|rendered| closures::Callable::from_e0525(rendered))?
    };
    let kept_as = closures::kept_as(&signature, callable);
    output(CellOutput::Stream(
        StreamName::Stderr,
        format!(
            "tchmem: `{variable}` is a closure, whose type cannot be named to keep it between \
             cells: it is kept as `{kept_as}`\n"
        ),
    ));
    Some(closures::boxed(code, &found, &signature, callable))
}

/// The imports rustc suggests where a cell the kernel rewrote (types written out, a value
/// boxed) failed to compile only on types the kernel wrote and the user's cell does not name
/// (rustc names a type by its shortest path, `__m128i`); `None` otherwise, so that a user's own
/// missing import stays the user's error.
fn imports_for_written_types(
    result: &Result<evcxr::EvalOutputs, evcxr::Error>,
    user_code: &str,
) -> Option<Vec<String>> {
    let Err(evcxr::Error::CompilationErrors(errors)) = result else {
        return None;
    };
    // evcxr adds an error of its own, without a rendering, where the cell's failed.
    let mut imports: Vec<String> = errors
        .iter()
        .map(|error| error.rendered())
        .filter(|rendered| !rendered.is_empty())
        .map(|rendered| {
            let (name, path) = infer::suggested_import(&rendered)?;
            (!infer::names(user_code, &name)).then_some(path)
        })
        .collect::<Option<_>>()?;
    imports.sort();
    imports.dedup();
    (!imports.is_empty()).then_some(imports)
}

/// Adds `imports` to the session as a cell of their own (evcxr keeps `use` items for later
/// cells), so that the cell that needs them runs again unchanged and its errors keep their
/// lines; tells the user. Whether they compiled.
fn import(context: &mut CommandContext, imports: &[String], output: &OutputSink) -> bool {
    let lines: String = imports
        .iter()
        .map(|path| format!("use {path};\n"))
        .collect();
    if let Err(error) = context.execute(&lines) {
        tracing::debug!("the suggested imports did not compile: {error}");
        return false;
    }
    let named: Vec<String> = imports.iter().map(|path| format!("`{path}`")).collect();
    output(CellOutput::Stream(
        StreamName::Stderr,
        format!(
            "tchmem: imported {} for the types written out, as the compiler suggests\n",
            named.join(", ")
        ),
    ));
    true
}

/// When the cell failed to compile on a closure that borrows the cell's variables (E0373): the
/// cell again with its top-level closures moved, kept if it compiles (with a note to the user);
/// otherwise the cell's own errors stand, since what it failed on then was not (only) that.
fn borrowing_closures_moved<'a>(
    context: &mut CommandContext,
    compiled: std::borrow::Cow<'a, str>,
    result: Result<evcxr::EvalOutputs, evcxr::Error>,
    callbacks: &mut EvalCallbacks,
    output: &OutputSink,
) -> (
    Result<evcxr::EvalOutputs, evcxr::Error>,
    std::borrow::Cow<'a, str>,
) {
    let borrows = matches!(&result, Err(evcxr::Error::CompilationErrors(errors))
        if errors.iter().any(|e| e.code() == Some("E0373")));
    let Some((moved, names)) = borrows.then(|| closures::moved(&compiled)).flatten() else {
        return (result, compiled);
    };
    let retried = context.execute_with_callbacks(&moved, callbacks);
    if matches!(retried, Err(evcxr::Error::CompilationErrors(_))) {
        tracing::debug!("the cell with its closures moved did not compile either");
        return (result, compiled);
    }
    let named: Vec<String> = names.iter().map(|name| format!("`{name}`")).collect();
    output(CellOutput::Stream(
        StreamName::Stderr,
        format!(
            "tchmem: a closure kept between cells cannot borrow the cell's variables: {} now \
             run as `move` closures, each owning what it uses (a value that is not `Copy` is no \
             longer a variable of its own)\n",
            named.join(", ")
        ),
    ));
    (retried, moved.into())
}

/// Runs the cell again while evcxr cannot keep one of its variables: with the variable's type
/// as the compiler names it, or the variable boxed (one variable per round). `code` is the
/// user's cell; the cell last compiled (what compile errors point into) comes back with the
/// result.
pub fn keep_variables<'a>(
    context: &mut CommandContext,
    code: &str,
    mut compiled: std::borrow::Cow<'a, str>,
    mut result: Result<evcxr::EvalOutputs, evcxr::Error>,
    callbacks: &mut EvalCallbacks,
    output: &OutputSink,
) -> (
    Result<evcxr::EvalOutputs, evcxr::Error>,
    std::borrow::Cow<'a, str>,
) {
    (result, compiled) = borrowing_closures_moved(context, compiled, result, callbacks, output);
    for _ in 0..MAX_KEEP_ROUNDS {
        let Err(evcxr::Error::Message(message)) = &result else {
            break;
        };
        let retried = typed_by_compiler(context, &compiled, message, output)
            .or_else(|| opaque_boxed(&compiled, message, output))
            .or_else(|| closure_boxed(context, &compiled, message, output));
        let Some(retried) = retried else {
            break;
        };
        result = context.execute_with_callbacks(&retried, callbacks);
        if let Some(imports) = imports_for_written_types(&result, code) {
            if import(context, &imports, output) {
                result = context.execute_with_callbacks(&retried, callbacks);
            }
        }
        compiled = retried.into();
    }
    (result, compiled)
}

/// How many times a cell is run again with a variable evcxr cannot keep typed or boxed (one
/// variable per round).
const MAX_KEEP_ROUNDS: usize = 8;
