//! KV events in vLLM's wire format, on a ZeroMQ PUB socket: what llm-d's precise prefix
//! scorer, Ray Serve's KV router and Dynamo's ZMQ relay subscribe to.
//!
//! Each message is three frames: the topic, an 8-byte big-endian sequence number, and a
//! msgpack `EventBatch` in vLLM's array layout `[ts, [event, ...], data_parallel_rank]`, each
//! event a tagged array: `["BlockStored", block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]` or
//! `["AllBlocksCleared"]`. A ROUTER replay socket answers a request `[identity, "",
//! start_seq]` with every buffered batch from `start_seq` on (`[identity, "", seq, batch]`),
//! then `[identity, "", -1, ""]`. What is announced follows the hybrid rule
//! ([`super::Announcer`]). The topic is llm-d's convention, `kv@<host:port>@<model>`, unless
//! `kv_events.topic` names one.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{Announcement, Announcer};
use crate::cache::KvEvent;

/// `[kv_events]`: publishing the cache's block events for cluster routers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// `off`, or `zmq` (vLLM's ZMQ/msgpack publisher).
    pub publisher: String,
    /// The PUB socket's address (`tcp://*:5557` binds every interface).
    pub endpoint: String,
    /// The ROUTER socket that replays buffered batches to a subscriber that missed some;
    /// empty: none.
    pub replay_endpoint: String,
    /// The topic frame; empty: `kv@<server.host>:<server.port>@<model>`.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Which blocks are announced: `hybrid` (a block once a recurrent state can resume from
    /// it; every block on attention-only models) or `all` (every KV block).
    pub announce: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            publisher: "off".into(),
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: String::new(),
            topic: String::new(),
            buffer_steps: 10_000,
            announce: "hybrid".into(),
        }
    }
}

impl KvEventsConfig {
    /// Checks the values; the error names the key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        match self.publisher.as_str() {
            "off" | "zmq" => {}
            other => return Err(("publisher", format!("`{other}`: use off or zmq"))),
        }
        match self.announce.as_str() {
            "hybrid" | "all" => {}
            other => return Err(("announce", format!("`{other}`: use hybrid or all"))),
        }
        for (key, v) in [
            ("endpoint", &self.endpoint),
            ("replay_endpoint", &self.replay_endpoint),
        ] {
            let unset = v.is_empty() && key == "replay_endpoint";
            if !unset && !v.starts_with("tcp://") {
                return Err((key, format!("`{v}`: use tcp://HOST:PORT")));
            }
        }
        if self.buffer_steps == 0 {
            return Err(("buffer_steps", "must be at least 1".into()));
        }
        Ok(())
    }
}

/// Sent batches by sequence number, kept for replay.
type Buffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// The sequence number that ends a replay.
const END_SEQ: i64 = -1;

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    let _ = rmp::encode::write_array_len(out, hashes.len() as u32);
    for &h in hashes {
        let _ = rmp::encode::write_uint(out, h);
    }
}

/// One batch of announcements as vLLM's msgpack `EventBatch`.
pub fn encode_batch(ts: f64, events: &[Announcement], block_size: u32, dp_rank: i32) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 32);
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, ts);
    let _ = rmp::encode::write_array_len(&mut out, events.len() as u32);
    for e in events {
        match e {
            Announcement::Stored {
                parent,
                blocks,
                tokens,
            } => {
                let _ = rmp::encode::write_array_len(&mut out, 7);
                let _ = rmp::encode::write_str(&mut out, "BlockStored");
                write_hashes(&mut out, blocks);
                match parent {
                    Some(p) => {
                        let _ = rmp::encode::write_uint(&mut out, *p);
                    }
                    None => {
                        let _ = rmp::encode::write_nil(&mut out);
                    }
                }
                let _ = rmp::encode::write_array_len(&mut out, tokens.len() as u32);
                for &t in tokens {
                    let _ = rmp::encode::write_uint(&mut out, u64::from(t));
                }
                let _ = rmp::encode::write_uint(&mut out, u64::from(block_size));
                let _ = rmp::encode::write_nil(&mut out); // lora_id
                let _ = rmp::encode::write_str(&mut out, "GPU");
            }
            Announcement::Removed { hashes } => {
                let _ = rmp::encode::write_array_len(&mut out, 3);
                let _ = rmp::encode::write_str(&mut out, "BlockRemoved");
                write_hashes(&mut out, hashes);
                let _ = rmp::encode::write_str(&mut out, "GPU");
            }
        }
    }
    let _ = rmp::encode::write_sint(&mut out, i64::from(dp_rank));
    out
}

