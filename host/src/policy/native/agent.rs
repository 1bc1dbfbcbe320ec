//! Native twins of the built-in constraint and parser plugins (TEMPORARY placeholder while the
//! core crates are merged).

use std::sync::Arc;

use chimera_policy_core::Config;

use crate::plugins::Vocabulary;
use crate::policy::{Constrainer, OutputParser};

pub fn check_constraint(_name: &str, _config: &Config) -> Result<(), String> {
    Ok(())
}

pub fn check_parser(_name: &str, _config: &Config) -> Result<(), String> {
    Ok(())
}

pub fn constrainer(_config: &Config, _vocabulary: &Arc<Vocabulary>) -> Box<dyn Constrainer> {
    unimplemented!()
}

pub fn parser(_config: &Config) -> Box<dyn OutputParser> {
    unimplemented!()
}
