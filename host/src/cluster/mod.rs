//! Running under cluster engines: what chimera tells external routers.
//!
//! - [`announce`]: the hybrid rule for external prefix routers (which blocks a worker may
//!   announce), shared by the Dynamo worker (`chimera-dynamo`) and the ZMQ publisher;
//! - [`zmq`]: KV events in vLLM's ZMQ/msgpack format (`[kv_events]`), for llm-d, Ray Serve
//!   and Dynamo's relay;
//! - [`tee`]: hands each replica's cache events to a second reader besides the router.

pub mod announce;
pub mod zmq;

use std::sync::Arc;

pub use announce::{Announcement, Announcer};
pub use zmq::{KvEventsConfig, ZmqPublisher};

use crate::cache::KvEvent;
use crate::server::router::Replica;

/// A reader of every replica's cache events (replica index, one engine step's events).
pub type EventSink = Arc<dyn Fn(usize, &[KvEvent]) + Send + Sync>;

/// Passes each replica's cache events to `sink` on their way to the router (a task per
/// replica on the current tokio runtime; the router gets them unchanged and in order).
pub fn tee(replicas: Vec<Replica>, sink: EventSink) -> Vec<Replica> {
    replicas
        .into_iter()
        .enumerate()
        .map(|(i, r)| Replica {
            handle: r.handle,
            kv_events: r.kv_events.map(|mut rx| {
                let (tx, out) = tokio::sync::mpsc::unbounded_channel();
                let sink = sink.clone();
                tokio::spawn(async move {
                    while let Some(batch) = rx.recv().await {
                        sink(i, &batch);
                        if tx.send(batch).is_err() {
                            break;
                        }
                    }
                });
                out
            }),
        })
        .collect()
}
