//! Support for the bounded fuzzing in the workspace's tests (proptest loops): random edits of
//! a valid document reach deeper into a parser than random bytes do.

/// Apply `edits` to `base`, in order: each is (position, operation, byte), the position taken
/// modulo the current length (plus one, for an insert at the end); operation 0 replaces the
/// byte there, 1 inserts before it, 2 deletes it.
pub fn mutate(base: &[u8], edits: &[(usize, u8, u8)]) -> Vec<u8> {
    let mut v = base.to_vec();
    for (at, op, b) in edits {
        let at = at % (v.len() + 1);
        match op % 3 {
            0 if at < v.len() => v[at] = *b,
            1 => v.insert(at, *b),
            _ if at < v.len() => {
                v.remove(at);
            }
            _ => {}
        }
    }
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn edits_replace_insert_and_delete() {
        assert_eq!(super::mutate(b"abc", &[(1, 0, b'x')]), b"axc");
        assert_eq!(super::mutate(b"abc", &[(3, 1, b'd')]), b"abcd");
        assert_eq!(super::mutate(b"abc", &[(4, 2, 0)]), b"bc");
        assert_eq!(super::mutate(b"", &[(9, 2, 0), (9, 0, 1)]), b"");
    }
}
