//! Tokenizer and chat template loading.
