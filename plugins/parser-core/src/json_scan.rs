//! Finds where a JSON object or array ends in streamed text, without parsing it.
//!
//! Tracks strings, escapes and bracket depth byte by byte, resuming where the last call
//! stopped, so a long call fed one character at a time is scanned once. It only delimits;
//! `serde_json` decides whether the delimited text is valid.

/// What the scan found so far in the text after a call's opening marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// The value is not complete yet (or a closing marker may be starting).
    NeedMore,
    /// The first non-space byte (at this offset) opens no object or array.
    NotJson(usize),
    /// A closing marker at this offset, outside any string, before the value ended.
    Closer(usize),
    /// The value is `text[start..end]`.
    Complete { start: usize, end: usize },
}

#[derive(Debug, Clone, Default)]
pub(crate) struct JsonScan {
    /// Bytes of the text already scanned.
    pos: usize,
    start: Option<usize>,
    /// Set once the value ended; later calls report the same extent.
    end: Option<usize>,
    depth: u32,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Continues over `text` (the same text as before, possibly longer). `closer`: a marker
    /// that ends the call region when it appears outside a string.
    pub(crate) fn advance(&mut self, text: &str, closer: Option<&str>) -> Scan {
        if let (Some(start), Some(end)) = (self.start, self.end) {
            return Scan::Complete { start, end };
        }
        let bytes = text.as_bytes();
        while self.pos < bytes.len() {
            let i = self.pos;
            let b = bytes[i];
            if self.start.is_none() {
                if b.is_ascii_whitespace() {
                    self.pos += 1;
                    continue;
                }
                if b != b'{' && b != b'[' {
                    return Scan::NotJson(i);
                }
                self.start = Some(i);
            }
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                self.pos += 1;
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.pos += 1;
                        let start = self.start.unwrap_or(i);
                        self.end = Some(i + 1);
                        return Scan::Complete { start, end: i + 1 };
                    }
                }
                b'<' => {
                    if let Some(closer) = closer {
                        let rest = &bytes[i..];
                        if rest.starts_with(closer.as_bytes()) {
                            return Scan::Closer(i);
                        }
                        if closer.as_bytes().starts_with(rest) {
                            return Scan::NeedMore;
                        }
                    }
                }
                _ => {}
            }
            self.pos += 1;
        }
        Scan::NeedMore
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delimits_nested_values_with_strings() {
        let text = r#" {"a": "}{\"", "b": [1, {"c": "]"}]} tail"#;
        let end = text.find(" tail").unwrap();
        assert_eq!(
            JsonScan::default().advance(text, None),
            Scan::Complete { start: 1, end }
        );
    }

    #[test]
    fn resumes_across_chunks() {
        let full = r#"[{"x": "a\\"}, 2]"#;
        let mut scan = JsonScan::default();
        for n in 1..full.len() {
            assert_eq!(scan.advance(&full[..n], None), Scan::NeedMore, "at {n}");
        }
        let complete = Scan::Complete {
            start: 0,
            end: full.len(),
        };
        assert_eq!(scan.advance(full, None), complete);
        // Text after the value does not move its end.
        assert_eq!(scan.advance(&format!("{full} <x"), Some("<x>")), complete);
    }

    #[test]
    fn closer_outside_strings_only() {
        let c = Some("</tool_call>");
        assert_eq!(
            JsonScan::default().advance(r#"{"a": "</tool_call>"}"#, c),
            Scan::Complete { start: 0, end: 21 }
        );
        assert_eq!(
            JsonScan::default().advance(r#"{"a": 1</tool_call>"#, c),
            Scan::Closer(7)
        );
        assert_eq!(
            JsonScan::default().advance(r#"{"a": 1</tool"#, c),
            Scan::NeedMore
        );
        assert_eq!(JsonScan::default().advance("\n hi", c), Scan::NotJson(2));
    }
}
