//! Watches everything the cells write to stdout on its way to the kernel.
//!
//! A panic inside a cell is caught by evcxr's generated code, which only prints
//! `EVCXR_PANIC_NOTIFICATION` on stdout; evcxr then reports success. To tell the user that the
//! cell failed, the child routes fd 1 through a pipe and a thread that forwards every line while
//! noticing that one. The thread also takes rich output printed the evcxr way out of the text
//! and forwards each block as one message line (see [`super::evcxr_content`]).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};

use tchmem_wire::CellMessage;

use super::evcxr_content::{BlockReader, Piece};

const PANIC_NOTIFICATION: &[u8] = b"EVCXR_PANIC_NOTIFICATION";
/// Written through the pipe after a cell; the tap answers once everything before it is forwarded.
const SYNC_MARKER: &[u8] = b"TCHMEM_STDOUT_SYNC_9f1c";

/// The forwarding end of the pipe that replaced fd 1.
pub struct StdoutTap {
    real_stdout: Arc<Mutex<File>>,
    synced: Receiver<bool>,
    /// Forward evcxr blocks unchanged, for evcxr to collect (see [`StdoutTap::keep_blocks`]).
    keep_blocks: Arc<AtomicBool>,
}

impl StdoutTap {
    /// Replaces fd 1 with a pipe and starts the forwarding thread.
    pub fn install() -> std::io::Result<Self> {
        // SAFETY: plain descriptor juggling on fds this process owns; each result is checked.
        let (real_fd, read_fd) = unsafe {
            let real_fd = check(libc::dup(1))?;
            let mut ends = [0; 2];
            check(libc::pipe(ends.as_mut_ptr()))?;
            check(libc::dup2(ends[1], 1))?;
            libc::close(ends[1]);
            (real_fd, ends[0])
        };
        // SAFETY: both descriptors were just created above and are owned by nobody else.
        let real_stdout = Arc::new(Mutex::new(unsafe { File::from_raw_fd(real_fd) }));
        let pipe = unsafe { File::from_raw_fd(read_fd) };
        let (sync_tx, synced) = mpsc::channel();
        let forward_to = Arc::clone(&real_stdout);
        let keep_blocks = Arc::new(AtomicBool::new(false));
        let keep = Arc::clone(&keep_blocks);
        std::thread::Builder::new()
            .name("stdout-tap".into())
            .spawn(move || forward(pipe, &forward_to, &sync_tx, &keep))?;
        Ok(Self {
            real_stdout,
            synced,
            keep_blocks,
        })
    }

    /// Whether the next cell's evcxr blocks pass unchanged, for evcxr to collect into its
    /// result, instead of becoming message lines. For evcxr's warm-up eval (`42`, run while
    /// the context is created): nothing reads evcxr's stdout channel yet, and evcxr waits for it
    /// to be empty before it returns. Set between cells (after [`StdoutTap::sync`]).
    pub fn keep_blocks(&self, keep: bool) {
        self.keep_blocks.store(keep, Ordering::SeqCst);
    }

    /// Waits until everything written to stdout so far has been forwarded; returns whether a
    /// panic notification passed since the previous call.
    pub fn sync(&self) -> bool {
        let mut marker = SYNC_MARKER.to_vec();
        marker.push(b'\n');
        // Written straight to fd 1 so that no buffer of ours holds it back.
        // SAFETY: writing a valid buffer to fd 1.
        let written = unsafe { libc::write(1, marker.as_ptr().cast(), marker.len()) };
        if written != marker.len() as isize {
            return false;
        }
        self.synced.recv().unwrap_or(false)
    }

    /// Writes lines to the kernel, bypassing the pipe, together: nothing a cell's background
    /// thread prints can land between them.
    pub fn write_lines(&self, lines: &[&str]) {
        self.writer().write_lines(lines);
    }

    /// A handle that writes lines to the kernel from another thread (see
    /// [`StdoutTap::write_lines`]).
    pub fn writer(&self) -> LineWriter {
        LineWriter(Arc::clone(&self.real_stdout))
    }
}

/// Writes whole lines to the kernel, bypassing the pipe (the live view's samples).
#[derive(Clone)]
pub struct LineWriter(Arc<Mutex<File>>);

impl LineWriter {
    /// Writes `lines` at once: no other line lands between them.
    pub fn write_lines(&self, lines: &[&str]) {
        let mut text = lines.join("\n");
        text.push('\n');
        let mut out = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // A broken pipe means the kernel has gone; the next read of stdin ends the child.
        let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
    }
}

fn forward(
    pipe: File,
    real_stdout: &Mutex<File>,
    synced: &mpsc::Sender<bool>,
    keep_blocks: &AtomicBool,
) {
    let mut panicked = false;
    let mut blocks = BlockReader::default();
    let mut pieces = Vec::new();
    for line in BufReader::new(pipe).split(b'\n') {
        let Ok(line) = line else { return };
        if let Some(text) = line.strip_suffix(SYNC_MARKER) {
            // Text the cell printed without a final newline arrives glued to the marker: it is a
            // line of its own. A block still open ends with the cell.
            if !text.is_empty() {
                blocks.line(text, &mut pieces);
            }
            blocks.end(&mut pieces);
            write_pieces(real_stdout, &mut pieces);
            let _ = synced.send(std::mem::take(&mut panicked));
            continue;
        }
        if line == PANIC_NOTIFICATION {
            // evcxr ends a block at a panic too.
            panicked = true;
            blocks.end(&mut pieces);
            pieces.push(Piece::Text(line));
        } else if keep_blocks.load(Ordering::SeqCst) {
            pieces.push(Piece::Text(line));
        } else {
            blocks.line(&line, &mut pieces);
        }
        write_pieces(real_stdout, &mut pieces);
    }
}

/// Forwards `pieces` (emptied) to the kernel: text as lines, blocks as message lines.
fn write_pieces(real_stdout: &Mutex<File>, pieces: &mut Vec<Piece>) {
    if pieces.is_empty() {
        return;
    }
    let mut bytes = Vec::new();
    for piece in pieces.drain(..) {
        match piece {
            Piece::Text(text) => bytes.extend_from_slice(&text),
            Piece::Block { mime, content } => {
                bytes.extend_from_slice(CellMessage::Content { mime, content }.to_line().as_bytes())
            }
        }
        bytes.push(b'\n');
    }
    let mut out = real_stdout.lock().unwrap_or_else(|e| e.into_inner());
    let _ = out.write_all(&bytes).and_then(|_| out.flush());
}

fn check(result: libc::c_int) -> std::io::Result<libc::c_int> {
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}
