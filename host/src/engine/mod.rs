//! The engine: one synchronous loop per replica (schedule → forward → sample → update).

pub mod api;
