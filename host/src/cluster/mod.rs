//! Running under cluster engines: what chimera tells external routers.
//!
//! - [`announce`]: the hybrid rule for external prefix routers (which blocks a worker may
//!   announce), shared by the Dynamo worker (`chimera-dynamo`) and the vLLM-compatible event
//!   publisher.

pub mod announce;

pub use announce::{Announcement, Announcer};
