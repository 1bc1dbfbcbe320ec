//! Finding markers (`<think>`, `<tool_call>`, ...) in streamed text.
//!
//! Owns the one rule of holding text back: only the end of a buffer that is a proper prefix of
//! a marker may wait for the next chunk; everything before it is decided now. Markers start
//! with an ASCII byte, so every offset returned here is a char boundary.

/// The first occurrence of any of `markers` in `text`: its byte offset and which marker.
pub(crate) fn find_first(text: &str, markers: &[&str]) -> Option<(usize, usize)> {
    markers
        .iter()
        .enumerate()
        .filter_map(|(k, m)| text.find(m).map(|at| (at, k)))
        .min()
}

/// The offset from which the end of `text` is a proper prefix of one of `markers` and so
/// could still become one; `text.len()` when no end of `text` could.
pub(crate) fn partial_start(text: &str, markers: &[&str]) -> usize {
    let bytes = text.as_bytes();
    let mut start = text.len();
    for marker in markers {
        let longest = marker.len().saturating_sub(1).min(bytes.len());
        for k in (1..=longest).rev() {
            let from = bytes.len() - k;
            if from < start && marker.as_bytes().starts_with(&bytes[from..]) {
                start = from;
                break;
            }
        }
    }
    start
}

/// Whether `text` is a proper prefix of `marker` (the empty text is).
pub(crate) fn could_become(text: &str, marker: &str) -> bool {
    text.len() < marker.len() && marker.starts_with(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_marker_wins_by_offset() {
        let markers = ["<tool_call>", "<|tool_call|>"];
        assert_eq!(
            find_first("a<|tool_call|>b<tool_call>", &markers),
            Some((1, 1))
        );
        assert_eq!(find_first("ab", &markers), None);
    }

    #[test]
    fn holds_back_only_a_possible_marker_start() {
        assert_eq!(partial_start("hello <tool_", &["<tool_call>"]), 6);
        assert_eq!(partial_start("hello <", &["<tool_call>"]), 6);
        assert_eq!(partial_start("hello <x", &["<tool_call>"]), 8);
        assert_eq!(partial_start("é<|to", &["<tool_call>", "<|tool_call|>"]), 2);
        // A whole marker is found, not held.
        assert_eq!(partial_start("<think>", &["<think>"]), 7);
    }

    #[test]
    fn could_become_is_proper_prefix() {
        assert!(could_become("", "<think>"));
        assert!(could_become("<thi", "<think>"));
        assert!(!could_become("<think>", "<think>"));
        assert!(!could_become("<tx", "<think>"));
    }
}
