//! The tokenizer files shipped with the embedded model (`host/assets/tokenizer/`), compiled
//! into the binary. Tokenizing itself lives in [`crate::server::TextCodec`].

/// `tokenizer.json` of the embedded model: byte-level BPE, 512 tokens.
pub const EMBEDDED_TOKENIZER: &[u8] = include_bytes!("../assets/tokenizer/tokenizer.json");
/// Its `tokenizer_config.json`: special tokens and the ChatML chat template.
pub const EMBEDDED_TOKENIZER_CONFIG: &[u8] =
    include_bytes!("../assets/tokenizer/tokenizer_config.json");
