//! The Jupyter side: sockets, one task per channel, one owner of IOPub.
//!
//! Shell requests are handled one at a time (cells run in order); control requests (interrupt,
//! shutdown) have their own task so they are answered while a cell runs. Every incoming message
//! is signed-checked by `jupyter-zmq-client`; one with a wrong or missing signature, or with
//! garbage frames, is logged and dropped, and the channel carries on.

mod control;
mod decode;
mod evaluator;
mod history;
mod info;
mod iopub;
mod is_complete;
mod shell;
mod shell_loop;
mod stdin;
#[cfg(test)]
mod tests;

use std::path::Path;

use anyhow::Context;
use jupyter_protocol::ConnectionInfo;
use jupyter_zmq_client::{
    create_kernel_control_connection, create_kernel_heartbeat_connection,
    create_kernel_iopub_xpub_connection, create_kernel_shell_connection,
    create_kernel_stdin_connection,
};
use tokio::sync::oneshot;

use crate::engine::Engine;
use decode::next_message;
pub use evaluator::Evaluator;
pub use iopub::Iopub;
use stdin::StdinBridge;

/// Stops the running cell and any input request it waits on.
#[derive(Clone)]
pub struct Interrupter<E> {
    engine: E,
    stdin: StdinBridge,
}

impl<E: Evaluator> Interrupter<E> {
    /// Interrupts the current cell, if any.
    pub fn interrupt(&self) {
        let was_running = self.engine.interrupt();
        self.stdin.cancel();
        tracing::info!("interrupt requested (a cell was running: {was_running})");
    }
}

/// Serves the kernel described by `connection_file` until a shutdown request.
pub async fn serve(connection_file: &Path, engine: Engine) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(connection_file)
        .with_context(|| format!("cannot read connection file {}", connection_file.display()))?;
    let info: ConnectionInfo = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a connection file", connection_file.display()))?;
    if !info.key.is_empty() && info.signature_scheme != "hmac-sha256" {
        anyhow::bail!(
            "unsupported signature scheme {:?}; tchmem supports hmac-sha256",
            info.signature_scheme
        );
    }
    let session = uuid::Uuid::new_v4().to_string();

    let mut heartbeat = create_kernel_heartbeat_connection(&info).await?;
    let shell_socket = create_kernel_shell_connection(&info, &session).await?;
    let control_socket = create_kernel_control_connection(&info, &session).await?;
    let stdin_socket = create_kernel_stdin_connection(&info, &session).await?;
    let iopub = iopub::spawn(create_kernel_iopub_xpub_connection(&info, &session).await?);
    tracing::info!("listening on {} (shell port {})", info.ip, info.shell_port);

    tokio::spawn(async move {
        loop {
            if let Err(error) = heartbeat.single_heartbeat().await {
                tracing::debug!("heartbeat: {error}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    });

    let stdin = stdin::spawn(stdin_socket);
    let interrupter = Interrupter {
        engine: engine.clone(),
        stdin: stdin.clone(),
    };
    spawn_signal_interrupts(interrupter.clone());

    let (shutdown_tx, shutdown_rx) = oneshot::channel();
    tokio::spawn(control::serve(
        control_socket,
        iopub.clone(),
        interrupter,
        shutdown_tx,
    ));

    let shell = shell::Shell::new(engine.clone(), iopub.clone(), stdin);
    let shell_task = tokio::spawn(shell_loop::serve(
        shell,
        iopub,
        shell_loop::ZmqShell::new(shell_socket),
    ));

    let restart = shutdown_rx.await.unwrap_or(false);
    shell_task.abort();
    engine.interrupt();
    tracing::info!("shutting down (restart requested: {restart})");
    Ok(())
}

/// In `signal` interrupt mode Jupyter sends SIGINT; it must interrupt the cell, not end the
/// kernel.
fn spawn_signal_interrupts<E: Evaluator>(interrupter: Interrupter<E>) {
    tokio::spawn(async move {
        let Ok(mut signals) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        else {
            tracing::warn!("cannot listen for SIGINT");
            return;
        };
        while signals.recv().await.is_some() {
            interrupter.interrupt();
        }
    });
}
