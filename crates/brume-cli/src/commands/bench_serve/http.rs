//! A small blocking HTTP/1.1 client over `std::net::TcpStream`, and a `brume
//! serve` child process, for `brume bench serve` and the service's end-to-end
//! tests (which include this file with `#[path]`, so it uses only std,
//! serde_json and libc).
//!
//! Hand-written rather than a client crate because the fuzzer must send what no
//! well-behaved client would: bytes that are not HTTP, NUL in paths, lying
//! Content-Length, bodies past the server's limit. One request per connection
//! (`Connection: close`), so a response always ends at EOF at the latest.

#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A response: status, headers (names lower-cased) and the whole body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// The request's bytes: request line, Host, the given headers, Content-Length
/// (when there is a body or the method usually has one) and `Connection: close`.
pub fn request_bytes(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || matches!(method, "POST" | "PUT" | "PATCH") {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

/// Sends one request and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<Response> {
    raw(
        addr,
        &request_bytes(addr, method, path, headers, body),
        timeout,
    )
}

/// Sends arbitrary bytes and reads one response. A write that fails because
/// the server answered early and closed (a refused oversized body) still
/// returns that answer when it can be read.
pub fn raw(addr: SocketAddr, bytes: &[u8], timeout: Duration) -> io::Result<Response> {
    let mut s = connect(addr, timeout)?;
    // No half-close after writing: hyper takes a read EOF as the client
    // leaving and drops the request (a synchronous job would be cancelled).
    let written = s.write_all(bytes).and_then(|_| s.flush());
    let mut reader = BufReader::new(s);
    // A HEAD answer has a Content-Length but no body.
    let head = bytes.starts_with(b"HEAD ");
    match read_response(&mut reader, head) {
        Ok(r) => Ok(r),
        Err(e) => Err(written.err().unwrap_or(e)),
    }
}

pub fn get(addr: SocketAddr, path: &str) -> io::Result<Response> {
    request(addr, "GET", path, &[], &[], Duration::from_secs(120))
}

pub fn post_json(addr: SocketAddr, path: &str, v: &serde_json::Value) -> io::Result<Response> {
    let body = serde_json::to_vec(v).map_err(|e| bad(e.to_string()))?;
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &body,
        Duration::from_secs(300),
    )
}

fn read_head<R: BufRead>(r: &mut R) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the connection closed before a response",
        ));
    }
    let mut parts = line.split_whitespace();
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(bad(format!("not an HTTP response: {:?}", line.trim_end())));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {:?}", line.trim_end())))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(bad("the connection closed inside the headers"));
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

fn read_chunk<R: BufRead>(r: &mut R) -> io::Result<Option<Vec<u8>>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(bad("the connection closed inside a chunked body"));
    }
    let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("").trim(), 16)
        .map_err(|_| bad(format!("bad chunk size {:?}", line.trim())))?;
    if size == 0 {
        // Trailers, then the blank line.
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 || line.trim().is_empty() {
                return Ok(None);
            }
        }
    }
    let mut buf = vec![0; size];
    r.read_exact(&mut buf)?;
    let mut crlf = [0u8; 2];
    r.read_exact(&mut crlf)?;
    Ok(Some(buf))
}

fn read_response<R: BufRead>(r: &mut R, head: bool) -> io::Result<Response> {
    let (status, headers) = read_head(r)?;
    if head {
        return Ok(Response {
            status,
            headers,
            body: Vec::new(),
        });
    }
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked")) {
        while let Some(c) = read_chunk(r)? {
            body.extend_from_slice(&c);
        }
    } else if let Some(len) = get("content-length").and_then(|l| l.parse::<usize>().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// Reads a Server-Sent Events stream, calling `on_event` with each `data:`
/// line's JSON until it returns false or the stream ends. Returns the status
/// (and the body, when the answer was not an event stream).
pub fn sse(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    mut on_event: impl FnMut(&serde_json::Value) -> bool,
) -> io::Result<Response> {
    let mut s = connect(addr, timeout)?;
    s.write_all(&request_bytes(
        addr,
        "GET",
        path,
        &[("Accept", "text/event-stream")],
        &[],
    ))?;
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r)?;
    let is_stream = headers
        .iter()
        .any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream"));
    if !is_stream {
        let mut rest = Response {
            status,
            headers,
            body: Vec::new(),
        };
        let full = read_response_body(&mut r, &rest.headers)?;
        rest.body = full;
        return Ok(rest);
    }
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut pending = Vec::<u8>::new();
    loop {
        let piece = if chunked {
            match read_chunk(&mut r)? {
                Some(c) => c,
                None => break,
            }
        } else {
            let mut buf = vec![0u8; 8192];
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            buf
        };
        pending.extend_from_slice(&piece);
        while let Some(pos) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(data.trim()) {
                    if !on_event(&v) {
                        return Ok(Response {
                            status,
                            headers,
                            body: Vec::new(),
                        });
                    }
                }
            }
        }
    }
    Ok(Response {
        status,
        headers,
        body: Vec::new(),
    })
}