/// The `AllBlocksCleared` batch (sent when the publisher starts: subscribers drop what they
/// held for this topic from an earlier run).
pub fn encode_cleared(ts: f64, dp_rank: i32) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, ts);
    let _ = rmp::encode::write_array_len(&mut out, 1);
    let _ = rmp::encode::write_array_len(&mut out, 1);
    let _ = rmp::encode::write_str(&mut out, "AllBlocksCleared");
    let _ = rmp::encode::write_sint(&mut out, i64::from(dp_rank));
    out
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// ZeroMQ wants an address it can bind: `*` is every IPv4 interface.
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// A running publisher: feed it each replica's events with [`ZmqPublisher::send`].
#[derive(Clone)]
pub struct ZmqPublisher {
    tx: mpsc::UnboundedSender<(usize, Vec<KvEvent>)>,
}

impl ZmqPublisher {
    /// Binds the sockets and starts the publishing task on the current tokio runtime.
    /// `replicas` replicas feed it; `hybrid`: whether the model resumes from SSM snapshots.
    pub async fn start(
        config: &KvEventsConfig,
        topic: String,
        replicas: usize,
        hybrid: bool,
        block_size: u32,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let mut publisher = zeromq::PubSocket::new();
        publisher
            .bind(&bindable(&config.endpoint))
            .await
            .with_context(|| format!("kv_events.endpoint {}", config.endpoint))?;
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        if !config.replay_endpoint.is_empty() {
            let mut router = zeromq::RouterSocket::new();
            router
                .bind(&bindable(&config.replay_endpoint))
                .await
                .with_context(|| format!("kv_events.replay_endpoint {}", config.replay_endpoint))?;
            tokio::spawn(replay(router, buffer.clone()));
        }
        let announcer = Announcer::new(replicas, hybrid && config.announce == "hybrid");
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(publish(
            publisher,
            rx,
            announcer,
            Publishing {
                topic,
                block_size,
                buffer,
                keep: config.buffer_steps,
            },
        ));
        tracing::info!(
            endpoint = %config.endpoint,
            replay = %config.replay_endpoint,
            announce = %config.announce,
            "publishing KV events (vLLM's ZMQ format)"
        );
        Ok(Self { tx })
    }

    /// Hands over one engine step's events of `replica`.
    pub fn send(&self, replica: usize, events: &[KvEvent]) {
        let _ = self.tx.send((replica, events.to_vec()));
    }
}

struct Publishing {
    topic: String,
    block_size: u32,
    buffer: Buffer,
    keep: usize,
}

async fn publish(
    mut socket: zeromq::PubSocket,
    mut rx: mpsc::UnboundedReceiver<(usize, Vec<KvEvent>)>,
    mut announcer: Announcer,
    p: Publishing,
) {
    let mut seq: u64 = 0;
    let mut out = Vec::new();
    let emit = |payload: Vec<u8>, seq: u64| {
        if let Ok(mut b) = p.buffer.lock() {
            b.push_back((seq, payload.clone()));
            while b.len() > p.keep {
                b.pop_front();
            }
        }
        let mut msg = ZmqMessage::from(p.topic.clone().into_bytes());
        msg.push_back(seq.to_be_bytes().to_vec().into());
        msg.push_back(payload.into());
        msg
    };
    let first = emit(encode_cleared(now(), 0), seq);
    seq += 1;
    if socket.send(first).await.is_err() {
        return;
    }
    while let Some((replica, events)) = rx.recv().await {
        out.clear();
        for e in &events {
            announcer.apply(replica, e, &mut out);
        }
        if out.is_empty() {
            continue;
        }
        let msg = emit(encode_batch(now(), &out, p.block_size, 0), seq);
        seq += 1;
        if let Err(e) = socket.send(msg).await {
            tracing::warn!(error = %e, "KV event publisher: send failed");
        }
    }
}

