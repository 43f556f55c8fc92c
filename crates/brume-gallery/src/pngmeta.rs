//! Bounded reading and rewriting of PNG chunks.
//!
//! Every read here trusts nothing in the file: chunk lengths are checked against
//! the bytes actually present, CRCs are verified, and compressed text (zTXt,
//! compressed iTXt) is inflated through a hard cap, so a 1 KiB chunk that would
//! inflate to 1 GiB costs at most [`MAX_TEXT_BYTES`] before it is refused.

use std::io::Read;

use crate::error::{GalleryError, Result};

/// The eight bytes every PNG starts with.
pub const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];
/// Largest text a single text chunk may hold once inflated (1 MiB); a recipe is a few KiB.
pub const MAX_TEXT_BYTES: usize = 1 << 20;
/// Largest total of all text chunks of one file once inflated.
pub const MAX_TOTAL_TEXT_BYTES: usize = 4 << 20;
/// Largest PNG file the gallery reads or stores (256 MiB; a 4096 x 4096 RGB image is at most ~50 MiB).
pub const MAX_PNG_BYTES: usize = 256 << 20;
/// Largest side the gallery decodes (for thumbnails); brume itself caps sides at 4096.
pub const MAX_SIDE: u32 = 16384;

/// One chunk of a PNG, borrowed from the file's bytes.
#[derive(Debug, Clone, Copy)]
pub struct Chunk<'a> {
    /// The four-letter type, e.g. `IHDR`.
    pub kind: [u8; 4],
    /// The chunk's data (without length, type and CRC).
    pub data: &'a [u8],
    /// The whole chunk as stored: length, type, data and CRC.
    pub raw: &'a [u8],
}

fn bad(what: &str, reason: impl Into<String>) -> GalleryError {
    GalleryError::BadPng {
        what: what.to_string(),
        reason: reason.into(),
    }
}

fn meta(what: &str, reason: impl Into<String>) -> GalleryError {
    GalleryError::Metadata {
        what: what.to_string(),
        reason: reason.into(),
    }
}

/// Splits a PNG into its chunks, checking the signature, every length against
/// the bytes present, every CRC, that IHDR comes first and that IEND ends it.
pub fn chunks<'a>(bytes: &'a [u8], what: &str) -> Result<Vec<Chunk<'a>>> {
    if bytes.len() > MAX_PNG_BYTES {
        return Err(bad(
            what,
            format!("{} bytes, more than the {} MiB limit", bytes.len(), MAX_PNG_BYTES >> 20),
        ));
    }
    if bytes.len() < 8 || bytes[..8] != PNG_SIGNATURE {
        return Err(bad(what, "no PNG signature"));
    }
    let mut out = Vec::new();
    let mut pos = 8usize;
    loop {
        let rest = &bytes[pos..];
        if rest.len() < 12 {
            return Err(bad(what, format!("truncated at byte {pos} (no IEND chunk)")));
        }
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if len > (i32::MAX as usize) || len > rest.len() - 12 {
            return Err(bad(
                what,
                format!("chunk at byte {pos} claims {len} bytes, more than the file holds"),
            ));
        }
        let kind = [rest[4], rest[5], rest[6], rest[7]];
        if !kind.iter().all(|b| b.is_ascii_alphabetic()) {
            return Err(bad(what, format!("chunk at byte {pos} has an invalid type")));
        }
        let data = &rest[8..8 + len];
        let stored_crc = u32::from_be_bytes([rest[8 + len], rest[9 + len], rest[10 + len], rest[11 + len]]);
        let mut crc = flate2::Crc::new();
        crc.update(&kind);
        crc.update(data);
        if crc.sum() != stored_crc {
            return Err(bad(
                what,
                format!("chunk {} at byte {pos} has a wrong CRC", String::from_utf8_lossy(&kind)),
            ));
        }
        if out.is_empty() && &kind != b"IHDR" {
            return Err(bad(what, "the first chunk is not IHDR"));
        }
        out.push(Chunk {
            kind,
            data,
            raw: &rest[..12 + len],
        });
        pos += 12 + len;
        if &kind == b"IEND" {
            return Ok(out);
        }
    }
}

