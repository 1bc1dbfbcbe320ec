//! Reloadable plugin handles and the per-adapter instance slot.
//!
//! A [`PluginHandle`] is shared by every adapter of one policy: it holds the current
//! [`LoadedPlugin`] and a generation number. Reloading compiles and checks the new plugin off
//! the hot thread, then swaps it in; each adapter notices the new generation at its next call
//! boundary (one atomic load per call) and replaces its instance. A failed reload leaves the
//! old plugin in place; an adapter that cannot instantiate the new one keeps its old instance.
//!
//! A [`Slot`] is one adapter's instance: created lazily, dropped after a trap, timeout or
//! memory denial (the instance may be poisoned) and re-created at the next call. A plugin that
//! fails [`QUARANTINE_AFTER`] calls in a row (or cannot be instantiated) is quarantined: it is
//! not called at all for a while, 100 ms at first and doubling up to a minute while it keeps
//! failing, so a plugin that loops forever costs a few deadlines per quarantine instead of one
//! per engine step. One good answer ends the doubling; a reload ends the quarantine. The slot
//! lock is never held across a plugin call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::PluginKind;
use super::instance::{CallError, Instance};
use super::metrics::FallbackReason;
use super::runtime::LoadedPlugin;

/// The current plugin of one policy, swappable while serving.
#[derive(Debug)]
pub struct PluginHandle {
    kind: PluginKind,
    current: Mutex<Arc<LoadedPlugin>>,
    generation: AtomicU64,
}

impl PluginHandle {
    pub fn new(plugin: Arc<LoadedPlugin>) -> Arc<Self> {
        Arc::new(Self {
            kind: plugin.kind,
            current: Mutex::new(plugin),
            generation: AtomicU64::new(0),
        })
    }

    pub fn kind(&self) -> PluginKind {
        self.kind
    }

    pub fn current(&self) -> Arc<LoadedPlugin> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Installs `plugin` (already checked, same kind); adapters switch at their next call.
    pub(crate) fn swap(&self, plugin: Arc<LoadedPlugin>) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = plugin;
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// Failed calls in a row that put a plugin in quarantine.
pub const QUARANTINE_AFTER: u32 = 3;
/// The first quarantine; each one after it, without a good answer between, lasts twice as long.
const FIRST_QUARANTINE: Duration = Duration::from_millis(100);
const MAX_QUARANTINE: Duration = Duration::from_secs(60);

/// One adapter's instance of the handle's plugin.
pub struct Slot {
    handle: Arc<PluginHandle>,
    seen_generation: u64,
    instance: Option<Instance>,
    /// Failed calls (and instantiations) since the last good answer.
    failures: u32,
    quarantined_until: Option<Instant>,
    next_quarantine: Duration,
}

/// A usable instance, and whether it was just created (its plugin state is empty).
pub struct Ready<'a> {
    pub instance: &'a mut Instance,
    pub fresh: bool,
}

impl Slot {
    pub fn new(handle: Arc<PluginHandle>) -> Self {
        let seen_generation = handle.generation();
        let instance = Instance::new(handle.current()).ok();
        Self {
            handle,
            seen_generation,
            instance,
            failures: 0,
            quarantined_until: None,
            next_quarantine: FIRST_QUARANTINE,
        }
    }

    /// The instance to call, after switching to a reloaded plugin or replacing a poisoned
    /// instance; `Err` (reason `Quarantined` or `Unavailable`) when none may or can be had for
    /// this call.
    pub fn ready(&mut self) -> Result<Ready<'_>, CallError> {
        let mut fresh = false;
        let generation = self.handle.generation();
        if generation != self.seen_generation {
            self.seen_generation = generation;
            let plugin = self.handle.current();
            match Instance::new(plugin) {
                Ok(i) => {
                    self.instance = Some(i);
                    fresh = true;
                    // A new plugin starts with a clean record.
                    self.succeeded();
                    self.quarantined_until = None;
                }
                Err(e) => tracing::warn!(
                    plugin = %self.handle.current().name,
                    error = %e,
                    "reloaded plugin could not be instantiated here; keeping the previous instance"
                ),
            }
        }
        if let Some(until) = self.quarantined_until {
            if Instant::now() < until {
                return Err(CallError {
                    reason: FallbackReason::Quarantined,
                    detail: "quarantined after repeated failures".into(),
                });
            }
            self.quarantined_until = None;
        }
        if self.instance.is_none() {
            match Instance::new(self.handle.current()) {
                Ok(i) => {
                    self.instance = Some(i);
                    fresh = true;
                }
                Err(e) => {
                    self.failed(false);
                    return Err(CallError {
                        reason: FallbackReason::Unavailable,
                        detail: e.to_string(),
                    });
                }
            }
        }
        match self.instance.as_mut() {
            Some(instance) => Ok(Ready { instance, fresh }),
            None => Err(CallError {
                reason: FallbackReason::Unavailable,
                detail: "no instance".into(),
            }),
        }
    }

    /// Records a good answer (a `none` counts as one).
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.next_quarantine = FIRST_QUARANTINE;
    }

    /// Records a failed call, dropping the instance if it may be poisoned. Returns how long the
    /// plugin is quarantined if this failure started a quarantine.
    pub fn failed(&mut self, poisoned: bool) -> Option<Duration> {
        if poisoned {
            self.instance = None;
        }
        self.failures += 1;
        if self.failures < QUARANTINE_AFTER {
            return None;
        }
        // The instance is dropped: after the quarantine a fresh one starts from a clean state
        // (an evictor's is sent the whole cache again).
        self.instance = None;
        self.failures = 0;
        let length = self.next_quarantine;
        self.quarantined_until = Some(Instant::now() + length);
        self.next_quarantine = (length * 2).min(MAX_QUARANTINE);
        Some(length)
    }

    /// Drops the instance; the next call creates a new one.
    pub fn poison(&mut self) {
        self.instance = None;
    }
}
