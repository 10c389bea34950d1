//! The shell channel: requests handled one at a time, each wrapped in busy/idle.

use std::sync::Arc;

use jupyter_protocol::{
    ClearOutput, CommInfoReply, CompleteReply, DisplayData, ErrorOutput, ExecuteInput,
    ExecuteReply, ExecuteRequest, ExecuteResult, ExecutionCount, HistoryReply, InspectReply,
    IsCompleteReply, IsCompleteReplyStatus, JupyterMessage, JupyterMessageContent, Media, Payload,
    ReplyError, ReplyStatus, Stdio, Transient, UpdateDisplayData,
};
use serde_json::{Map, Value};

use super::evaluator::Evaluator;
use super::history::History;
use super::is_complete::{judge, Completeness};
use super::stdin::StdinBridge;
use super::{info, Iopub};
use crate::cell_error::ErrorName;
use crate::engine::{CellError, CellIo, CellOutcome, CellOutput, InputFn, OutputSink, StreamName};

/// State of the shell channel.
pub struct Shell<E> {
    engine: E,
    iopub: Iopub,
    stdin: StdinBridge,
    execution_count: ExecutionCount,
    history: History,
    /// Set when a cell failed with `stop_on_error`: requests already queued are aborted.
    abort_queued: bool,
}

impl<E: Evaluator> Shell<E> {
    /// A shell handler that runs cells on `engine`.
    pub fn new(engine: E, iopub: Iopub, stdin: StdinBridge) -> Self {
        Self {
            engine,
            iopub,
            stdin,
            execution_count: ExecutionCount::new(0),
            history: History::default(),
            abort_queued: false,
        }
    }

    /// Whether the last cell failed with `stop_on_error`, so that execute requests already
    /// waiting should be aborted (cleared by reading it).
    pub fn take_abort_queued(&mut self) -> bool {
        std::mem::take(&mut self.abort_queued)
    }

    /// The reply to an execute request that is not run because an earlier cell failed.
    pub fn aborted(&self, request: &JupyterMessage) -> Option<JupyterMessage> {
        let JupyterMessageContent::ExecuteRequest(_) = &request.content else {
            return None;
        };
        let reply = ExecuteReply {
            status: ReplyStatus::Aborted,
            execution_count: self.execution_count,
            payload: Vec::new(),
            user_expressions: Some(Default::default()),
            error: None,
        };
        Some(JupyterMessage::new(reply, Some(request)))
    }

    /// Handles one request; returns the reply to send on the shell socket.
    pub async fn handle(&mut self, request: &JupyterMessage) -> Option<JupyterMessage> {
        let reply: JupyterMessageContent = match &request.content {
            JupyterMessageContent::KernelInfoRequest(_) => {
                JupyterMessageContent::KernelInfoReply(Box::new(info::kernel_info()))
            }
            JupyterMessageContent::ExecuteRequest(execute) => {
                self.execute(request, execute).await.into()
            }
            JupyterMessageContent::CompleteRequest(complete) => {
                let found = self
                    .engine
                    .complete(complete.code.clone(), complete.cursor_pos)
                    .await
                    .unwrap_or_default();
                let metadata = crate::engine::completion_metadata(&found);
                CompleteReply {
                    matches: found.matches,
                    cursor_start: found.start,
                    cursor_end: found.end,
                    metadata,
                    status: ReplyStatus::Ok,
                    error: None,
                }
                .into()
            }
            JupyterMessageContent::InspectRequest(inspect) => {
                let found = self
                    .engine
                    .inspect(inspect.code.clone(), inspect.cursor_pos)
                    .await
                    .unwrap_or_default();
                let data = if found.plain.is_empty() {
                    Media::default()
                } else {
                    media([
                        ("text/plain", Value::String(found.plain)),
                        ("text/html", Value::String(found.html)),
                    ])
                };
                InspectReply {
                    found: !data.content.is_empty(),
                    data,
                    metadata: Map::new(),
                    status: ReplyStatus::Ok,
                    error: None,
                }
                .into()
            }
            // Docs: https://jupyter-client.readthedocs.io/en/stable/messaging.html#code-completeness
            JupyterMessageContent::IsCompleteRequest(is_complete) => match judge(&is_complete.code)
            {
                Completeness::Complete => IsCompleteReply::complete(),
                Completeness::Incomplete(indent) => IsCompleteReply::incomplete(indent),
                Completeness::Invalid => {
                    IsCompleteReply::new(IsCompleteReplyStatus::Invalid, String::new())
                }
            }
            .into(),
            JupyterMessageContent::HistoryRequest(history) => {
                HistoryReply::new(self.history.query(history)).into()
            }
            JupyterMessageContent::CommInfoRequest(_) => CommInfoReply {
                status: ReplyStatus::Ok,
                comms: Default::default(),
                error: None,
            }
            .into(),
            other => {
                tracing::info!("unsupported shell request {}", other.message_type());
                return None;
            }
        };
        Some(JupyterMessage::new(reply, Some(request)))
    }

