//! The engine thread of one replica: a plain OS thread running
//! `loop { drain commands and cancels → step → publish stats and cache events }`.
//!
//! It blocks on the command channel while it has no request (no busy spin), drains every
//! pending command and cancel before each step, publishes [`EngineStats`] through a `watch`
//! after every step and forwards cache events (already filtered to succeeded steps by the
//! engine). When another step follows at once, a step's figures and events are published by
//! that next step while the device computes it ([`Engine::defer_publication`]): waking their
//! readers is no part of the device's idle time between two steps; before the thread waits
//! for requests or stops, it publishes itself. Requests' events go out through a threaded [`Outbox`]: queued during a step, sent
//! to their streams by a delivery thread the engine thread owns. It holds no lock: the async
//! side reaches it only through [`EngineHandle`].

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

enum Flow {
    Continue,
    Stop,
}

fn run<E: StepExecutor>(
    mut engine: Engine<E>,
    commands: mpsc::Receiver<Command>,
    cancels: mpsc::Receiver<u64>,
    stats: watch::Sender<EngineStats>,
    kv: tmpsc::UnboundedSender<Vec<KvEvent>>,
) {
    let mut cancelled = Vec::new();
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
        // Cancels first into a list, applied after the adds drained below: a cancel sent after
        // its add can never be applied before it.
        cancelled.extend(cancels.try_iter());
        if engine.is_idle() || idle_wait {
            if engine.publication_due() {
                engine.refresh_stats();
                engine.publish();
            }
            engine.note_wait();
            let got = if engine.is_idle() {
                commands.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                commands.recv_timeout(Duration::from_millis(1))
            };
            match got {
                Ok(cmd) => {
                    if let Flow::Stop = handle(&mut engine, cmd) {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let mut stop = false;
        loop {
            match commands.try_recv() {
                Ok(cmd) => {
                    if let Flow::Stop = handle(&mut engine, cmd) {
                        stop = true;
                        break;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    stop = engine.is_idle();
                    break;
                }
            }
        }
        cancelled.extend(cancels.try_iter());
        for id in cancelled.drain(..) {
            engine.cancel(id);
        }
        if stop {
            break;
        }
        // A step with requests present but nothing runnable waits briefly for commands
        // instead of spinning.
        let ran = !engine.is_idle() && engine.step();
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
    }
    engine.cancel_all();
    engine.refresh_stats();
    engine.publish();
}

fn handle<E: StepExecutor>(engine: &mut Engine<E>, cmd: Command) -> Flow {
    match cmd {
        Command::Add { request, events } => engine.add(request, events),
        Command::Cancel { id } => engine.cancel(id),
        Command::ResetPrefixCache => engine.reset_prefix_cache(),
        Command::Shutdown => return Flow::Stop,
    }
    Flow::Continue
}
