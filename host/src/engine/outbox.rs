//! `Outbox`: how the engine hands each request its events.
//!
//! Two modes. **Inline** sends every event at once on the calling thread (tests and tools that
//! step an engine by hand read the channels right after a step). **Threaded** queues a step's
//! events and hands them, in one channel send per step, to a delivery thread that sends them on
//! the requests' channels. Each of those sends wakes the task reading that request's stream
//! (one per HTTP response), and at 256 running requests the wakes cost the engine thread more
//! than everything else it does between two forward passes; on the delivery thread they run
//! while the device computes the next step.
//!
//! Invariants: a request's events keep their order (one FIFO queue from the engine to one
//! delivery thread, for every event of every request); a queued event holds a clone of its
//! request's sender, so a channel closes only after its last event was delivered; dropping the
//! outbox delivers everything queued and joins the delivery thread. A reader that has gone is
//! reported to the caller (`send` returns false) so the engine can cancel its request. It knows
//! nothing of requests, scheduling or caches.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use tokio::sync::mpsc::UnboundedSender;

use super::api::EngineEvent;

/// Events of one step, each with the channel it goes to.
type Batch = Vec<(UnboundedSender<EngineEvent>, EngineEvent)>;

/// Steps' batches the delivery thread may lag behind before `flush` waits for it.
const QUEUED_BATCHES: usize = 64;

pub struct Outbox {
    /// Events queued since the last flush (threaded mode only).
    pending: Batch,
    delivery: Option<Delivery>,
}

struct Delivery {
    batches: Option<SyncSender<Batch>>,
    /// Emptied batches coming back, so the step loop does not allocate a new one per step.
    spare: Receiver<Batch>,
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
        let (batches, queued) = sync_channel::<Batch>(QUEUED_BATCHES);
        let (spare_tx, spare) = sync_channel::<Batch>(QUEUED_BATCHES);
        let thread = std::thread::Builder::new()
            .name("chimera-events".into())
            .spawn(move || {
                for mut batch in queued {
                    deliver(&mut batch);
                    // A full return queue only means the engine has spares enough.
                    let _ = spare_tx.try_send(batch);
                }
            })?;
        Ok(Self {
            pending: Vec::new(),
            delivery: Some(Delivery {
                batches: Some(batches),
                spare,
                thread: Some(thread),
            }),
        })
    }

    pub fn is_threaded(&self) -> bool {
        self.delivery.is_some()
    }

    /// Sends `event` to `to` (inline) or queues it for the next flush (threaded). False when
    /// the reader has gone: the event is dropped and the request should be cancelled.
    pub fn send(&mut self, to: &UnboundedSender<EngineEvent>, event: EngineEvent) -> bool {
        if self.delivery.is_none() {
            return to.send(event).is_ok();
        }
        if to.is_closed() {
            return false;
        }
        self.pending.push((to.clone(), event));
        true
    }

    /// Hands the queued events to the delivery thread (nothing to do inline). Waits only when
    /// the thread is [`QUEUED_BATCHES`] steps behind; should the thread be gone, delivers the
    /// events here.
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
            return deliver(&mut { batch });
        };
        match tx.try_send(batch) {
            Ok(()) => {}
            Err(TrySendError::Full(batch)) => {
                if let Err(e) = tx.send(batch) {
                    deliver(&mut { e.0 });
                }
            }
            Err(TrySendError::Disconnected(mut batch)) => deliver(&mut batch),
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

fn deliver(batch: &mut Batch) {
    for (to, event) in batch.drain(..) {
        // A reader that left meanwhile is found by the engine's next send to it.
        let _ = to.send(event);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::engine::api::{FinishReason, Usage};

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
    fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<EngineEvent>) -> Option<EngineEvent> {
        rx.blocking_recv()
    }

    /// Many steps' events to several requests, each request's sender dropped right after its
    /// last event (as the engine drops a finished request): every reader gets its events in
    /// order, then `Finished`, then the end of the channel.
    #[test]
    fn threaded_delivery_keeps_each_requests_order_and_closes_after_the_last_event() {
        let mut out = Outbox::threaded().unwrap();
        assert!(out.is_threaded());
        let (mut txs, mut rxs): (Vec<_>, Vec<_>) = (0..5).map(|_| unbounded_channel()).unzip();
        for step in 0..200u32 {
            for tx in &txs {
                assert!(out.send(tx, tokens(step)));
            }
            out.flush();
        }
        for tx in txs.drain(..) {
            assert!(out.send(&tx, finished()));
        }
        out.flush();
        for rx in &mut rxs {
            for step in 0..200u32 {
                assert_eq!(next(rx), Some(tokens(step)));
            }
            assert_eq!(next(rx), Some(finished()));
            assert_eq!(next(rx), None, "closed after the last event");
        }
        drop(out);
    }

    /// Dropping the outbox delivers what was queued and not yet flushed.
    #[test]
    fn drop_delivers_everything_queued() {
        let mut out = Outbox::threaded().unwrap();
        let (tx, mut rx) = unbounded_channel();
        assert!(out.send(&tx, tokens(7)));
        assert!(out.send(&tx, finished()));
        drop(tx);
        drop(out);
        assert_eq!(rx.try_recv().ok(), Some(tokens(7)));
        assert_eq!(rx.try_recv().ok(), Some(finished()));
        assert!(rx.try_recv().is_err());
    }

    /// A reader that has gone is reported at once, in both modes, and nothing is queued for it.
    #[test]
    fn a_closed_reader_is_reported() {
        for mut out in [Outbox::inline(), Outbox::threaded().unwrap()] {
            let (tx, rx) = unbounded_channel();
            drop(rx);
            assert!(!out.send(&tx, tokens(1)));
            assert!(out.pending.is_empty());
            let (tx, _rx) = unbounded_channel();
            assert!(out.send(&tx, tokens(1)));
        }
    }

    /// Inline: the event is on the channel when `send` returns, without a flush.
    #[test]
    fn inline_sends_at_once() {
        let mut out = Outbox::inline();
        assert!(!out.is_threaded());
        let (tx, mut rx) = unbounded_channel();
        assert!(out.send(&tx, tokens(3)));
        assert_eq!(rx.try_recv().ok(), Some(tokens(3)));
    }

    /// Many more batches than the queue holds, flushed back to back: none is dropped or
    /// reordered (a full queue makes `flush` wait).
    #[test]
    fn more_batches_than_the_queue_holds_lose_nothing() {
        let mut out = Outbox::threaded().unwrap();
        let (tx, mut rx) = unbounded_channel();
        let steps = 4 * QUEUED_BATCHES as u32;
        for step in 0..steps {
            assert!(out.send(&tx, tokens(step)));
            out.flush();
        }
        drop(out);
        for step in 0..steps {
            assert_eq!(rx.try_recv().ok(), Some(tokens(step)));
        }
    }
}
