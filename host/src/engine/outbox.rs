//! `Outbox`: how the engine hands each request its events.
//!
//! Two modes. **Inline** sends every event at once on the calling thread (tests and tools that
//! step an engine by hand read the channels right after a step). **Threaded** queues a step's
//! events and hands them, in one channel send per step, to a delivery thread that sends them on
//! the requests' channels. Each of those sends wakes the task reading that request's stream
//! (one per HTTP response), and at 256 running requests the wakes cost the engine thread more
//! than everything else it does between two forward passes; on the delivery thread they run
//! while the device computes the next step. The delivery thread keeps each open request's
//! sender, so queueing an event costs the engine thread no atomic operation on the channel.
//!
//! Invariants: a request's events keep their order (one FIFO queue from the engine to one
//! delivery thread, for every event of every request); a request is opened once, with its
//! sender, before its first event, and its `Finished` or `Failed` event is its last: the
//! delivery thread drops its sender after that one, so the channel closes after the last
//! event; dropping the outbox delivers everything queued and joins the delivery thread. A
//! reader that has gone is reported to the engine (at once inline, through
//! [`Outbox::take_closed`] threaded) so it can cancel the request. It knows nothing of
//! scheduling or caches.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, SyncSender, TrySendError, channel, sync_channel};
use std::thread::JoinHandle;

use super::api::{EngineEvent, EventBatch, EventSender, FailureKind, SharedEvents, TokenLogprob};

/// What the engine asks of the delivery thread, in order.
enum Op {
    /// Request `id` (registration `seq`) sends its events to this channel.
    Open { id: u64, seq: u64, to: EventSender },
    /// An event of an open request; `Finished` and `Failed` close it.
    Event { id: u64, event: EngineEvent },
    /// One sampled token of an open request: a `Tokens` event, built by the delivery thread
    /// (its allocations are not the engine thread's).
    Token {
        id: u64,
        token: u32,
        logprob: Option<TokenLogprob>,
    },
    /// The only event of a request that was never opened (rejected on arrival).
    Once {
        id: u64,
        to: EventSender,
        event: EngineEvent,
    },
}

/// Steps' batches the delivery thread may lag behind before `flush` waits for it.
const QUEUED_BATCHES: usize = 64;

pub struct Outbox {
    /// Ops queued since the last flush (threaded mode only).
    pending: Vec<Op>,
    delivery: Option<Delivery>,
}

struct Delivery {
    batches: Option<SyncSender<Vec<Op>>>,
    /// Emptied batches coming back, so the step loop does not allocate a new one per step.
    spare: Receiver<Vec<Op>>,
    /// (id, seq) of requests whose reader had gone when an event was sent.
    closed: Receiver<(u64, u64)>,
    /// The registration number of each open request, to tell a report about an earlier
    /// request with the same id from one about the current one.
    open: HashMap<u64, u64>,
    next_seq: u64,
    thread: Option<JoinHandle<()>>,
}

impl Outbox {
    /// Sends every event at once on the calling thread.
    pub fn inline() -> Self {
        Self {
            pending: Vec::new(),
            delivery: None,
        }
    }

    /// Delivers events on a thread of its own, one batch per [`Self::flush`].
    pub fn threaded() -> std::io::Result<Self> {
        let (batches, queued) = sync_channel::<Vec<Op>>(QUEUED_BATCHES);
        let (spare_tx, spare) = sync_channel(QUEUED_BATCHES);
        let (closed_tx, closed) = channel();
        let thread = std::thread::Builder::new()
            .name("chimera-events".into())
            .spawn(move || {
                let mut open = HashMap::new();
                let mut shared = Vec::new();
                for mut batch in queued {
                    deliver(&mut batch, &mut open, &mut shared, &closed_tx);
                    // A full return queue only means the engine has spares enough.
                    let _ = spare_tx.try_send(batch);
                }
                fail_unfinished(open);
            })?;
        Ok(Self {
            pending: Vec::new(),
            delivery: Some(Delivery {
                batches: Some(batches),
                spare,
                closed,
                open: HashMap::new(),
                next_seq: 0,
                thread: Some(thread),
            }),
        })
    }

