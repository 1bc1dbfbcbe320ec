//! The engine thread of one replica: a plain OS thread that drives the engine's step
//! pipeline (`engine::pipeline`):
//!
//! ```text
//! loop {
//!     wait for a command while idle; apply every pending command and cancel
//!     begin_step         launch (when nothing computes), schedule the next step ahead
//!     while the arrival window is open:
//!         wait on the command channel until a command comes or the window closes;
//!         arrivals join the step ahead (top_up)
//!     complete_step      wait for the device, sample, launch the step ahead, apply
//!     publish            figures and cache events (deferred to the next step's overlap
//!                        when another step follows at once)
//! }
//! ```
//!
//! It never spins: while idle it blocks on the command channel, while a step computes it
//! waits on the command channel with the window's deadline (the device's expected end, from
//! its time for the step before), then on the device's output. Requests' events go out
//! through a threaded [`Outbox`]: queued during a step, sent to their streams by a delivery
//! thread the engine thread owns. Figures go out through a `watch`, cache events (already
//! filtered to succeeded steps) through a channel; when another step follows at once, a
//! step's figures and events are published by that next step while the device computes it
//! ([`Engine::defer_publication`]), so waking their readers is no part of the device's idle
//! time between steps. It holds no lock: the async side reaches it only through
//! [`EngineHandle`].

use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{mpsc as tmpsc, watch};

use super::api::{Command, EngineHandle, EngineStats, KvEvent};
use super::config::EngineSetup;
use super::core::{Engine, EngineError, Policies};
use super::executor::StepExecutor;
use super::outbox::Outbox;

/// Receives the cache events of one replica (for routers and metrics).
/// A replica's cache events, one batch per step (one channel send, one wake-up).
pub type KvEventReceiver = tmpsc::UnboundedReceiver<Vec<KvEvent>>;

