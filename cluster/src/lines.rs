//! A child's output read line by line within a bound: a line longer than the bound keeps its
//! head and its tail (half the bound each) and says how much was cut between them, so one
//! multi-gigabyte line from a job's program costs its reader the bound, not the node's memory.

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The longest line a reader keeps whole (16 KiB).
pub const MAX_LINE: usize = 16 << 10;

/// Lines of `r`, each at most about `max` bytes (see the module's docs).
pub struct BoundedLines<R> {
    r: R,
    max: usize,
}

impl<R: AsyncBufRead + Unpin> BoundedLines<R> {
    pub fn new(r: R, max: usize) -> Self {
        BoundedLines { r, max: max.max(2) }
    }

    /// The next line (without its `\n` or `\r\n`), None at the end of the stream.
    pub async fn next_line(&mut self) -> std::io::Result<Option<String>> {
        let half = self.max / 2;
        let (mut head, mut tail) = (Vec::new(), Vec::new());
        let mut total = 0usize;
        loop {
            let buf = self.r.fill_buf().await?;
            if buf.is_empty() {
                if total == 0 {
                    return Ok(None);
                }
                break;
            }
            let (chunk, found) = match buf.iter().position(|b| *b == b'\n') {
                Some(i) => (&buf[..i], true),
                None => (buf, false),
            };
            total += chunk.len();
            let to_head = chunk.len().min(half.saturating_sub(head.len()));
            head.extend_from_slice(&chunk[..to_head]);
            tail.extend_from_slice(&chunk[to_head..]);
            if tail.len() > 2 * half {
                tail.drain(..tail.len() - half);
            }
            let used = chunk.len() + usize::from(found);
            self.r.consume(used);
            if found {
                break;
            }
        }
        if total > self.max {
            tail.drain(..tail.len() - half.min(tail.len()));
        }
        let cut = total - head.len() - tail.len();
        let mut line = String::from_utf8_lossy(&head).into_owned();
        if cut > 0 {
            line.push_str(&format!(" …[{cut} bytes cut]… "));
        }
        line.push_str(&String::from_utf8_lossy(&tail));
        if line.ends_with('\r') {
            line.pop();
        }
        Ok(Some(line))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn all(input: &[u8], max: usize) -> Vec<String> {
        let mut l = BoundedLines::new(tokio::io::BufReader::with_capacity(7, input), max);
        let mut out = Vec::new();
        while let Some(s) = l.next_line().await.unwrap() {
            out.push(s);
        }
        out
    }

    #[tokio::test]
    async fn short_lines_pass_long_ones_keep_head_and_tail() {
        assert_eq!(all(b"a\nbb\r\n\nccc", 8).await, vec!["a", "bb", "", "ccc"]);
        assert_eq!(all(b"12345678\n", 8).await, vec!["12345678"]);
        let long: Vec<u8> = (0..10_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let mut input = long.clone();
        input.extend_from_slice(b"\nnext\n");
        let got = all(&input, 100).await;
        assert_eq!(got.len(), 2);
        assert!(
            got[0].starts_with(std::str::from_utf8(&long[..50]).unwrap()),
            "{}",
            got[0]
        );
        assert!(got[0].ends_with(std::str::from_utf8(&long[10_000 - 50..]).unwrap()));
        assert!(got[0].contains("…[9900 bytes cut]…"), "{}", got[0]);
        assert_eq!(got[1], "next");
    }
}
