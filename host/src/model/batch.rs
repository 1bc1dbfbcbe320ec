//! What the engine and the model agree on besides the step plan (which lives with the
//! backend, [`crate::backend::StepPlan`]): the snapshot points chosen by the cache manager and
//! the cache sizes a model needs. Both are the cache's types; the model only reads them.

pub use crate::cache::{CacheSpec, SsmSnapshot};