fn read_response_body<R: BufRead>(r: &mut R, headers: &[(String, String)]) -> io::Result<Vec<u8>> {
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        while let Some(c) = read_chunk(r)? {
            body.extend_from_slice(&c);
        }
    } else if let Some(len) = get("content-length").and_then(|l| l.parse::<usize>().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(body)
}

/// A multipart/form-data body: text fields and files. Returns (content type, body).
pub fn multipart(fields: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "----brume-bench-7d3f1c0a9e";
    let mut body = Vec::new();
    for (name, filename, data) in fields {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match filename {
            Some(f) => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\nContent-Type: image/png\r\n\r\n").as_bytes(),
            ),
            None => body.extend_from_slice(format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes()),
        }
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// Standard base64 (with padding).
pub fn b64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            T[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            T[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// Decodes standard base64 (padding optional); `None` on any other byte.
pub fn unb64(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for c in s.as_bytes().chunks(4) {
        let mut n = 0u32;
        for (i, &b) in c.iter().enumerate() {
            n |= val(b)? << (18 - 6 * i);
        }
        out.push((n >> 16) as u8);
        if c.len() > 2 {
            out.push((n >> 8) as u8);
        }
        if c.len() > 3 {
            out.push(n as u8);
        }
    }
    Some(out)
}

/// The text chunks (tEXt and iTXt, uncompressed) of a PNG: (keyword, text).
pub fn png_texts(png: &[u8]) -> Option<Vec<(String, String)>> {
    if png.len() < 8 || &png[..8] != b"\x89PNG\r\n\x1a\n" {
        return None;
    }
    let mut out = Vec::new();
    let mut at = 8;
    while at + 8 <= png.len() {
        let len = u32::from_be_bytes(png[at..at + 4].try_into().ok()?) as usize;
        let kind = &png[at + 4..at + 8];
        let data = png.get(at + 8..at + 8 + len)?;
        match kind {
            b"tEXt" => {
                let nul = data.iter().position(|&b| b == 0)?;
                out.push((
                    String::from_utf8_lossy(&data[..nul]).into_owned(),
                    String::from_utf8_lossy(&data[nul + 1..]).into_owned(),
                ));
            }
            b"iTXt" => {
                // keyword NUL flag method lang NUL translated NUL text
                let nul = data.iter().position(|&b| b == 0)?;
                let key = String::from_utf8_lossy(&data[..nul]).into_owned();
                let compressed = *data.get(nul + 1)? != 0;
                let rest = data.get(nul + 3..)?;
                let l1 = rest.iter().position(|&b| b == 0)?;
                let rest = &rest[l1 + 1..];
                let l2 = rest.iter().position(|&b| b == 0)?;
                if !compressed {
                    out.push((key, String::from_utf8_lossy(&rest[l2 + 1..]).into_owned()));
                } else {
                    out.push((key, String::new()));
                }
            }
            b"zTXt" => {
                let nul = data.iter().position(|&b| b == 0)?;
                out.push((
                    String::from_utf8_lossy(&data[..nul]).into_owned(),
                    String::new(),
                ));
            }
            b"IEND" => break,
            _ => {}
        }
        at += 12 + len;
    }
    Some(out)
}

/// `brume serve` as a child process: its address (read from the
/// `listening on http://ADDR` line), its stderr (collected on a thread) and
/// its memory.
pub struct ServeChild {
    pub child: Child,
    pub addr: SocketAddr,
    pub data_dir: PathBuf,
    stderr: Arc<Mutex<String>>,
}

impl ServeChild {
    /// Starts `exe serve --listen 127.0.0.1:0 --data-dir DIR ARGS...` and waits
    /// (at most 180 s) until it listens.
    pub fn start(
        exe: &Path,
        data_dir: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> io::Result<ServeChild> {
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(data_dir)
            .args(args);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        Self::spawn(cmd, data_dir)
    }

    /// Starts a prepared command (`serve` and its flags already set).
    pub fn spawn(mut cmd: Command, data_dir: &Path) -> io::Result<ServeChild> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(err) = child.stderr.take() {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(err);
                let mut line = String::new();
                while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                    if let Ok(mut s) = sink.lock() {
                        s.push_str(&line);
                    }
                    line.clear();
                }
            });
        }
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                let mut r = BufReader::new(out);
                let mut line = String::new();
                while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                    let _ = tx.send(line.clone());
                    line.clear();
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) => {
                    if let Some(a) = line.trim().strip_prefix("listening on http://") {
                        let addr = a
                            .parse()
                            .map_err(|_| bad(format!("unreadable address in {line:?}")))?;
                        return Ok(ServeChild {
                            child,
                            addr,
                            data_dir: data_dir.to_path_buf(),
                            stderr,
                        });
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let _ = child.wait();
                    std::thread::sleep(Duration::from_millis(100));
                    let text = stderr.lock().map(|s| s.clone()).unwrap_or_default();
                    return Err(io::Error::other(format!(
                        "brume serve exited before listening; stderr:\n{text}"
                    )));
                }
            }
            if let Ok(Some(st)) = child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                let text = stderr.lock().map(|s| s.clone()).unwrap_or_default();
                return Err(io::Error::other(format!(
                    "brume serve exited ({st}) before listening; stderr:\n{text}"
                )));
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "brume serve did not listen within 180 s",
                ));
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the child wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Resident memory in KiB (VmRSS of /proc/PID/status).
    pub fn rss_kib(&self) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// SIGKILL, and reap it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (a clean stop), then SIGKILL after 20 s. Returns whether it
    /// exited cleanly by itself.
    pub fn stop(&mut self) -> bool {
        #[cfg(unix)]
        unsafe {
            libc::kill(self.pid() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill9();
        false
    }

    pub fn get(&self, path: &str) -> io::Result<Response> {
        get(self.addr, path)
    }

    pub fn post_json(&self, path: &str, v: &serde_json::Value) -> io::Result<Response> {
        post_json(self.addr, path, v)
    }
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill9();
        }
    }
}