/// Width and height from the IHDR chunk (both non-zero and at most [`MAX_SIDE`]).
pub fn dimensions(chunks: &[Chunk<'_>], what: &str) -> Result<(u32, u32)> {
    let ihdr = chunks
        .first()
        .filter(|c| &c.kind == b"IHDR")
        .ok_or_else(|| bad(what, "no IHDR chunk"))?;
    if ihdr.data.len() != 13 {
        return Err(bad(what, "IHDR chunk is not 13 bytes"));
    }
    let w = u32::from_be_bytes([ihdr.data[0], ihdr.data[1], ihdr.data[2], ihdr.data[3]]);
    let h = u32::from_be_bytes([ihdr.data[4], ihdr.data[5], ihdr.data[6], ihdr.data[7]]);
    if w == 0 || h == 0 || w > MAX_SIDE || h > MAX_SIDE {
        return Err(bad(what, format!("size {w}x{h} outside 1..={MAX_SIDE}")));
    }
    Ok((w, h))
}

fn inflate(data: &[u8], what: &str, keyword: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::ZlibDecoder::new(data)
        .take(MAX_TEXT_BYTES as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| meta(what, format!("text chunk {keyword:?} does not inflate: {e}")))?;
    if out.len() > MAX_TEXT_BYTES {
        return Err(meta(
            what,
            format!("text chunk {keyword:?} inflates to more than {} KiB; refused", MAX_TEXT_BYTES >> 10),
        ));
    }
    Ok(out)
}

fn latin1(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| b as char).collect()
}

fn split_nul<'a>(data: &'a [u8], what: &str, kind: &str) -> Result<(&'a [u8], &'a [u8])> {
    let i = data
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| meta(what, format!("{kind} chunk without a keyword end")))?;
    Ok((&data[..i], &data[i + 1..]))
}

fn keyword(raw: &[u8], what: &str) -> Result<String> {
    if raw.is_empty() || raw.len() > 79 {
        return Err(meta(what, format!("text keyword of {} bytes (1..=79 allowed)", raw.len())));
    }
    Ok(latin1(raw))
}

/// The text chunks (tEXt, zTXt, iTXt) of a PNG as (keyword, text), in file order.
/// Fails on malformed text chunks, on one inflating past [`MAX_TEXT_BYTES`] and
/// on a total past [`MAX_TOTAL_TEXT_BYTES`].
pub fn text_chunks(chunks: &[Chunk<'_>], what: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut total = 0usize;
    for c in chunks {
        let (key, text) = match &c.kind {
            b"tEXt" => {
                let (k, t) = split_nul(c.data, what, "tEXt")?;
                if t.len() > MAX_TEXT_BYTES {
                    return Err(meta(what, format!("tEXt chunk of {} bytes; refused", t.len())));
                }
                (keyword(k, what)?, latin1(t))
            }
            b"zTXt" => {
                let (k, rest) = split_nul(c.data, what, "zTXt")?;
                let key = keyword(k, what)?;
                match rest.split_first() {
                    Some((0, z)) => (key.clone(), latin1(&inflate(z, what, &key)?)),
                    _ => return Err(meta(what, format!("zTXt chunk {key:?} with an unknown compression method"))),
                }
            }
            b"iTXt" => {
                let (k, rest) = split_nul(c.data, what, "iTXt")?;
                let key = keyword(k, what)?;
                if rest.len() < 2 {
                    return Err(meta(what, format!("iTXt chunk {key:?} is truncated")));
                }
                let (flag, method) = (rest[0], rest[1]);
                let (_lang, rest) = split_nul(&rest[2..], what, "iTXt")?;
                let (_translated, body) = split_nul(rest, what, "iTXt")?;
                let bytes = match (flag, method) {
                    (0, _) if body.len() > MAX_TEXT_BYTES => {
                        return Err(meta(what, format!("iTXt chunk {key:?} of {} bytes; refused", body.len())))
                    }
                    (0, _) => body.to_vec(),
                    (1, 0) => inflate(body, what, &key)?,
                    _ => return Err(meta(what, format!("iTXt chunk {key:?} with an unknown compression"))),
                };
                let text = String::from_utf8(bytes).map_err(|_| meta(what, format!("iTXt chunk {key:?} is not UTF-8")))?;
                (key, text)
            }
            _ => continue,
        };
        total += text.len();
        if total > MAX_TOTAL_TEXT_BYTES {
            return Err(meta(
                what,
                format!("more than {} MiB of text chunks; refused", MAX_TOTAL_TEXT_BYTES >> 20),
            ));
        }
        out.push((key, text));
    }
    Ok(out)
}

/// Chunks kept by [`strip`]: what is needed to show the pixels as made, and nothing
/// that can carry words (text, EXIF, times, private chunks).
const KEPT: [&[u8; 4]; 10] = [
    b"IHDR", b"PLTE", b"tRNS", b"cHRM", b"gAMA", b"iCCP", b"sBIT", b"sRGB", b"IDAT", b"IEND",
];

/// The same PNG without any metadata: the chunks are copied byte for byte, less
/// every chunk not in a short list of pixel-affecting ones.
pub fn strip(chunks: &[Chunk<'_>]) -> Vec<u8> {
    let mut out = PNG_SIGNATURE.to_vec();
    for c in chunks {
        if KEPT.iter().any(|k| **k == c.kind) {
            out.extend_from_slice(c.raw);
        }
    }
    out
}
