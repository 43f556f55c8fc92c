//! YUV4MPEG2 (Y4M), the uncompressed video format ffmpeg, x264 and Chromium's fake
//! camera read and write: a one-line header (`YUV4MPEG2 W640 H480 F30:1 C420jpeg ...`)
//! then `FRAME` records, each a line then the planes (Y, then U and V, subsampled by
//! the colour space). Parsed here directly: it needs no codec.

use std::io::{BufRead, Write};

use image::RgbImage;

use crate::error::{LiveError, Result};

/// Largest side accepted (as brume's image inputs).
pub const MAX_SIDE: usize = 4096;

/// Chroma layout of the planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chroma {
    /// 4:2:0 (C420, C420jpeg, C420paldv, C420mpeg2; the default when none is named).
    C420,
    C422,
    C444,
    /// Luma only.
    Mono,
}

/// A Y4M stream's header.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub width: usize,
    pub height: usize,
    /// Frames per second (F num:den), when the header gives a usable one.
    pub fps: Option<f64>,
    pub chroma: Chroma,
}

impl Header {
    fn chroma_size(&self) -> (usize, usize) {
        match self.chroma {
            Chroma::C420 => (self.width.div_ceil(2), self.height.div_ceil(2)),
            Chroma::C422 => (self.width.div_ceil(2), self.height),
            Chroma::C444 => (self.width, self.height),
            Chroma::Mono => (0, 0),
        }
    }

    /// Bytes of one frame's planes.
    pub fn frame_bytes(&self) -> usize {
        let (cw, ch) = self.chroma_size();
        self.width * self.height + 2 * cw * ch
    }
}

/// Reads one line (up to `limit` bytes, without the newline); `None` at a clean end of stream.
fn read_line(r: &mut impl BufRead, limit: usize, what: &str) -> Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    let mut limited = std::io::Read::take(&mut *r, limit as u64 + 1);
    let n = limited
        .read_until(b'\n', &mut line)
        .map_err(|e| LiveError::Y4m(format!("reading the {what}: {e}")))?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() != Some(&b'\n') {
        return Err(LiveError::Y4m(format!(
            "the {what} line is not terminated within {limit} bytes"
        )));
    }
    line.pop();
    Ok(Some(line))
}

fn parse_ratio(v: &str) -> Option<f64> {
    let (n, d) = v.split_once(':')?;
    let (n, d): (f64, f64) = (n.parse().ok()?, d.parse().ok()?);
    (n > 0.0 && d > 0.0).then_some(n / d)
}

/// Parses the header line (from the stream's start).
pub fn read_header(r: &mut impl BufRead) -> Result<Header> {
    let head = r
        .fill_buf()
        .map_err(|e| LiveError::Y4m(format!("reading the header: {e}")))?;
    if !head.is_empty()
        && !b"YUV4MPEG2 ".starts_with(&head[..head.len().min(10)])
        && !head.starts_with(b"YUV4MPEG2 ")
    {
        return Err(LiveError::Y4m(
            "not a Y4M file: it does not start with `YUV4MPEG2 `".into(),
        ));
    }
    let line =
        read_line(r, 1024, "header")?.ok_or_else(|| LiveError::Y4m("the file is empty".into()))?;
    let line =
        String::from_utf8(line).map_err(|_| LiveError::Y4m("the header is not text".into()))?;
    let mut fields = line.split(' ');
    if fields.next() != Some("YUV4MPEG2") {
        return Err(LiveError::Y4m(
            "not a Y4M file: it does not start with `YUV4MPEG2 `".into(),
        ));
    }
    let (mut width, mut height, mut fps, mut chroma) = (None, None, None, Chroma::C420);
    for f in fields.filter(|f| !f.is_empty()) {
        let (tag, v) = f.split_at(1);
        match tag {
            "W" => width = Some(v.parse::<usize>().map_err(|_| LiveError::Y4m(format!("header field W (width) `{v}` is not a number")))?),
            "H" => height = Some(v.parse::<usize>().map_err(|_| LiveError::Y4m(format!("header field H (height) `{v}` is not a number")))?),
            "F" => fps = parse_ratio(v),
            "C" => {
                chroma = match v {
                    "420" | "420jpeg" | "420paldv" | "420mpeg2" => Chroma::C420,
                    "422" => Chroma::C422,
                    "444" => Chroma::C444,
                    "mono" => Chroma::Mono,
                    other => {
                        return Err(LiveError::Y4m(format!(
                            "header field C (colour space) `{other}` is not supported (8-bit 420, 422, 444 or mono expected)"
                        )))
                    }
                }
            }
            "I" => {
                if v != "p" && v != "?" {
                    tracing::warn!("Y4M interlacing `I{v}`: frames are read as progressive");
                }
            }
            _ => {} // A (aspect), X (comments): nothing to do.
        }
    }
    let width = width.ok_or_else(|| LiveError::Y4m("the header has no W (width) field".into()))?;
    let height =
        height.ok_or_else(|| LiveError::Y4m("the header has no H (height) field".into()))?;
    if width == 0 || height == 0 || width > MAX_SIDE || height > MAX_SIDE {
        return Err(LiveError::Y4m(format!(
            "frame size {width}x{height} is out of range (1..={MAX_SIDE} per side)"
        )));
    }
    Ok(Header {
        width,
        height,
        fps,
        chroma,
    })
}

