//! The device clock: events on the backend's stream around each timed step (its start with
//! its first device operation, its end with its read-back), and between steps, from which
//! [`crate::backend::StepBackend::step_clock_end`] reports device busy and idle time.

use cudarc::driver::{result, sys};

use super::CudaBackend;
use super::device::Device;
use crate::backend::{BackendError, DeviceStepTime, Result};

/// Events on the stream: the current step's start and end, the previous step's end (see
/// [`StepBackend::step_clock_start`]), and the end of a read-back outside a timed step.
pub(super) struct StepClock {
    start: sys::CUevent,
    end: sys::CUevent,
    prev_end: sys::CUevent,
    done: sys::CUevent,
    /// A held tail's marks: the forward pass's end, and the arrival of its masks.
    held: sys::CUevent,
    resumed: sys::CUevent,
    /// `held` is recorded for the step being timed, and `resumed` not yet.
    holding: bool,
    /// Both are recorded for the step being timed.
    was_held: bool,
    /// A step is being timed: its start is recorded with its first device operation.
    timing: bool,
    /// Its start is recorded (just before the step's upload, see [`CudaBackend::mark_step_start`]).
    started: bool,
    /// Its end is recorded (by the read-back in `sample`).
    ended: bool,
    have_prev: bool,
}

// SAFETY: plain driver handles, used under the backend's mutex with the context current.
unsafe impl Send for StepClock {}

impl StepClock {
    fn new(dev: &Device) -> Result<Self> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let event = || result::event::create(flags).map_err(|e| dev.fail("creating an event", e));
        Ok(Self {
            start: event()?,
            end: event()?,
            prev_end: event()?,
            done: event()?,
            held: event()?,
            resumed: event()?,
            holding: false,
            was_held: false,
            timing: false,
            started: false,
            ended: false,
            have_prev: false,
        })
    }
}

impl Drop for StepClock {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        unsafe {
            let _ = result::event::destroy(self.start);
            let _ = result::event::destroy(self.end);
            let _ = result::event::destroy(self.prev_end);
            let _ = result::event::destroy(self.done);
            let _ = result::event::destroy(self.held);
            let _ = result::event::destroy(self.resumed);
        }
    }
}

impl CudaBackend {
    pub(super) fn clock_start(&self) -> Result<()> {
        self.dev().bind()?;
        let mut clock = self.clock()?;
        if let Some(c) = clock.as_mut() {
            // The start is recorded with the step's first device operation (its upload).
            c.timing = true;
            c.started = false;
            c.ended = false;
            c.holding = false;
            c.was_held = false;
        }
        Ok(())
    }

    pub(super) fn clock_end(&self) -> Result<Option<DeviceStepTime>> {
        let dev = self.dev();
        let mut clock = self.inner.clock.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = clock.as_mut() else {
            return Ok(None);
        };
        let timed = c.timing && c.started && c.ended;
        c.timing = false;
        if !timed {
            return Ok(None);
        }
        dev.bind()?;
        // SAFETY: events of this context, all recorded and complete (the read-back waited
        // for `end`, the last of them).
        let ms = |a, b| {
            unsafe { result::event::elapsed(a, b) }
                .map(f64::from)
                .map_err(|e| dev.fail("reading an event", e))
        };
        let mut busy = ms(c.start, c.end)?;
        let mut mask_wait = 0.0;
        let mut idle = if c.have_prev {
            ms(c.prev_end, c.start)?.max(0.0)
        } else {
            0.0
        };
        if c.was_held {
            // The tail's wait for its masks: the device idled inside the step.
            let wait = ms(c.held, c.resumed)?.max(0.0);
            busy = (busy - wait).max(0.0);
            idle += wait;
            mask_wait = wait;
        }
        std::mem::swap(&mut c.end, &mut c.prev_end);
        c.have_prev = true;
        Ok(Some(DeviceStepTime {
            busy_s: busy / 1e3,
            idle_before_s: idle / 1e3,
            mask_wait_s: mask_wait / 1e3,
        }))
    }

    /// Locks the step clock, creating its events on first use.
    fn clock(&self) -> Result<std::sync::MutexGuard<'_, Option<StepClock>>> {
        let mut clock = self.inner.clock.lock().unwrap_or_else(|p| p.into_inner());
        if clock.is_none() {
            *clock = Some(StepClock::new(self.dev())?);
        }
        Ok(clock)
    }

    /// Records a timed step's start, once, just before its first device operation (the
    /// upload's copy): the host's packing of the step is device idle time, not busy time.
    pub(super) fn mark_step_start(&self) -> Result<()> {
        let mut clock = self.inner.clock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clock.as_mut().filter(|c| c.timing && !c.started) {
            // SAFETY: an event of this context, recorded on its stream.
            unsafe { result::event::record(c.start, self.stream()) }
                .map_err(|e| self.dev().fail("recording an event", e))?;
            c.started = true;
        }
        Ok(())
    }

    /// [`crate::backend::StepBackend::hold_tail`]: the forward pass's end, recorded after it.
    pub(super) fn mark_tail_held(&self) -> Result<()> {
        self.dev().bind()?;
        let mut clock = self.clock()?;
        if let Some(c) = clock.as_mut().filter(|c| c.timing) {
            // SAFETY: an event of this context, recorded on its stream.
            unsafe { result::event::record(c.held, self.stream()) }
                .map_err(|e| self.dev().fail("recording an event", e))?;
            c.holding = true;
        }
        Ok(())
    }

    /// The held tail's masks are about to be sent: the device resumes from here.
    pub(super) fn mark_masks_sent(&self) -> Result<()> {
        let mut clock = self.clock()?;
        if let Some(c) = clock.as_mut().filter(|c| c.timing && c.holding) {
            // SAFETY: an event of this context, recorded on its stream.
            unsafe { result::event::record(c.resumed, self.stream()) }
                .map_err(|e| self.dev().fail("recording an event", e))?;
            c.holding = false;
            c.was_held = true;
        }
        Ok(())
    }

    /// Marks the end of a step's work (its read-back is enqueued): a timed step's end event,
    /// else the plain one. Returns the event to wait on.
    pub(super) fn record_step_end(&self) -> Result<sys::CUevent> {
        self.mark_step_start()?;
        let mut clock = self.clock()?;
        let Some(c) = clock.as_mut() else {
            return Err(BackendError::Invalid("no step clock".into()));
        };
        let ev = if c.timing {
            c.ended = true;
            c.end
        } else {
            c.done
        };
        // SAFETY: an event of this context, recorded on its stream.
        unsafe { result::event::record(ev, self.stream()) }
            .map_err(|e| self.dev().fail("recording an event", e))?;
        Ok(ev)
    }
}
