//! Reloadable plugin handles and the per-adapter instance slot.
//!
//! A [`PluginHandle`] is shared by every adapter of one policy: it holds the current
//! [`LoadedPlugin`] and a generation number. Reloading compiles and checks the new plugin off
//! the hot thread, then swaps it in; each adapter notices the new generation at its next call
//! boundary (one atomic load per call) and replaces its instance. A failed reload leaves the
//! old plugin in place; an adapter that cannot instantiate the new one keeps its old instance.
//!
//! A [`Slot`] is one adapter's instance: created lazily, dropped after any failed call (a
//! trapped instance is poisoned) and re-created at the next call, with a growing back-off when
//! re-creation keeps failing. The slot lock is never held across a plugin call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

/// Most calls skipped between two failed re-creation attempts.
const MAX_BACKOFF: u32 = 1024;

/// One adapter's instance of the handle's plugin.
pub struct Slot {
    handle: Arc<PluginHandle>,
    seen_generation: u64,
    instance: Option<Instance>,
    /// Calls to skip before trying to create an instance again, and the next back-off.
    skip: u32,
    backoff: u32,
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
            skip: 0,
            backoff: 1,
        }
    }

    /// The instance to call, after switching to a reloaded plugin or replacing a poisoned
    /// instance; `Err` (reason `Unavailable`) when none can be had for this call.
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
                    self.reset_backoff();
                }
                Err(e) => tracing::warn!(
                    plugin = %self.handle.current().name,
                    error = %e,
                    "reloaded plugin could not be instantiated here; keeping the previous instance"
                ),
            }
        }
        if self.instance.is_none() {
            if self.skip > 0 {
                self.skip -= 1;
                return Err(CallError {
                    reason: FallbackReason::Unavailable,
                    detail: "instance re-creation is backing off after failures".into(),
                });
            }
            match Instance::new(self.handle.current()) {
                Ok(i) => {
                    self.instance = Some(i);
                    fresh = true;
                    self.reset_backoff();
                }
                Err(e) => {
                    self.skip = self.backoff;
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
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

    /// Drops the instance after a failed call; the next call creates a new one.
    pub fn poison(&mut self) {
        self.instance = None;
    }

    fn reset_backoff(&mut self) {
        self.skip = 0;
        self.backoff = 1;
    }
}
