//! Watches everything the cells write to stdout on its way to the kernel.
//!
//! A panic inside a cell is caught by evcxr's generated code, which only prints
//! `EVCXR_PANIC_NOTIFICATION` on stdout; evcxr then reports success. To tell the user that the
//! cell failed, the child routes fd 1 through a pipe and a thread that forwards every line
//! unchanged while noticing that one.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::FromRawFd;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};

const PANIC_NOTIFICATION: &[u8] = b"EVCXR_PANIC_NOTIFICATION";
/// Written through the pipe after a cell; the tap answers once everything before it is forwarded.
const SYNC_MARKER: &[u8] = b"TCHMEM_STDOUT_SYNC_9f1c";

/// The forwarding end of the pipe that replaced fd 1.
pub struct StdoutTap {
    real_stdout: Arc<Mutex<File>>,
    synced: Receiver<bool>,
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
        std::thread::Builder::new()
            .name("stdout-tap".into())
            .spawn(move || forward(pipe, &forward_to, &sync_tx))?;
        Ok(Self {
            real_stdout,
            synced,
        })
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
        let mut text = lines.join("\n");
        text.push('\n');
        let mut out = self.real_stdout.lock().unwrap_or_else(|e| e.into_inner());
        // A broken pipe means the kernel has gone; the next read of stdin ends the child.
        let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
    }
}

fn forward(pipe: File, real_stdout: &Mutex<File>, synced: &mpsc::Sender<bool>) {
    let mut panicked = false;
    for line in BufReader::new(pipe).split(b'\n') {
        let Ok(mut line) = line else { return };
        if line.ends_with(SYNC_MARKER) {
            // Text the cell printed without a final newline arrives glued to the marker: pass it
            // on as a line of its own.
            let text = &line[..line.len() - SYNC_MARKER.len()];
            if !text.is_empty() {
                let mut out = real_stdout.lock().unwrap_or_else(|e| e.into_inner());
                let _ = out.write_all(text).and_then(|_| out.write_all(b"\n"));
                let _ = out.flush();
            }
            let _ = synced.send(std::mem::take(&mut panicked));
            continue;
        }
        panicked |= line == PANIC_NOTIFICATION;
        line.push(b'\n');
        let mut out = real_stdout.lock().unwrap_or_else(|e| e.into_inner());
        let _ = out.write_all(&line).and_then(|_| out.flush());
    }
}

fn check(result: libc::c_int) -> std::io::Result<libc::c_int> {
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}