/// Starts the engine thread of one replica. The caches are allocated on that thread; an
/// impossible configuration is returned here, before any request is accepted.
pub fn spawn_engine<E: StepExecutor + 'static>(
    setup: EngineSetup,
    executor: E,
    policies: Policies,
) -> Result<(EngineHandle, JoinHandle<()>, KvEventReceiver), EngineError> {
    let (cmd_tx, cmd_rx) = mpsc::sync_channel(setup.engine.max_waiting.max(1));
    let (cancel_tx, cancel_rx) = mpsc::channel();
    let (stats_tx, stats_rx) = watch::channel(EngineStats::default());
    let (kv_tx, kv_rx) = tmpsc::unbounded_channel();
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let join = std::thread::Builder::new()
        .name("chimera-engine".into())
        .spawn(move || {
            let engine = match Engine::new(setup, executor, policies) {
                Ok(mut e) => {
                    // Waking the readers of 256 streams costs more than the rest of the
                    // engine's work between two forward passes: done on a thread of its own.
                    match Outbox::threaded() {
                        Ok(outbox) => {
                            e.set_outbox(outbox);
                        }
                        Err(err) => tracing::warn!(
                            error = %err,
                            "no event delivery thread; the engine thread sends events itself"
                        ),
                    }
                    // Publish the cache layout before anyone reads the stats.
                    let _ = stats_tx.send(e.stats().clone());
                    let _ = ready_tx.send(Ok(()));
                    e
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            run(engine, cmd_rx, cancel_rx, stats_tx, kv_tx);
        })
        .map_err(|e| {
            EngineError::Executor(super::executor::ExecutorError::Allocation(e.to_string()))
        })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok((EngineHandle::new(cmd_tx, cancel_tx, stats_rx), join, kv_rx)),
        Ok(Err(e)) => {
            let _ = join.join();
            Err(e)
        }
        Err(_) => {
            let _ = join.join();
            Err(EngineError::Executor(
                super::executor::ExecutorError::Allocation(
                    "the engine thread exited during startup".into(),
                ),
            ))
        }
    }
}

/// The engine thread's inbox: the command channel and the cancel channel, drained in an
/// order that never applies a cancel before the add it follows.
struct Inbox {
    commands: mpsc::Receiver<Command>,
    cancels: mpsc::Receiver<u64>,
    cancelled: Vec<u64>,
    /// A shutdown was received, or every sender is gone with the engine idle.
    stop: bool,
    /// Every sender is gone (the engine may still have work).
    closed: bool,
}

impl Inbox {
    /// Applies every command and cancel that arrived; returns whether a request was added.
    fn drain<E: StepExecutor>(&mut self, engine: &mut Engine<E>) -> bool {
        // Cancels first into a list, applied after the adds drained below: a cancel sent after
        // its add can never be applied before it.
        self.cancelled.extend(self.cancels.try_iter());
        let mut added = false;
        while !self.stop {
            match self.commands.try_recv() {
                Ok(cmd) => added |= self.handle(engine, cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.closed = true;
                    self.stop = engine.is_idle();
                    break;
                }
            }
        }
        self.cancelled.extend(self.cancels.try_iter());
        for id in self.cancelled.drain(..) {
            engine.cancel(id);
        }
        added
    }

    /// Waits for a command: until one comes while the engine is idle, else at most 1 ms.
    fn wait<E: StepExecutor>(&mut self, engine: &mut Engine<E>) {
        self.cancelled.extend(self.cancels.try_iter());
        let got = if engine.is_idle() {
            self.commands
                .recv()
                .map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            self.commands.recv_timeout(Duration::from_millis(1))
        };
        match got {
            Ok(cmd) => {
                self.handle(engine, cmd);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => self.stop = true,
        }
    }

    /// While a step computes: waits at most `timeout` for a command, then applies it and
    /// every other pending one. Returns whether a request was added.
    fn wait_for<E: StepExecutor>(&mut self, engine: &mut Engine<E>, timeout: Duration) -> bool {
        match self.commands.recv_timeout(timeout) {
            Ok(cmd) => {
                let added = self.handle(engine, cmd);
                self.drain(engine) || added
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => {
                self.closed = true;
                false
            }
        }
    }

    /// Applies one command; returns whether it added a request.
    fn handle<E: StepExecutor>(&mut self, engine: &mut Engine<E>, cmd: Command) -> bool {
        match cmd {
            Command::Add { request, events } => {
                engine.add(*request, events);
                return true;
            }
            Command::Cancel { id } => engine.cancel(id),
            Command::ResetPrefixCache => engine.reset_prefix_cache(),
            Command::Shutdown => self.stop = true,
        }
        false
    }
}

fn run<E: StepExecutor>(
    mut engine: Engine<E>,
    commands: mpsc::Receiver<Command>,
    cancels: mpsc::Receiver<u64>,
    stats: watch::Sender<EngineStats>,
    kv: tmpsc::UnboundedSender<Vec<KvEvent>>,
) {
    let mut inbox = Inbox {
        commands,
        cancels,
        cancelled: Vec::new(),
        stop: false,
        closed: false,
    };
    engine.set_publisher(Box::new(
        move |s: &EngineStats, events: &mut Vec<KvEvent>| {
            stats.send_replace(s.clone());
            if !events.is_empty() {
                let _ = kv.send(std::mem::take(events));
            }
        },
    ));
    let mut idle_wait = false;
    loop {
        if engine.is_idle() || idle_wait {
            if engine.publication_due() {
                engine.refresh_stats();
                engine.publish();
            }
            engine.note_wait();
            inbox.wait(&mut engine);
        }
        inbox.drain(&mut engine);
        if inbox.stop {
            break;
        }
        // A step with requests present but nothing runnable waits briefly for commands
        // instead of spinning.
        let ran = !engine.is_idle() && engine.begin_step();
        if ran {
            // While the step computes: the commands that arrived, and those that arrive while
            // the step ahead can still take them in.
            if inbox.drain(&mut engine) {
                engine.top_up();
            }
            while !inbox.stop
                && !inbox.closed
                && let Some(window) = engine.arrival_window()
            {
                if inbox.wait_for(&mut engine, window) {
                    engine.top_up();
                }
            }
            engine.complete_step();
        }
        idle_wait = !engine.is_idle() && !ran;
        if engine.is_lost() {
            tracing::error!("the replica's device was lost; the replica stops serving");
            break;
        }
        engine.refresh_stats();
        if ran && !engine.is_idle() {
            // The next step publishes this one while the device computes.
            engine.defer_publication();
        } else {
            engine.publish();
        }
        if inbox.stop {
            break;
        }
    }
    engine.cancel_all();
    engine.refresh_stats();
    engine.publish();
}