/// The CPU model, from /proc/cpuinfo.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Waits for a native job to end by polling GET /api/v1/jobs/{id}; returns its last view.
pub fn wait_job(addr: SocketAddr, id: &str, timeout: Duration) -> io::Result<serde_json::Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let r = get(addr, &format!("/api/v1/jobs/{id}"))?;
        let v = r.json().ok_or_else(|| {
            bad(format!(
                "job {id}: status {} with a body that is not JSON: {}",
                r.status,
                r.text()
            ))
        })?;
        if r.status != 200 {
            return Err(bad(format!("job {id}: status {}: {}", r.status, r.text())));
        }
        if matches!(v["state"].as_str(), Some("done" | "failed" | "cancelled")) {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("job {id} did not end: {v}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Every gallery item (all pages), as the API lists them.
pub fn gallery_all(addr: SocketAddr, extra_query: &str) -> io::Result<Vec<serde_json::Value>> {
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/api/v1/gallery?limit=500{extra_query}");
        if let Some(c) = &cursor {
            path.push_str("&cursor=");
            path.push_str(&percent(c));
        }
        let r = get(addr, &path)?;
        let v = r
            .json()
            .filter(|_| r.status == 200)
            .ok_or_else(|| bad(format!("gallery list: {} {}", r.status, r.text())))?;
        items.extend(v["items"].as_array().cloned().unwrap_or_default());
        match v["next_cursor"].as_str() {
            Some(c) if !c.is_empty() => cursor = Some(c.to_string()),
            _ => return Ok(items),
        }
    }
}

/// Percent-encodes everything but unreserved characters.
pub fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