    pub fn is_threaded(&self) -> bool {
        self.delivery.is_some()
    }

    /// Registers request `id` (unique among open requests) and its channel, before its first
    /// event.
    pub fn open(&mut self, id: u64, to: &EventSender) {
        if let Some(d) = self.delivery.as_mut() {
            let seq = d.next_seq;
            d.next_seq += 1;
            d.open.insert(id, seq);
            self.pending.push(Op::Open {
                id,
                seq,
                to: to.clone(),
            });
        }
    }

    /// Sends `event` of open request `id` (inline: to `to`, at once). `Finished` and `Failed`
    /// close the request. False when the reader is known to have gone (inline only; threaded,
    /// see [`Self::take_closed`]).
    pub fn send(&mut self, id: u64, to: &EventSender, event: EngineEvent) -> bool {
        let Some(d) = self.delivery.as_mut() else {
            return to.send(id, event);
        };
        if is_last(&event) {
            d.open.remove(&id);
        }
        self.pending.push(Op::Event { id, event });
        true
    }

    /// Sends one sampled token of open request `id` as a `Tokens` event, as [`Self::send`]
    /// does; threaded, the event is built on the delivery thread.
    pub fn send_token(
        &mut self,
        id: u64,
        to: &EventSender,
        token: u32,
        logprob: Option<TokenLogprob>,
    ) -> bool {
        if self.delivery.is_none() {
            return to.send(id, token_event(token, logprob));
        }
        self.pending.push(Op::Token { id, token, logprob });
        true
    }

    /// Sends the only event of request `id`, which was never opened.
    pub fn reject(&mut self, id: u64, to: &EventSender, event: EngineEvent) {
        if self.delivery.is_none() {
            let _ = to.send(id, event);
            return;
        }
        self.pending.push(Op::Once {
            id,
            to: to.clone(),
            event,
        });
    }

    /// Appends the ids of open requests whose reader has gone (found by the delivery thread).
    pub fn take_closed(&mut self, out: &mut Vec<u64>) {
        let Some(d) = self.delivery.as_mut() else {
            return;
        };
        for (id, seq) in d.closed.try_iter() {
            if d.open.get(&id) == Some(&seq) {
                out.push(id);
            }
        }
    }

