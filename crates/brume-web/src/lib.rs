//! The web editor's assets, embedded in the binary so `brume serve` works offline with no
//! build step beyond cargo: plain JavaScript modules, one stylesheet, one page.
//!
//! The server maps `/` to `index.html` and `/assets/NAME` to `NAME`, and serves the page with
//! [`CONTENT_SECURITY_POLICY`]: the page has no inline script or style, so a strict policy
//! costs it nothing and shuts out injected code.

/// One embedded file: what to send as Content-Type and the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asset {
    pub mime: &'static str,
    pub bytes: &'static [u8],
}

/// A policy the page is written to satisfy: scripts and styles only from the server itself,
/// images also from `data:` (step previews arrive as data URLs) and `blob:` (pictures fetched
/// with a token, downloads), connections (fetch, WebSocket) only to the same origin.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

macro_rules! assets {
    ($($name:literal => $mime:literal),+ $(,)?) => {
        /// Every embedded file by its name under `assets/`.
        const ASSETS: &[(&str, Asset)] = &[
            $(($name, Asset { mime: $mime, bytes: include_bytes!(concat!("../assets/", $name)) })),+
        ];
    };
}

assets! {
    "index.html" => "text/html; charset=utf-8",
    "style.css" => "text/css; charset=utf-8",
    "icon.svg" => "image/svg+xml",
    "result.svg" => "image/svg+xml",
    "main.js" => "text/javascript; charset=utf-8",
    "api.js" => "text/javascript; charset=utf-8",
    "canvas.js" => "text/javascript; charset=utf-8",
    "history.js" => "text/javascript; charset=utf-8",
    "mask.js" => "text/javascript; charset=utf-8",
    "live.js" => "text/javascript; charset=utf-8",
    "settings.js" => "text/javascript; charset=utf-8",
    "gallery.js" => "text/javascript; charset=utf-8",
    "store.js" => "text/javascript; charset=utf-8",
}

/// The asset for a request path: `/` or `` (the page) -> `index.html`; `/assets/NAME` or `NAME`
/// -> that file. Anything else (other folders, `..`, unknown names) is `None`, so the server
/// answers 404 rather than guessing.
pub fn asset(path: &str) -> Option<Asset> {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let name = match path.trim_start_matches('/') {
        "" | "index.html" => "index.html",
        rest => rest.strip_prefix("assets/").unwrap_or(rest),
    };
    ASSETS.iter().find(|(n, _)| *n == name).map(|(_, a)| *a)
}

/// The names of every embedded file (for listings and tests).
pub fn names() -> impl Iterator<Item = &'static str> {
    ASSETS.iter().map(|(n, _)| *n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_and_its_assets_resolve() {
        assert_eq!(asset("/").unwrap().mime, "text/html; charset=utf-8");
        assert_eq!(asset("/index.html"), asset("/"));
        assert_eq!(asset("/assets/main.js").unwrap().mime, "text/javascript; charset=utf-8");
        assert!(asset("/assets/style.css").is_some());
        assert!(asset("/assets/../Cargo.toml").is_none());
        assert!(asset("/assets/nope.js").is_none());
        assert!(asset("/api/v1/models").is_none());
    }

    /// Every module the page imports is embedded, and the page has no inline script or style
    /// (the CSP forbids them).
    #[test]
    fn imports_are_embedded_and_nothing_is_inline() {
        for name in names() {
            let text = std::str::from_utf8(asset(name).unwrap().bytes).unwrap();
            if name.ends_with(".js") {
                for line in text.lines().filter(|l| l.starts_with("import ")) {
                    let spec = line.rsplit(['"', '\'']).nth(1).unwrap();
                    let target = spec.trim_start_matches("./");
                    assert!(asset(target).is_some(), "{name} imports {spec}, which is not embedded");
                }
            }
            if name == "index.html" {
                assert!(!text.contains("style=\""), "inline style in index.html");
                assert!(!text.contains("<script>"), "inline script in index.html");
                // No inline event handler (` onclick="..."` and the like).
                for (i, _) in text.match_indices(" on") {
                    let rest = &text[i + 3..];
                    let word: String = rest.chars().take_while(|c| c.is_ascii_alphabetic()).collect();
                    assert!(!rest[word.len()..].starts_with('='), "inline handler on{word} in index.html");
                }
                for src in text.split("src=\"").skip(1).chain(text.split("href=\"").skip(1)) {
                    let url = src.split('"').next().unwrap();
                    assert!(url.starts_with("/assets/"), "{url}: the page loads only embedded assets");
                    assert!(asset(url).is_some(), "{url} is not embedded");
                }
            }
        }
    }
}
