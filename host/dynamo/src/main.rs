//! `chimera-dynamo`: chimera's engines as an NVIDIA Dynamo worker.
//!
//! Dynamo's frontend serves the OpenAI API (tokenizing with the model's own tokenizer and chat
//! template), its KV router picks a worker, and this process runs the request on one of its
//! engine replicas, chosen by chimera's own router plugin. Registration, the request and
//! response planes, cancellation, draining on SIGTERM and health probes are Dynamo's
//! (`dynamo-backend-common`'s `Worker`); the engine side is [`engine::ChimeraEngine`]. KV
//! events follow the hybrid rule ([`chimera::cluster::Announcer`]): a block is announced to the
//! router only once a recurrent state can resume from it.

mod engine;
mod kv;

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use dynamo_backend_common::{CommonArgs, DisaggregationMode, WorkerConfig};

use chimera::app::LoadedModel;
use chimera::cli::EngineArgs;

use crate::kv::AnnounceRule;

#[derive(Parser)]
#[command(
    name = "chimera-dynamo",
    version,
    about = "chimera's engines as an NVIDIA Dynamo worker (etcd + NATS discovery, Dynamo's frontend and KV router)"
)]
struct Args {
    #[command(flatten)]
    dynamo: CommonArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Which cached blocks the KV router is told of: `hybrid` (a block only once a recurrent
    /// state can resume from it: an SSM snapshot at or past it exists) or `all` (every KV
    /// block, as attention-only engines announce; on a hybrid this overstates reuse).
    #[arg(long, value_enum, default_value_t = AnnounceRule::Hybrid, env = "CHIMERA_KV_ANNOUNCE")]
    kv_announce: AnnounceRule,
    /// Publish no KV events (the router then routes by load only).
    #[arg(long)]
    no_kv_events: bool,
    /// Where the embedded model's card (config.json, tokenizer files) is written for the
    /// frontend. Every worker of a model must register the same card (its path included):
    /// the default, `chimera-dynamo-card` under the system's temporary directory, is one
    /// folder for every worker of a machine.
    #[arg(long)]
    card_dir: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.dynamo.disaggregation_mode != DisaggregationMode::Aggregated {
        anyhow::bail!(
            "--disaggregation-mode {:?}: chimera workers serve aggregated (prefill and decode \
             in one engine); disaggregated roles are not supported",
            args.dynamo.disaggregation_mode
        );
    }
    let config = args.engine.config()?;
    // The frontend tokenizes and renders the chat template from the model's card.
    let loaded = LoadedModel::open(&config.model.path, &config.model.revision)?;
    let scratch = args
        .card_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("chimera-dynamo-card"));
    let card = loaded
        .card_folder(&scratch)
        .context("preparing the model card for the Dynamo frontend")?;
    let served = config.server.served_name(&loaded.name);
    let common = args.dynamo;
    let endpoint_types = endpoint_types(
        &common.endpoint_types,
        loaded.codec.has_chat_template(),
        &served,
    )?;
    let worker = WorkerConfig {
        namespace: common.namespace,
        component: common.component,
        endpoint: common.endpoint,
        model_name: card.to_string_lossy().into_owned(),
        served_model_name: Some(served.clone()),
        endpoint_types,
        custom_jinja_template: common.custom_jinja_template,
        tool_call_parser: common.dyn_tool_call_parser,
        reasoning_parser: common.dyn_reasoning_parser,
        exclude_tools_when_tool_choice_none: common.exclude_tools_when_tool_choice_none,
        enable_kv_routing: !args.no_kv_events,
        metrics_labels: vec![("model".into(), served.clone())],
        runtime: common.runtime,
        enable_rl: common.enable_rl,
        ..WorkerConfig::default()
    };
    let engine = engine::ChimeraEngine::new(config, served, args.kv_announce);
    dynamo_backend_common::run(Arc::new(engine), worker)
}

/// The endpoint types to register: those asked for, less `chat` when the model has no chat
/// template (Dynamo's frontend cannot render chat messages without one and would never serve
/// the model); an error when nothing is left.
fn endpoint_types(asked: &str, has_template: bool, model: &str) -> anyhow::Result<String> {
    if has_template {
        return Ok(asked.to_string());
    }
    let kept: Vec<&str> = asked
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty() && !t.eq_ignore_ascii_case("chat"))
        .collect();
    if kept.is_empty() {
        anyhow::bail!(
            "--endpoint-types {asked:?}: {model} has no chat template (tokenizer_config.json \
             `chat_template` or chat_template.jinja), so it cannot serve chat; add \
             `completions`, or give the model a template"
        );
    }
    let kept = kept.join(",");
    if kept != asked.trim() {
        // Logging starts with Dynamo's runtime, after registration is decided.
        eprintln!("warning: {model} has no chat template: registered for {kept} only, not chat");
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::endpoint_types;

    #[test]
    fn a_model_without_a_chat_template_registers_without_chat() {
        assert_eq!(
            endpoint_types("chat,completions", true, "m").unwrap(),
            "chat,completions"
        );
        assert_eq!(
            endpoint_types("chat, completions", false, "m").unwrap(),
            "completions"
        );
        assert_eq!(
            endpoint_types("completions", false, "m").unwrap(),
            "completions"
        );
        let e = endpoint_types("chat", false, "m").unwrap_err().to_string();
        assert!(e.contains("no chat template"), "{e}");
    }
}