/// Reads the next frame's planes; `None` at the end of the stream.
pub fn read_frame(r: &mut impl BufRead, h: &Header, buf: &mut Vec<u8>) -> Result<bool> {
    let Some(line) = read_line(r, 1024, "FRAME")? else {
        return Ok(false);
    };
    if !line.starts_with(b"FRAME") {
        return Err(LiveError::Y4m("a frame does not start with `FRAME`".into()));
    }
    buf.resize(h.frame_bytes(), 0);
    r.read_exact(buf).map_err(|e| {
        LiveError::Y4m(format!(
            "a frame is cut short ({} bytes expected): {e}",
            h.frame_bytes()
        ))
    })?;
    Ok(true)
}

fn clamp8(v: f32) -> u8 {
    v.round().clamp(0.0, 255.0) as u8
}

/// One frame's planes to RGB: BT.601 limited range (what ffmpeg's yuv4mpegpipe and
/// Chromium's fake camera use), chroma by nearest sample.
pub fn to_rgb(h: &Header, planes: &[u8]) -> Result<RgbImage> {
    if planes.len() < h.frame_bytes() {
        return Err(LiveError::Y4m(format!(
            "a frame has {} bytes, {} expected",
            planes.len(),
            h.frame_bytes()
        )));
    }
    let (w, ht) = (h.width, h.height);
    let (cw, ch) = h.chroma_size();
    let (y, rest) = planes.split_at(w * ht);
    let (u, v) = rest.split_at(cw * ch);
    let mut out = Vec::with_capacity(w * ht * 3);
    for row in 0..ht {
        for col in 0..w {
            let yy = 1.164_383 * (y[row * w + col] as f32 - 16.0);
            let (cb, cr) = if h.chroma == Chroma::Mono {
                (0.0, 0.0)
            } else {
                let (cx, cy) = (col * cw / w, row * ch / ht);
                (
                    u[cy * cw + cx] as f32 - 128.0,
                    v[cy * cw + cx] as f32 - 128.0,
                )
            };
            out.push(clamp8(yy + 1.596_027 * cr));
            out.push(clamp8(yy - 0.391_762 * cb - 0.812_968 * cr));
            out.push(clamp8(yy + 2.017_232 * cb));
        }
    }
    RgbImage::from_raw(w as u32, ht as u32, out)
        .ok_or_else(|| LiveError::Y4m("frame buffer size mismatch".into()))
}

/// Writes RGB frames as a 4:2:0 Y4M stream (BT.601 limited range, chroma averaged
/// over each 2x2 block): test inputs, and what Chromium's fake camera reads.
pub fn write(w: &mut impl Write, frames: &[RgbImage], fps: u32) -> std::io::Result<()> {
    let Some(first) = frames.first() else {
        return Ok(());
    };
    let (width, height) = (first.width() as usize, first.height() as usize);
    writeln!(w, "YUV4MPEG2 W{width} H{height} F{fps}:1 Ip A1:1 C420jpeg")?;
    let (cw, ch) = (width.div_ceil(2), height.div_ceil(2));
    for f in frames {
        if (f.width() as usize, f.height() as usize) != (width, height) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "Y4M frames must all have the same size",
            ));
        }
        let px = |x: usize, y: usize| {
            f.get_pixel(x.min(width - 1) as u32, y.min(height - 1) as u32)
                .0
                .map(|c| c as f32)
        };
        let mut y_plane = Vec::with_capacity(width * height);
        for y in 0..height {
            for x in 0..width {
                let [r, g, b] = px(x, y);
                y_plane.push(clamp8(16.0 + 0.256_788 * r + 0.504_129 * g + 0.097_906 * b));
            }
        }
        let (mut u_plane, mut v_plane) = (Vec::with_capacity(cw * ch), Vec::with_capacity(cw * ch));
        for cy in 0..ch {
            for cx in 0..cw {
                let mut acc = [0f32; 3];
                for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                    let p = px(2 * cx + dx, 2 * cy + dy);
                    for k in 0..3 {
                        acc[k] += p[k] / 4.0;
                    }
                }
                let [r, g, b] = acc;
                u_plane.push(clamp8(
                    128.0 - 0.148_223 * r - 0.290_993 * g + 0.439_216 * b,
                ));
                v_plane.push(clamp8(
                    128.0 + 0.439_216 * r - 0.367_788 * g - 0.071_427 * b,
                ));
            }
        }
        w.write_all(b"FRAME\n")?;
        w.write_all(&y_plane)?;
        w.write_all(&u_plane)?;
        w.write_all(&v_plane)?;
    }
    Ok(())
}