    /// Hands the queued events to the delivery thread (nothing to do inline). Waits only when
    /// the thread is [`QUEUED_BATCHES`] steps behind; should the thread be gone, nothing more
    /// can be delivered and the batch is dropped (its channels close).
    pub fn flush(&mut self) {
        let Some(d) = self.delivery.as_mut() else {
            return;
        };
        if self.pending.is_empty() {
            return;
        }
        let next = d.spare.try_recv().unwrap_or_default();
        let batch = std::mem::replace(&mut self.pending, next);
        let Some(tx) = d.batches.as_ref() else {
            return;
        };
        let sent = match tx.try_send(batch) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(batch)) => tx.send(batch).map_err(|_| ()),
            Err(TrySendError::Disconnected(_)) => Err(()),
        };
        if sent.is_err() {
            tracing::error!("the event delivery thread is gone; requests' events are lost");
        }
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        self.flush();
        if let Some(d) = self.delivery.as_mut() {
            // Closing the queue ends the thread once it has delivered everything.
            d.batches = None;
            if let Some(t) = d.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn token_event(token: u32, logprob: Option<TokenLogprob>) -> EngineEvent {
    EngineEvent::Tokens {
        tokens: vec![token],
        logprobs: logprob.map(|l| vec![l]),
    }
}

fn is_last(event: &EngineEvent) -> bool {
    matches!(
        event,
        EngineEvent::Finished { .. } | EngineEvent::Failed { .. }
    )
}

/// The delivery thread's work on one batch. `open` maps each open request to its sender and
/// registration number; a request whose reader has gone is reported once and forgotten.
/// Events for shared streams are gathered into one [`EventBatch`] per stream (`shared`, kept
/// for its buffers) and sent once the batch is through.
fn deliver(
    batch: &mut Vec<Op>,
    open: &mut HashMap<u64, (EventSender, u64)>,
    shared: &mut Vec<(SharedEvents, EventBatch, Vec<u64>)>,
    closed: &Sender<(u64, u64)>,
) {
    for op in batch.drain(..) {
        let (id, event) = match op {
            Op::Open { id, seq, to } => {
                open.insert(id, (to, seq));
                continue;
            }
            Op::Once { id, to, event } => {
                send(shared, &to, id, event);
                continue;
            }
            Op::Event { id, event } => (id, event),
            Op::Token { id, token, logprob } => (id, token_event(token, logprob)),
        };
        let last = is_last(&event);
        let Some((to, seq)) = open.get(&id) else {
            continue;
        };
        let gone = !send(shared, to, id, event);
        if gone && !last {
            let _ = closed.send((id, *seq));
        }
        if gone || last {
            open.remove(&id);
        }
    }
    for (stream, events, ids) in shared.iter_mut() {
        if events.is_empty() {
            continue;
        }
        if !stream.send(std::mem::take(events)) {
            // The stream's reader has gone: every request it serves is closed.
            for id in ids.drain(..) {
                if let Some((_, seq)) = open.remove(&id) {
                    let _ = closed.send((id, seq));
                }
            }
        }
        ids.clear();
    }
}

/// Sends one event: at once on a request's own channel, or into its shared stream's batch.
/// False when the reader is known to have gone.
fn send(
    shared: &mut Vec<(SharedEvents, EventBatch, Vec<u64>)>,
    to: &EventSender,
    id: u64,
    event: EngineEvent,
) -> bool {
    let stream = match to {
        EventSender::Own(tx) => return tx.send(event).is_ok(),
        EventSender::Shared(stream) => stream,
    };
    let i = match shared.iter().position(|(s, ..)| s.same(stream)) {
        Some(i) => i,
        None => {
            shared.push((stream.clone(), Vec::new(), Vec::new()));
            shared.len() - 1
        }
    };
    let (_, events, ids) = &mut shared[i];
    if !is_last(&event) {
        ids.push(id);
    }
    events.push((id, event));
    true
}

/// The delivery thread ends with requests still open (the engine stopped without finishing
/// them): their own channels close as their senders drop; a shared stream has no such
/// signal, so each of its requests gets a `Failed` event.
fn fail_unfinished(open: HashMap<u64, (EventSender, u64)>) {
    for (id, (to, _)) in open {
        if matches!(to, EventSender::Shared(_)) {
            let message = "the engine stopped without finishing the request".to_string();
            let kind = FailureKind::Executor;
            to.send(id, EngineEvent::Failed { kind, message });
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

    /// The closed reports of a threaded outbox, waiting up to 10 s for the first.
    fn wait_closed(out: &mut Outbox) -> Vec<u64> {
        let mut closed = Vec::new();
        let start = std::time::Instant::now();
        while closed.is_empty() && start.elapsed().as_secs() < 10 {
            out.take_closed(&mut closed);
            std::thread::yield_now();
        }
        closed
    }

    /// A request's own channel.
    fn own() -> (EventSender, UnboundedReceiver<EngineEvent>) {
        let (tx, rx) = unbounded_channel();
        (EventSender::Own(tx), rx)
    }

    use super::*;
    use crate::engine::api::{FailureKind, FinishReason, Usage};

    fn tokens(t: u32) -> EngineEvent {
        EngineEvent::Tokens {
            tokens: vec![t],
            logprobs: None,
        }
    }

    fn finished() -> EngineEvent {
        EngineEvent::Finished {
            reason: FinishReason::Length,
            usage: Usage::default(),
        }
    }

    /// Blocks until the channel yields its next event or closes.
    fn next(rx: &mut UnboundedReceiver<EngineEvent>) -> Option<EngineEvent> {
        rx.blocking_recv()
    }

    /// Many steps' events to several requests, each request's own sender dropped as soon as it
    /// is opened (the engine drops a finished request's): every reader gets its events in
    /// order, then `Finished`, then the end of the channel — not before.
    #[test]
    fn threaded_delivery_keeps_each_requests_order_and_closes_after_the_last_event() {
        let mut out = Outbox::threaded().unwrap();
        assert!(out.is_threaded());
        let mut rxs = Vec::new();
        let mut txs = Vec::new();
        for id in 0..5u64 {
            let (tx, rx) = own();
            out.open(id, &tx);
            txs.push(tx);
            rxs.push(rx);
        }
        for step in 0..200u32 {
            for (id, tx) in txs.iter().enumerate() {
                assert!(out.send(id as u64, tx, tokens(step)));
            }
            out.flush();
        }
        for (id, tx) in txs.drain(..).enumerate() {
            assert!(out.send(id as u64, &tx, finished()));
        }
        out.flush();
        for rx in &mut rxs {
            for step in 0..200u32 {
                assert_eq!(next(rx), Some(tokens(step)));
            }
            assert_eq!(next(rx), Some(finished()));
            assert_eq!(next(rx), None, "closed after the last event");
        }
        let mut closed = Vec::new();
        out.take_closed(&mut closed);
        assert!(closed.is_empty());
    }

    /// A token sent with `send_token` arrives as the `Tokens` event `send` would have sent,
    /// in order with the request's other events, threaded and inline alike.
    #[test]
    fn send_token_delivers_a_tokens_event_in_order() {
        let logprob = TokenLogprob {
            token: 4,
            logprob: -0.5,
            top: vec![(4, -0.5), (9, -1.25)],
            rank: None,
        };
        let with_logprob = EngineEvent::Tokens {
            tokens: vec![4],
            logprobs: Some(vec![logprob.clone()]),
        };
        for mut out in [Outbox::inline(), Outbox::threaded().unwrap()] {
            let (tx, mut rx) = own();
            out.open(7, &tx);
            assert!(out.send_token(7, &tx, 3, None));
            assert!(out.send(7, &tx, tokens(5)));
            assert!(out.send_token(7, &tx, 4, Some(logprob.clone())));
            assert!(out.send(7, &tx, finished()));
            drop(tx);
            out.flush();
            assert_eq!(next(&mut rx), Some(tokens(3)));
            assert_eq!(next(&mut rx), Some(tokens(5)));
            assert_eq!(next(&mut rx), Some(with_logprob.clone()));
            assert_eq!(next(&mut rx), Some(finished()));
            assert_eq!(next(&mut rx), None);
        }
    }

    /// Dropping the outbox delivers what was queued and not yet flushed, and closes the
    /// channels of requests still open.
    #[test]
    fn drop_delivers_everything_queued() {
        let mut out = Outbox::threaded().unwrap();
        let (tx, mut rx) = own();
        out.open(9, &tx);
        assert!(out.send(9, &tx, tokens(7)));
        drop(tx);
        drop(out);
        assert_eq!(rx.try_recv().ok(), Some(tokens(7)));
        assert!(rx.try_recv().is_err(), "closed");
    }

    /// A reader that has gone: inline, `send` says so; threaded, the delivery thread reports
    /// the request once through `take_closed`, and not after the request finished.
    #[test]
    fn a_closed_reader_is_reported() {
        let mut out = Outbox::inline();
        let (tx, rx) = own();
        drop(rx);
        assert!(!out.send(1, &tx, tokens(1)));

        let mut out = Outbox::threaded().unwrap();
        let (gone_tx, gone_rx) = own();
        let (kept_tx, _kept_rx) = own();
        out.open(1, &gone_tx);
        out.open(2, &kept_tx);
        drop(gone_rx);
        for step in 0..3 {
            assert!(out.send(1, &gone_tx, tokens(step)));
            assert!(out.send(2, &kept_tx, tokens(step)));
            out.flush();
        }
        let closed = wait_closed(&mut out);
        assert_eq!(closed, vec![1]);
        // A second report of the same request never comes.
        assert!(out.send(1, &gone_tx, tokens(9)));
        out.flush();
        drop(out);

        // Reported after the request finished: ignored.
        let mut out = Outbox::threaded().unwrap();
        let (tx, rx) = own();
        out.open(3, &tx);
        drop(rx);
        assert!(out.send(3, &tx, tokens(0)));
        out.flush();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(out.send(3, &tx, finished()));
        let mut closed = Vec::new();
        out.take_closed(&mut closed);
        assert!(closed.is_empty(), "{closed:?}");
    }

    /// A request rejected on arrival gets its one event without being opened, also when an
    /// open request has the same id (a duplicate id is a reason to reject).
    #[test]
    fn a_rejected_request_gets_its_event_and_leaves_the_open_one_alone() {
        for mut out in [Outbox::inline(), Outbox::threaded().unwrap()] {
            let (tx, mut rx) = own();
            out.open(5, &tx);
            let (dup_tx, mut dup_rx) = own();
            let failed = EngineEvent::Failed {
                kind: FailureKind::InvalidRequest,
                message: "request id 5 is already in use".into(),
            };
            out.reject(5, &dup_tx, failed.clone());
            drop(dup_tx);
            assert!(out.send(5, &tx, tokens(1)));
            out.flush();
            drop(tx);
            drop(out);
            assert_eq!(dup_rx.try_recv().ok(), Some(failed));
            assert!(dup_rx.try_recv().is_err());
            assert_eq!(rx.try_recv().ok(), Some(tokens(1)));
        }
    }

    /// Inline: the event is on the channel when `send` returns, without a flush.
    #[test]
    fn inline_sends_at_once() {
        let mut out = Outbox::inline();
        assert!(!out.is_threaded());
        let (tx, mut rx) = own();
        out.open(3, &tx);
        assert!(out.send(3, &tx, tokens(3)));
        assert_eq!(rx.try_recv().ok(), Some(tokens(3)));
    }

    /// Many more batches than the queue holds, flushed back to back: none is dropped or
    /// reordered (a full queue makes `flush` wait).
    #[test]
    fn more_batches_than_the_queue_holds_lose_nothing() {
        let mut out = Outbox::threaded().unwrap();
        let (tx, mut rx) = own();
        out.open(0, &tx);
        let steps = 4 * QUEUED_BATCHES as u32;
        for step in 0..steps {
            assert!(out.send(0, &tx, tokens(step)));
            out.flush();
        }
        drop(out);
        for step in 0..steps {
            assert_eq!(rx.try_recv().ok(), Some(tokens(step)));
        }
    }

    /// A shared stream gets one batch per flushed step with every request's events of that
    /// step in order, tagged with their ids; a request the engine never finished gets a
    /// `Failed` event when the delivery thread ends; a stream whose reader has gone reports
    /// its open requests closed.
    #[test]
    fn a_shared_stream_gets_one_batch_per_step_and_hears_of_unfinished_requests() {
        use crate::engine::api::SharedEvents;

        let (stream, batches) = SharedEvents::channel();
        let to = EventSender::Shared(stream);
        let mut out = Outbox::threaded().unwrap();
        out.open(1, &to);
        out.open(2, &to);
        for step in 0..3 {
            assert!(out.send_token(1, &to, step, None));
            assert!(out.send_token(2, &to, 10 + step, None));
            out.flush();
        }
        assert!(out.send(1, &to, finished()));
        out.flush();
        drop(out);
        let got: Vec<EventBatch> = batches.try_iter().collect();
        assert_eq!(
            got.len(),
            5,
            "three steps, the finish, the failure at the end: {got:?}"
        );
        for (step, batch) in got.iter().take(3).enumerate() {
            let step = step as u32;
            assert_eq!(batch, &vec![(1, tokens(step)), (2, tokens(10 + step))]);
        }
        assert_eq!(got[3], vec![(1, finished())]);
        assert!(
            matches!(
                &got[4][..],
                [(
                    2,
                    EngineEvent::Failed {
                        kind: FailureKind::Executor,
                        ..
                    }
                )]
            ),
            "{:?}",
            got[4]
        );

        let (stream, batches) = SharedEvents::channel();
        let to = EventSender::Shared(stream);
        let mut out = Outbox::threaded().unwrap();
        out.open(4, &to);
        drop(batches);
        assert!(out.send_token(4, &to, 1, None));
        out.flush();
        let closed = wait_closed(&mut out);
        assert_eq!(closed, vec![4]);
    }
}