    async fn execute(&mut self, parent: &JupyterMessage, request: &ExecuteRequest) -> ExecuteReply {
        let silent = request.silent;
        if request.store_history && !silent {
            self.execution_count.increment();
        }
        let count = self.execution_count;
        if !silent {
            self.iopub.publish(
                ExecuteInput {
                    code: request.code.clone(),
                    execution_count: count,
                },
                parent,
            );
        }
        let io = CellIo {
            output: self.output_sink(parent, silent),
            input: request.allow_stdin.then(|| self.input_fn(parent)),
        };
        let mut outcome = self
            .engine
            .execute(request.code.clone(), io)
            .await
            .unwrap_or_else(|_| CellOutcome {
                error: Some(CellError::new(
                    ErrorName::KernelError,
                    "the engine stopped unexpectedly",
                )),
                ..Default::default()
            });
        if request.store_history && !silent {
            let plain = outcome.data.get("text/plain").cloned().unwrap_or_default();
            self.history.record(&request.code, &plain);
        }
        let mut reply = ExecuteReply {
            status: ReplyStatus::Ok,
            execution_count: count,
            payload: Vec::new(),
            user_expressions: Some(Default::default()),
            error: None,
        };
        if let Some(error) = outcome.error.clone() {
            if !silent {
                self.iopub.publish(
                    ErrorOutput {
                        ename: error.ename.to_string(),
                        evalue: error.evalue.clone(),
                        traceback: error.traceback.clone(),
                    },
                    parent,
                );
            }
            reply.status = ReplyStatus::Error;
            self.abort_queued = request.stop_on_error;
            reply.error = Some(Box::new(ReplyError {
                ename: error.ename.to_string(),
                evalue: error.evalue,
                traceback: error.traceback,
            }));
        } else if !outcome.page.is_empty() && !silent {
            // Help goes to the pager, as ipykernel sends `?`: a `page` payload, which JupyterLab
            // shows under the cell (and records as an output) and Notebook 6 in its pager. It
            // is not also published, or JupyterLab would show it twice.
            // Docs: https://jupyter-client.readthedocs.io/en/stable/messaging.html#payloads-deprecated
            reply.payload.push(Payload::Page {
                data: media(outcome.take_page()),
                start: 0,
            });
        }
        if outcome.error.is_none() && !outcome.data.is_empty() && !silent {
            let data = media(outcome.take_result());
            let mut result = ExecuteResult::new(count, data);
            // Protocol validators want an object here, never null.
            result.transient = Some(Transient::default());
            self.iopub.publish(result, parent);
        }
        if let (Some(display), false) = (outcome.memory_display, silent) {
            self.iopub.publish(
                DisplayData {
                    data: media(display.data),
                    metadata: display.metadata,
                    transient: Some(Transient::default()),
                },
                parent,
            );
        }
        // Everything the cell published precedes its reply.
        self.iopub.flush().await;
        reply
    }

    fn output_sink(&self, parent: &JupyterMessage, silent: bool) -> OutputSink {
        let iopub = self.iopub.clone();
        let parent = parent.clone();
        Arc::new(move |output| {
            if silent {
                return;
            }
            match output {
                CellOutput::Stream(name, text) => {
                    let name = match name {
                        StreamName::Stdout => Stdio::Stdout,
                        StreamName::Stderr => Stdio::Stderr,
                    };
                    iopub.stream(&parent, name, text);
                }
                CellOutput::ClearOutput { wait } => {
                    iopub.publish(ClearOutput { wait }, &parent);
                }
                // The cells layer turns samples into the live view's displays.
                CellOutput::Live(_) => {}
                CellOutput::Display(display) => {
                    let data = media(display.data);
                    match display.display_id {
                        Some(id) if display.update => iopub.publish(
                            UpdateDisplayData {
                                data,
                                metadata: display.metadata,
                                transient: Transient {
                                    display_id: Some(id),
                                },
                            },
                            &parent,
                        ),
                        id => iopub.publish(
                            DisplayData {
                                data,
                                metadata: display.metadata,
                                transient: Some(Transient { display_id: id }),
                            },
                            &parent,
                        ),
                    }
                }
            }
        })
    }

    fn input_fn(&self, parent: &JupyterMessage) -> InputFn {
        let stdin = self.stdin.clone();
        let parent = parent.clone();
        Box::new(move |prompt, password| stdin.ask_blocking(&parent, prompt, password))
    }
}

/// A Media bundle from MIME → value pairs.
fn media<K: Into<String>>(entries: impl IntoIterator<Item = (K, Value)>) -> Media {
    let map: Map<String, Value> = entries.into_iter().map(|(k, v)| (k.into(), v)).collect();
    serde_json::from_value(Value::Object(map)).unwrap_or_default()
}
