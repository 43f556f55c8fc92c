//! Where frames come from: a folder of PNG frames, a Y4M file (parsed here), any
//! other video through ffmpeg when it is installed, or frames drawn by a closure
//! (benchmarks, tests). Every source yields 8-bit RGB at its own size; the capture
//! stage fits them to the working size ([`fit`]).

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

use image::RgbImage;

use crate::error::{LiveError, Result};
use crate::y4m;

/// A stream of frames.
pub trait FrameSource: Send {
    /// The next frame; `None` at the end.
    fn next_frame(&mut self) -> Result<Option<RgbImage>>;
    /// The source's own rate (frames per second), when it has one.
    fn fps(&self) -> Option<f64> {
        None
    }
    /// What it is, for the report.
    fn describe(&self) -> String;
}

/// Resizes `img` to `width` pixels wide and the height that keeps its aspect,
/// both rounded down to multiples of 8 (the VAE factor), at least 8.
pub fn fit(img: &RgbImage, width: u32) -> RgbImage {
    let w = (width / 8 * 8).max(8);
    let h = ((img.height() as u64 * w as u64 / img.width().max(1) as u64) as u32 / 8 * 8).max(8);
    if img.dimensions() == (w, h) {
        img.clone()
    } else {
        image::imageops::resize(img, w, h, image::imageops::FilterType::Triangle)
    }
}

/// A folder of frames (PNG, JPEG or WebP), in file-name order.
pub struct FrameFolder {
    dir: PathBuf,
    files: Vec<PathBuf>,
    next: usize,
}

impl FrameFolder {
    pub fn open(dir: &Path) -> Result<Self> {
        let entries = std::fs::read_dir(dir).map_err(|e| LiveError::Input {
            path: dir.into(),
            message: format!("cannot list the folder: {e}"),
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_file()
                    && p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                        matches!(
                            e.to_ascii_lowercase().as_str(),
                            "png" | "jpg" | "jpeg" | "webp"
                        )
                    })
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(LiveError::Input {
                path: dir.into(),
                message: "the folder holds no PNG, JPEG or WebP frames".into(),
            });
        }
        Ok(Self {
            dir: dir.into(),
            files,
            next: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

impl FrameSource for FrameFolder {
    fn next_frame(&mut self) -> Result<Option<RgbImage>> {
        let Some(path) = self.files.get(self.next) else {
            return Ok(None);
        };
        self.next += 1;
        let bytes = std::fs::read(path).map_err(|e| LiveError::Input {
            path: path.clone(),
            message: format!("cannot read: {e}"),
        })?;
        let img = brume::pipelines::image_io::decode_image(&bytes, &path.display().to_string())?;
        Ok(Some(img.to_rgb8()))
    }

    fn describe(&self) -> String {
        format!("{} frames in {}", self.files.len(), self.dir.display())
    }
}

/// A Y4M file.
pub struct Y4mSource<R: Read + Send> {
    reader: BufReader<R>,
    header: y4m::Header,
    buf: Vec<u8>,
    what: String,
}

impl Y4mSource<std::fs::File> {
    pub fn open(path: &Path) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|e| LiveError::Input {
            path: path.into(),
            message: format!("cannot open: {e}"),
        })?;
        Self::from_reader(f, path.display().to_string()).map_err(|e| LiveError::Input {
            path: path.into(),
            message: e.to_string(),
        })
    }
}

impl<R: Read + Send> Y4mSource<R> {
    pub fn from_reader(r: R, what: String) -> Result<Self> {
        let mut reader = BufReader::new(r);
        let header = y4m::read_header(&mut reader)?;
        Ok(Self {
            reader,
            header,
            buf: Vec::new(),
            what,
        })
    }

    pub fn header(&self) -> &y4m::Header {
        &self.header
    }
}

impl<R: Read + Send> FrameSource for Y4mSource<R> {
    fn next_frame(&mut self) -> Result<Option<RgbImage>> {
        if !y4m::read_frame(&mut self.reader, &self.header, &mut self.buf)? {
            return Ok(None);
        }
        Ok(Some(y4m::to_rgb(&self.header, &self.buf)?))
    }

    fn fps(&self) -> Option<f64> {
        self.header.fps
    }

