//! GPT-2 / CLIP byte-level alphabet: every byte 0..=255 is written as one printable Unicode character so that
//! BPE vocabularies can be stored as text.
//!
//! The 188 bytes that are printable Latin-1 characters (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the
//! remaining 68 bytes (controls, space, DEL, NBSP, soft hyphen, ...) are given the code points 256, 257, ... in
//! increasing byte order. The "alphabet order" (printable bytes first, then the others) is also the order of the
//! first 256 ids of the CLIP vocabulary.

/// Whether a byte is one of the 188 bytes that map to the character with the same code point.
fn is_direct(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The character that stands for `byte` in the byte-level alphabet.
pub fn byte_to_char(byte: u8) -> char {
    if is_direct(byte) {
        return char::from(byte);
    }
    // Index of this byte among the non-direct bytes, in increasing byte order.
    let offset = (0..byte).filter(|&b| !is_direct(b)).count() as u32;
    char::from_u32(256 + offset).expect("256..324 are valid scalar values")
}

/// The inverse of [`byte_to_char`], `None` for characters outside the alphabet.
#[cfg(test)]
pub fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 256 {
        let b = cp as u8;
        return is_direct(b).then_some(b);
    }
    let offset = cp.checked_sub(256)? as usize;
    (0..=255u8).filter(|&b| !is_direct(b)).nth(offset)
}

/// The 256 bytes in alphabet order: the printable bytes ascending, then the others ascending.
pub fn alphabet_order() -> Vec<u8> {
    let mut order: Vec<u8> = (0..=255u8).filter(|&b| is_direct(b)).collect();
    order.extend((0..=255u8).filter(|&b| !is_direct(b)));
    order
}

/// Table of [`byte_to_char`] for all bytes.
pub fn byte_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    for (i, slot) in table.iter_mut().enumerate() {
        *slot = byte_to_char(i as u8);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_bytes_map_to_themselves() {
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(b'!'), '!');
        assert_eq!(byte_to_char(b'~'), '~');
        assert_eq!(byte_to_char(0xA1), '¡');
        assert_eq!(byte_to_char(0xFF), 'ÿ');
    }

    #[test]
    fn other_bytes_map_above_255() {
        assert_eq!(byte_to_char(0x00), '\u{100}'); // Ā
        assert_eq!(byte_to_char(b' '), '\u{120}'); // Ġ, as in GPT-2 vocabularies
        assert_eq!(byte_to_char(b'\n'), '\u{10A}'); // Ċ
        assert_eq!(byte_to_char(0x7F), '\u{121}');
        assert_eq!(byte_to_char(0xAD), '\u{143}'); // soft hyphen is the last one: 256 + 67
    }

    #[test]
    fn mapping_is_a_bijection() {
        let table = byte_table();
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = table[b as usize];
            assert!(seen.insert(c), "duplicate char for byte {b}");
            assert_eq!(char_to_byte(c), Some(b));
            assert!(
                !c.is_whitespace() && !c.is_control(),
                "byte {b} maps to unprintable {c:?}"
            );
        }
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte(' '), None);
        assert_eq!(char_to_byte('€'), None);
    }

    #[test]
    fn alphabet_order_starts_with_printables() {
        let order = alphabet_order();
        assert_eq!(order.len(), 256);
        assert_eq!(order[0], b'!');
        assert_eq!(order[93], b'~');
        assert_eq!(order[94], 0xA1);
        assert_eq!(order[187], 0xFF);
        assert_eq!(order[188], 0x00);
        assert_eq!(order[255], 0xAD);
    }
}
