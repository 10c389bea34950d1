//! The shell channel's loop: each request answered between its busy and idle, and requests
//! already queued behind a cell that failed with `stop_on_error` answered "aborted".

use std::time::Duration;

use jupyter_protocol::JupyterMessage;
use jupyter_zmq_client::{KernelShellConnection, RouterRecvConnection, RouterSendConnection};

use super::decode::next_message;
use super::shell::Shell;
use super::{Evaluator, Iopub};

/// How long the shell waits for one more already-queued request after a failed cell before it
/// considers the queue drained.
const QUEUED: Duration = Duration::from_millis(10);

/// The shell socket's two directions, as the loop needs them.
pub trait ShellChannel {
    /// The next request (waits for one).
    fn next(&mut self) -> impl std::future::Future<Output = JupyterMessage> + Send;
    /// The next request if one comes within `wait`.
    fn next_within(
        &mut self,
        wait: Duration,
    ) -> impl std::future::Future<Output = Option<JupyterMessage>> + Send;
    /// Sends a reply.
    fn send(&mut self, reply: JupyterMessage) -> impl std::future::Future<Output = ()> + Send;
}

/// The kernel's shell socket.
pub struct ZmqShell {
    send: RouterSendConnection,
    recv: RouterRecvConnection,
}

impl ZmqShell {
    /// The loop's side of `socket`.
    pub fn new(socket: KernelShellConnection) -> ZmqShell {
        let (send, recv) = socket.split();
        ZmqShell { send, recv }
    }
}

impl ShellChannel for ZmqShell {
    async fn next(&mut self) -> JupyterMessage {
        next_message(&mut self.recv, "shell").await
    }

    async fn next_within(&mut self, wait: Duration) -> Option<JupyterMessage> {
        tokio::time::timeout(wait, next_message(&mut self.recv, "shell"))
            .await
            .ok()
    }

    async fn send(&mut self, reply: JupyterMessage) {
        if let Err(error) = self.send.send(reply).await {
            tracing::warn!("cannot send a shell reply: {error}");
        }
    }
}

/// Serves shell requests on `channel` one at a time, for ever.
pub async fn serve<E: Evaluator>(
    mut shell: Shell<E>,
    iopub: Iopub,
    mut channel: impl ShellChannel,
) {
    loop {
        let request = channel.next().await;
        // As ipykernel: execute requests that were already queued behind a failed cell (Run
        // All) are answered "aborted" instead of run. They are collected before the failed
        // cell's reply goes out, so nothing sent in answer to that reply is caught.
        let queued = iopub
            .with_status(&request, async {
                let reply = shell.handle(&request).await;
                let mut queued = Vec::new();
                if shell.take_abort_queued() {
                    while let Some(next) = channel.next_within(QUEUED).await {
                        queued.push(next);
                    }
                }
                if let Some(reply) = reply {
                    channel.send(reply).await;
                }
                queued
            })
            .await;
        for request in queued {
            iopub
                .with_status(&request, async {
                    let reply = match shell.aborted(&request) {
                        Some(aborted) => Some(aborted),
                        None => shell.handle(&request).await,
                    };
                    if let Some(reply) = reply {
                        channel.send(reply).await;
                    }
                })
                .await;
        }
    }
}
