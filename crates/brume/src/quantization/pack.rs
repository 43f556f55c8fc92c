//! n-bit index packing: a little-endian bit stream, value `i` at bits
//! `[i * n, (i + 1) * n)`, least significant bit first. Eight values of any width
//! end on a byte boundary, so a run of rows can be decoded from any multiple of 8.

use super::scheme::Bits;

/// Packs `indices` (each `< 2^bits`) into `bits.packed_len(indices.len())` bytes.
/// Higher bits of an index are ignored: callers produce indices in range.
pub fn pack(indices: &[u8], bits: Bits) -> Vec<u8> {
    let n = bits.get();
    let mut out = vec![0u8; bits.packed_len(indices.len())];
    match bits {
        Bits::B8 => out.copy_from_slice(indices),
        _ => {
            let mask = ((1u16 << n) - 1) as u8;
            for (i, &v) in indices.iter().enumerate() {
                let pos = i * n as usize;
                let (byte, shift) = (pos / 8, pos % 8);
                let v = (v & mask) as u16;
                out[byte] |= (v << shift) as u8;
                if shift + n as usize > 8 {
                    out[byte + 1] |= (v >> (8 - shift)) as u8;
                }
            }
        }
    }
    out
}

/// The index at position `i` of a packed stream.
#[inline(always)]
fn index_at(bytes: &[u8], bits: Bits, i: usize) -> usize {
    match bits {
        Bits::B8 => bytes[i] as usize,
        Bits::B4 => ((bytes[i >> 1] >> ((i & 1) * 4)) & 0xf) as usize,
        Bits::B2 => ((bytes[i >> 2] >> ((i & 3) * 2)) & 0x3) as usize,
        Bits::B6 => {
            let pos = i * 6;
            let byte = pos >> 3;
            let lo = bytes[byte] as u16;
            let hi = bytes.get(byte + 1).copied().unwrap_or(0) as u16;
            (((lo | (hi << 8)) >> (pos & 7)) & 0x3f) as usize
        }
    }
}

/// Unpacks `out.len()` indices starting at value position `start`.
/// `bytes` must hold them (checked by the caller against the tensor's shape).
pub fn unpack(bytes: &[u8], bits: Bits, start: usize, out: &mut [u8]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = index_at(bytes, bits, start + j) as u8;
    }
}

/// Decodes `out.len()` values from position `start` through `table`
/// (`table.len() == 2^bits`): the hot loop of palettized and ternary weights.
pub fn unpack_lookup(bytes: &[u8], bits: Bits, start: usize, table: &[f32], out: &mut [f32]) {
    debug_assert_eq!(table.len(), bits.levels());
    match bits {
        Bits::B8 => {
            let table: &[f32; 256] = table.try_into().unwrap_or(&[0.0; 256]);
            let n = out.len();
            for (o, &b) in out.iter_mut().zip(&bytes[start..start + n]) {
                *o = table[b as usize];
            }
        }
        Bits::B4 if start % 2 == 0 => {
            let table: &[f32; 16] = table.try_into().unwrap_or(&[0.0; 16]);
            let pairs = out.len() / 2;
            let src = &bytes[start / 2..start / 2 + out.len().div_ceil(2)];
            let (body, tail) = out.split_at_mut(pairs * 2);
            for (o, &b) in body.chunks_exact_mut(2).zip(src) {
                o[0] = table[(b & 0xf) as usize];
                o[1] = table[(b >> 4) as usize];
            }
            if let Some(t) = tail.first_mut() {
                *t = table[(src[pairs] & 0xf) as usize];
            }
        }
        Bits::B2 if start % 4 == 0 => {
            let table: &[f32; 4] = table.try_into().unwrap_or(&[0.0; 4]);
            let quads = out.len() / 4;
            let src = &bytes[start / 4..start / 4 + out.len().div_ceil(4)];
            let (body, tail) = out.split_at_mut(quads * 4);
            for (o, &b) in body.chunks_exact_mut(4).zip(src) {
                o[0] = table[(b & 3) as usize];
                o[1] = table[((b >> 2) & 3) as usize];
                o[2] = table[((b >> 4) & 3) as usize];
                o[3] = table[(b >> 6) as usize];
            }
            for (j, t) in tail.iter_mut().enumerate() {
                *t = table[((src[quads] >> (2 * j)) & 3) as usize];
            }
        }
        _ => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = table[index_at(bytes, bits, start + j)];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_for_every_width_and_offset() {
        let mut state = 12345u64;
        for bits in Bits::ALL {
            for len in [0usize, 1, 2, 3, 7, 8, 9, 31, 64, 1001] {
                let values: Vec<u8> = (0..len)
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((state >> 33) as usize % bits.levels()) as u8
                    })
                    .collect();
                let packed = pack(&values, bits);
                assert_eq!(packed.len(), (len * bits.get() as usize).div_ceil(8));
                let mut back = vec![0u8; len];
                unpack(&packed, bits, 0, &mut back);
                assert_eq!(back, values, "{bits:?} len {len}");
                // From any starting position, and through a table.
                let table: Vec<f32> = (0..bits.levels()).map(|i| i as f32 * 0.5 - 3.0).collect();
                for start in [0, 1, 3, len / 2] {
                    if start > len {
                        continue;
                    }
                    let mut part = vec![0u8; len - start];
                    unpack(&packed, bits, start, &mut part);
                    assert_eq!(part, values[start..]);
                    let mut f = vec![0f32; len - start];
                    unpack_lookup(&packed, bits, start, &table, &mut f);
                    let want: Vec<f32> = values[start..].iter().map(|&v| table[v as usize]).collect();
                    assert_eq!(f, want, "{bits:?} len {len} start {start}");
                }
            }
        }
    }

    #[test]
    fn layout_is_lsb_first() {
        assert_eq!(pack(&[1, 2], Bits::B4), vec![0x21]);
        assert_eq!(pack(&[1, 2, 3, 0], Bits::B2), vec![0b00_11_10_01]);
        // 6-bit: 0b111111 then 0b000001 -> low byte 0b01_111111, high 0b0000.
        assert_eq!(pack(&[63, 1], Bits::B6), vec![0b0111_1111, 0b0000_0000]);
    }
}
