//! Helpers for `model_sources`: a fake Hugging Face hub on a loopback port.

#![allow(dead_code)]

pub mod fake_hub;