/// Answers replay requests from the buffer.
async fn replay(mut socket: zeromq::RouterSocket, buffer: Buffer) {
    while let Ok(request) = socket.recv().await {
        let frames: Vec<Vec<u8>> = request.into_vec().into_iter().map(|b| b.to_vec()).collect();
        // [identity, "", start_seq] (a DEALER with an empty delimiter) or [identity, start_seq].
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Vec<u8>)> = buffer
            .lock()
            .map(|b| b.iter().filter(|(s, _)| *s >= start).cloned().collect())
            .unwrap_or_default();
        let reply = |seq: Vec<u8>, payload: Vec<u8>| {
            let mut m = ZmqMessage::from(identity.clone());
            m.push_back(Vec::new().into());
            m.push_back(seq.into());
            m.push_back(payload.into());
            m
        };
        for (seq, payload) in batches {
            if socket
                .send(reply(seq.to_be_bytes().to_vec(), payload))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = socket
            .send(reply(END_SEQ.to_be_bytes().to_vec(), Vec::new()))
            .await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_vllm_event_batches() {
        let events = vec![
            Announcement::Stored {
                parent: None,
                blocks: vec![11, 12],
                tokens: vec![1, 2, 3, 4],
            },
            Announcement::Removed { hashes: vec![11] },
        ];
        let bytes = encode_batch(1.5, &events, 2, 0);
        let v: rmpv::Value = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0].as_f64(), Some(1.5));
        let ev = a[1].as_array().unwrap();
        let stored = ev[0].as_array().unwrap();
        assert_eq!(stored[0].as_str(), Some("BlockStored"));
        assert_eq!(stored[1].as_array().unwrap().len(), 2);
        assert!(stored[2].is_nil());
        assert_eq!(stored[3].as_array().unwrap().len(), 4);
        assert_eq!(stored[4].as_u64(), Some(2));
        assert_eq!(stored[6].as_str(), Some("GPU"));
        let removed = ev[1].as_array().unwrap();
        assert_eq!(removed[0].as_str(), Some("BlockRemoved"));
        assert_eq!(removed[1].as_array().unwrap()[0].as_u64(), Some(11));
        assert_eq!(a[2].as_i64(), Some(0));
    }

    #[test]
    fn the_config_is_checked() {
        let mut c = KvEventsConfig::default();
        assert!(c.validate().is_ok());
        c.publisher = "kafka".into();
        assert_eq!(c.validate().unwrap_err().0, "publisher");
        c.publisher = "zmq".into();
        c.endpoint = "5557".into();
        assert_eq!(c.validate().unwrap_err().0, "endpoint");
    }

    /// The publisher on a real socket: a SUB client gets the initial `AllBlocksCleared` and
    /// then the announced chain; the replay socket gives both back, then the end marker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscriber_and_a_replay_client_get_the_batches() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let replay_port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = KvEventsConfig {
            publisher: "zmq".into(),
            endpoint: format!("tcp://127.0.0.1:{port}"),
            replay_endpoint: format!("tcp://127.0.0.1:{replay_port}"),
            ..KvEventsConfig::default()
        };
        let mut sub = zeromq::SubSocket::new();
        let publisher = ZmqPublisher::start(&config, "kv@test@m".into(), 1, true, 2)
            .await
            .unwrap();
        sub.connect(&format!("tcp://127.0.0.1:{port}"))
            .await
            .unwrap();
        sub.subscribe("kv@").await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let chain = KvEvent::Stored {
            blocks: vec![crate::cache::StoredBlock {
                hash: 7,
                parent: None,
                snapshot: true,
            }],
            tokens: vec![5, 6],
        };
        publisher.send(0, std::slice::from_ref(&chain));
        let msg = tokio::time::timeout(std::time::Duration::from_secs(5), sub.recv())
            .await
            .expect("a batch within 5 s")
            .unwrap();
        let frames = msg.into_vec();
        assert_eq!(frames[0].as_ref(), b"kv@test@m");
        assert_eq!(frames[1].as_ref(), 1u64.to_be_bytes());
        let v = rmpv::decode::read_value(&mut frames[2].as_ref()).unwrap();
        assert_eq!(v[1][0][0].as_str(), Some("BlockStored"));
        assert_eq!(v[1][0][1][0].as_u64(), Some(7));

        let mut dealer = zeromq::DealerSocket::new();
        dealer
            .connect(&format!("tcp://127.0.0.1:{replay_port}"))
            .await
            .unwrap();
        let mut ask = ZmqMessage::from(Vec::<u8>::new());
        ask.push_back(0u64.to_be_bytes().to_vec().into());
        dealer.send(ask).await.unwrap();
        let mut seqs = Vec::new();
        loop {
            let m = tokio::time::timeout(std::time::Duration::from_secs(5), dealer.recv())
                .await
                .expect("a replay frame within 5 s")
                .unwrap()
                .into_vec();
            let seq = i64::from_be_bytes(m[1].as_ref().try_into().unwrap());
            if seq == END_SEQ {
                break;
            }
            seqs.push(seq);
        }
        assert_eq!(seqs, vec![0, 1]);
    }
}
