//! Incremental decoder for `text/event-stream` bodies (server-sent events).
//!
//! Owns the byte-level framing only: lines ending in `\n` or `\r\n`, `data:` fields joined
//! with `\n`, comment lines (`:`) and other fields (`event:`, `id:`, `retry:`) ignored, and an
//! event dispatched at each blank line. Chunk boundaries may fall anywhere, including inside a
//! line or a multi-byte character.
//!
//! Invariants: every complete event is returned exactly once, in order. Must not interpret the
//! event payload (that is the client's job). Lone `\r` line endings are not supported (OpenAI
//! compatible servers do not send them).

/// Turns body chunks into event payloads.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the payloads of the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(pos) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos;
            let line_end = if end > start && self.buf[end - 1] == b'\r' {
                end - 1
            } else {
                end
            };
            let line = String::from_utf8_lossy(&self.buf[start..line_end]).into_owned();
            self.line(&line, &mut out);
            start = end + 1;
        }
        self.buf.drain(..start);
        out
    }

    /// Ends the stream: an event left without its closing blank line is still returned.
    pub fn finish(&mut self) -> Option<String> {
        if !self.buf.is_empty() {
            let line = String::from_utf8_lossy(&self.buf).into_owned();
            self.buf.clear();
            let mut out = Vec::new();
            self.line(&line, &mut out);
            debug_assert!(out.is_empty());
        }
        self.data.take()
    }

    fn line(&mut self, line: &str, out: &mut Vec<String>) {
        if line.is_empty() {
            if let Some(d) = self.data.take() {
                out.push(d);
            }
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_are_reassembled() {
        let stream =
            "data: {\"a\":1}\n\n: keep-alive\n\nevent: x\r\ndata: héllo\r\n\r\ndata: [DONE]\n\n";
        let whole = SseDecoder::new().push(stream.as_bytes());
        assert_eq!(whole, vec!["{\"a\":1}", "héllo", "[DONE]"]);
        // Every split point, including inside the two-byte 'é'.
        let bytes = stream.as_bytes();
        for cut in 0..bytes.len() {
            let mut d = SseDecoder::new();
            let mut got = d.push(&bytes[..cut]);
            got.extend(d.push(&bytes[cut..]));
            assert_eq!(got, whole, "cut at {cut}");
        }
    }

    #[test]
    fn multi_line_data_and_unterminated_tail() {
        let mut d = SseDecoder::new();
        assert_eq!(d.push(b"data: a\ndata:b\n\n"), vec!["a\nb"]);
        assert!(d.push(b"data: tail").is_empty());
        assert_eq!(d.finish().as_deref(), Some("tail"));
        assert_eq!(d.finish(), None);
    }
}
