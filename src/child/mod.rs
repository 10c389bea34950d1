//! The child process that loads and runs compiled cells.
//!
//! evcxr compiles each cell into a shared library and asks a child process to run it with a line
//! `LOAD_AND_RUN <library> <function>` on the child's stdin; the child answers with the cell's
//! output and a final `EVCXR_EXECUTION_COMPLETE` line. evcxr ships such a loop, but we run our
//! own so that native code runs before and after every cell without an extra compile: this is
//! where the kernel learns whether the cell panicked and, later, what it did to memory.
//!
//! The protocol is evcxr 0.22's internal one (pinned exactly in Cargo.toml).

mod cell_hooks;
mod evcxr_content;
mod interrupt;
mod live;
mod rank_lines;
mod runtime_slot;
mod stdout_tap;
pub mod world;

use std::ffi::c_void;
use std::io::BufRead;

use crate::libtorch::CudaLibrary;
use cell_hooks::CellHooks;
use rank_lines::EXECUTION_COMPLETE;
use stdout_tap::StdoutTap;

/// Environment variable that makes this binary act as the cell-running child.
pub const CHILD_ENV: &str = "TCHMEM_CHILD";

/// The function evcxr builds first, for its warm-up eval of `42`.
const WARM_UP_FUNCTION: &str = "run_user_code_0";

/// True when this process was started by the engine to run cells.
pub fn is_child_process() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// Runs the child loop until stdin closes; never returns.
pub fn run() -> ! {
    if let Some(ranks) = world::ranks_from_env() {
        world::run(ranks);
    }
    // libtorch_cuda (and the CUDA libraries under it) takes seconds to load: it loads while
    // evcxr compiles its warm-up and the prelude, and every cell but the warm-up waits for it.
    let mut cuda = CudaLoad::start();
    let tap = match StdoutTap::install() {
        Ok(tap) => tap,
        Err(error) => {
            eprintln!("tchmem child: cannot watch stdout: {error}");
            exit_now(98);
        }
    };
    interrupt::install();
    let mut hooks = CellHooks::new(tap);
    // Libraries are never unloaded: a cell's thread-locals and statics may outlive its call.
    let mut libraries: Vec<libloading::Library> = Vec::new();
    let mut variable_store: *mut c_void = std::ptr::null_mut();
    loop {
        // The lock is taken per line and released before user code runs: cells read stdin too
        // (evcxr's input requests are answered on it).
        let mut line = String::new();
        match std::io::stdin().lock().read_line(&mut line) {
            Ok(0) => exit_now(0),
            Ok(_) => {}
            Err(error) => {
                eprintln!("tchmem child: reading stdin: {error}");
                exit_now(99);
            }
        }
        let Some((library_path, function)) = parse_load_and_run(line.trim_end()) else {
            eprintln!("tchmem child: unrecognised instruction {line:?}");
            exit_now(99);
        };
        if function != WARM_UP_FUNCTION {
            if let Some(loaded) = cuda.finish() {
                hooks.set_cuda_library(loaded);
            }
        }
        // SAFETY: the library was just compiled by evcxr from the user's cell; running its code
        // is the point of this process.
        let library = match unsafe { libloading::Library::new(library_path) } {
            Ok(library) => library,
            Err(error) => {
                eprintln!("tchmem child: cannot load {library_path}: {error:?}");
                exit_now(99);
            }
        };
        // SAFETY: evcxr generates this function with exactly this signature.
        let cell: libloading::Symbol<extern "C" fn(*mut c_void) -> *mut c_void> =
            match unsafe { library.get(function.as_bytes()) } {
                Ok(cell) => cell,
                Err(error) => {
                    eprintln!("tchmem child: cannot find {function} in {library_path}: {error}");
                    exit_now(99);
                }
            };
        // evcxr's warm-up eval is the first function it builds (`run_user_code_0`): its output is
        // left for evcxr, which collects it before anyone reads its stdout channel. (After
        // `:clear` the numbering starts again: that cell's rich output goes to its result, as in
        // evcxr.)
        hooks.keep_evcxr_blocks(function == WARM_UP_FUNCTION);
        hooks.before_cell();
        variable_store = cell(variable_store);
        hooks.after_cell();
        hooks.write_line(EXECUTION_COMPLETE);
        libraries.push(library);
    }
}

/// Ends the child without running the process's exit handlers. libtorch_cuda may still be
/// loading on its thread (a kernel shut down within seconds of its start), and the exit handlers
/// of CUDA's static runtime then race its registration: seen as an abort, a 7 s exit, and a
/// child left spinning on two cores after its kernel was gone. Nothing is left to write: every
/// cell's output was flushed before its completion line.
fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: _exit ends the process at once; no Rust state is observed after it.
    unsafe { libc::_exit(code) }
}

/// libtorch_cuda loading on a thread of its own (or loaded here when no thread could be
/// started), its result handed over once.
enum CudaLoad {
    Loading(std::thread::JoinHandle<CudaLibrary>),
    Loaded(CudaLibrary),
    HandedOver,
}

impl CudaLoad {
    fn start() -> CudaLoad {
        std::thread::Builder::new()
            .name("load-libtorch-cuda".into())
            .spawn(crate::libtorch::load_cuda_globally)
            .map_or_else(
                |_| CudaLoad::Loaded(crate::libtorch::load_cuda_globally()),
                CudaLoad::Loading,
            )
    }

    /// The load's result the first time it is asked for (waiting for it); `None` after that.
    fn finish(&mut self) -> Option<CudaLibrary> {
        match std::mem::replace(self, CudaLoad::HandedOver) {
            CudaLoad::Loading(handle) => Some(
                handle
                    .join()
                    .unwrap_or_else(|_| CudaLibrary::Failed("its loading thread panicked".into())),
            ),
            CudaLoad::Loaded(library) => Some(library),
            CudaLoad::HandedOver => None,
        }
    }
}

/// Splits `LOAD_AND_RUN <library> <function>`.
fn parse_load_and_run(line: &str) -> Option<(&str, &str)> {
    let mut parts = line.strip_prefix("LOAD_AND_RUN ")?.split(' ');
    let (library, function) = (parts.next()?, parts.next()?);
    (parts.next().is_none() && !library.is_empty() && !function.is_empty())
        .then_some((library, function))
}

#[cfg(test)]
mod tests {
    use super::parse_load_and_run;

    #[test]
    fn parses_the_evcxr_instruction() {
        assert_eq!(
            parse_load_and_run("LOAD_AND_RUN /tmp/x/libcode_3.so run_user_code_3"),
            Some(("/tmp/x/libcode_3.so", "run_user_code_3"))
        );
        assert_eq!(parse_load_and_run("LOAD_AND_RUN /tmp/x.so"), None);
        assert_eq!(parse_load_and_run("RUN /tmp/x.so f"), None);
    }
}