    fn describe(&self) -> String {
        format!(
            "Y4M {}x{} {}",
            self.header.width, self.header.height, self.what
        )
    }
}

/// Any video ffmpeg reads (MJPEG, MP4, ...), decoded by an `ffmpeg` child process to
/// raw RGB at `width` x `height` on a pipe.
pub struct FfmpegSource {
    child: Child,
    out: BufReader<ChildStdout>,
    width: u32,
    height: u32,
    path: PathBuf,
}

/// Whether `ffmpeg` can be started (it is on PATH).
pub fn ffmpeg_available() -> bool {
    Command::new("ffmpeg")
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl FfmpegSource {
    /// Starts ffmpeg on `path`, scaled to `width` x `height` (multiples of 8).
    pub fn open(path: &Path, width: u32, height: u32) -> Result<Self> {
        if !path.is_file() {
            return Err(LiveError::Input {
                path: path.into(),
                message: "not a file or folder that can be read".into(),
            });
        }
        let child = Command::new("ffmpeg")
            .args(["-v", "error", "-nostdin", "-i"])
            .arg(path)
            .args([
                "-vf",
                &format!("scale={width}:{height}"),
                "-f",
                "rawvideo",
                "-pix_fmt",
                "rgb24",
                "-",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LiveError::Ffmpeg(format!(
                    "{} is not a PNG frame folder or a .y4m file, and reading other video needs ffmpeg, which is not installed \
                     (or not on PATH); install ffmpeg, or convert it first: ffmpeg -i INPUT -pix_fmt yuv420p OUT.y4m",
                    path.display()
                )))
            }
            Err(e) => return Err(LiveError::Ffmpeg(format!("cannot start ffmpeg: {e}"))),
        };
        let out = child
            .stdout
            .take()
            .ok_or_else(|| LiveError::Ffmpeg("ffmpeg's output pipe is missing".into()))?;
        Ok(Self {
            child,
            out: BufReader::new(out),
            width,
            height,
            path: path.into(),
        })
    }
}

impl FrameSource for FfmpegSource {
    fn next_frame(&mut self) -> Result<Option<RgbImage>> {
        let mut buf = vec![0u8; self.width as usize * self.height as usize * 3];
        let mut got = 0;
        while got < buf.len() {
            match self.out.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LiveError::Ffmpeg(format!("reading decoded frames: {e}"))),
            }
        }
        if got == 0 {
            let status = self
                .child
                .wait()
                .map_err(|e| LiveError::Ffmpeg(format!("waiting for ffmpeg: {e}")))?;
            if !status.success() {
                return Err(LiveError::Ffmpeg(format!(
                    "ffmpeg could not decode {} ({status}; its message is above)",
                    self.path.display()
                )));
            }
            return Ok(None);
        }
        if got < buf.len() {
            return Err(LiveError::Ffmpeg(format!(
                "a decoded frame of {} was cut short",
                self.path.display()
            )));
        }
        Ok(RgbImage::from_raw(self.width, self.height, buf))
    }

    fn describe(&self) -> String {
        format!(
            "{} through ffmpeg at {}x{}",
            self.path.display(),
            self.width,
            self.height
        )
    }
}

impl Drop for FfmpegSource {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Frames drawn by a closure from their index (benchmarks, tests), `count` of them.
pub struct Synthetic<F: FnMut(u64) -> RgbImage + Send> {
    draw: F,
    next: u64,
    count: u64,
    fps: Option<f64>,
    name: String,
}

impl<F: FnMut(u64) -> RgbImage + Send> Synthetic<F> {
    pub fn new(name: impl Into<String>, count: u64, fps: Option<f64>, draw: F) -> Self {
        Self {
            draw,
            next: 0,
            count,
            fps,
            name: name.into(),
        }
    }
}

impl<F: FnMut(u64) -> RgbImage + Send> FrameSource for Synthetic<F> {
    fn next_frame(&mut self) -> Result<Option<RgbImage>> {
        if self.next >= self.count {
            return Ok(None);
        }
        self.next += 1;
        Ok(Some((self.draw)(self.next - 1)))
    }

    fn fps(&self) -> Option<f64> {
        self.fps
    }

    fn describe(&self) -> String {
        format!("{} ({} frames)", self.name, self.count)
    }
}

/// Opens `path`: a folder of frames, a `.y4m` file, else any video through ffmpeg
/// (decoded at `width` wide, its height by its aspect when ffprobe can tell, else square).
pub fn open_input(path: &Path, width: u32) -> Result<Box<dyn FrameSource>> {
    if path.is_dir() {
        return Ok(Box::new(FrameFolder::open(path)?));
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("y4m") => Ok(Box::new(Y4mSource::open(path)?)),
        Some("png" | "jpg" | "jpeg" | "webp") => Err(LiveError::Input {
            path: path.into(),
            message: "one picture is not a stream: give a folder of frames, a .y4m file or a video (ffmpeg)".into(),
        }),
        _ => {
            let (w, h) = probe_size(path).unwrap_or((width, width));
            let h = ((h as u64 * width as u64 / w.max(1) as u64) as u32 / 8 * 8).max(8);
            Ok(Box::new(FfmpegSource::open(path, width / 8 * 8, h)?))
        }
    }
}

/// The video's size through ffprobe, when ffprobe is there.
fn probe_size(path: &Path) -> Option<(u32, u32)> {
    let out = Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-select_streams",
            "v:0",
            "-show_entries",
            "stream=width,height",
            "-of",
            "csv=p=0:s=x",
        ])
        .arg(path)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?;
    let (w, h) = s.trim().split_once('x')?;
    Some((w.parse().ok()?, h.parse().ok()?))
}
