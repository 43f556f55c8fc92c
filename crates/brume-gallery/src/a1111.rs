//! The "parameters" text that AUTOMATIC1111's web UI (and brume, and many other
//! tools) writes into PNGs:
//!
//! ```text
//! a photo of a cat
//! Negative prompt: blurry
//! Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 1, Size: 512x512, Model hash: abc, Model: sd15
//! ```
//!
//! Parsed the way the web UI parses it: the last line is the settings line when
//! it holds at least three `Key: value` pairs; a value may be a double-quoted
//! JSON string (holding commas). The server reuses this for `/sdapi/v1/png-info`.

use serde::{Deserialize, Serialize};

/// A parsed parameters text.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Parameters {
    pub prompt: String,
    pub negative_prompt: Option<String>,
    /// Every `Key: value` pair of the settings line, in order, quoted values unquoted.
    pub settings: Vec<(String, String)>,
}

impl Parameters {
    /// The value of a setting, by key (ASCII case-insensitive).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.settings
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }

    pub fn steps(&self) -> Option<u32> {
        self.get("Steps")?.trim().parse().ok()
    }

    pub fn sampler(&self) -> Option<&str> {
        self.get("Sampler").map(str::trim).filter(|s| !s.is_empty())
    }

    pub fn cfg_scale(&self) -> Option<f64> {
        self.get("CFG scale")?.trim().parse::<f64>().ok().filter(|v| v.is_finite())
    }

    /// The seed; negative values (which some tools write for "random") are `None`.
    pub fn seed(&self) -> Option<u64> {
        self.get("Seed")?.trim().parse().ok()
    }

    /// `Size: WxH` as (width, height).
    pub fn size(&self) -> Option<(u32, u32)> {
        let (w, h) = self.get("Size")?.trim().split_once('x')?;
        Some((w.trim().parse().ok()?, h.trim().parse().ok()?))
    }

    pub fn model(&self) -> Option<&str> {
        self.get("Model").map(str::trim).filter(|s| !s.is_empty())
    }

    pub fn model_hash(&self) -> Option<&str> {
        self.get("Model hash").map(str::trim).filter(|s| !s.is_empty())
    }

    pub fn denoising_strength(&self) -> Option<f64> {
        self.get("Denoising strength")?.trim().parse::<f64>().ok().filter(|v| v.is_finite())
    }
}

/// Parses the text; never fails (text without a settings line is all prompt).
pub fn parse(text: &str) -> Parameters {
    let text = text.trim();
    let mut lines: Vec<&str> = text.split('\n').map(|l| l.trim_end_matches('\r')).collect();
    let mut settings = Vec::new();
    if let Some(last) = lines.last() {
        let pairs = settings_line(last);
        if pairs.len() >= 3 {
            settings = pairs;
            lines.pop();
        }
    }
    let mut prompt: Vec<&str> = Vec::new();
    let mut negative: Option<Vec<&str>> = None;
    for line in lines {
        let line = line.trim();
        if negative.is_none() {
            if let Some(rest) = line.strip_prefix("Negative prompt:") {
                negative = Some(vec![rest.trim()]);
                continue;
            }
        }
        match &mut negative {
            Some(n) => n.push(line),
            None => prompt.push(line),
        }
    }
    Parameters {
        prompt: prompt.join("\n"),
        negative_prompt: negative.map(|n| n.join("\n")),
        settings,
    }
}

/// The `Key: value` pairs of one line (the web UI's `re_param`: a key is a word
/// character then at least one of word characters, spaces, `-` or `/`).
fn settings_line(line: &str) -> Vec<(String, String)> {
    let chars: Vec<char> = line.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let key_start = i;
        while i < chars.len() && chars[i] != ':' && chars[i] != ',' {
            i += 1;
        }
        let key: String = chars[key_start..i].iter().collect();
        let key_ok = key.chars().count() >= 2
            && key.chars().next().is_some_and(|c| c.is_alphanumeric() || c == '_')
            && key
                .chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == ' ' || c == '-' || c == '/');
        if i >= chars.len() || chars[i] == ',' || !key_ok {
            // Not a pair: skip to the next comma.
            while i < chars.len() && chars[i] != ',' {
                i += 1;
            }
            i += 1;
            continue;
        }
        i += 1; // ':'
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let value = if i < chars.len() && chars[i] == '"' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            let end = (i + 1).min(chars.len());
            let quoted: String = chars[start..end].iter().collect();
            i = end;
            while i < chars.len() && chars[i] != ',' {
                i += 1;
            }
            serde_json::from_str::<String>(&quoted).unwrap_or_else(|_| quoted.trim_matches('"').to_string())
        } else {
            let start = i;
            while i < chars.len() && chars[i] != ',' {
                i += 1;
            }
            chars[start..i].iter().collect::<String>().trim().to_string()
        };
        i += 1; // ','
        out.push((key.trim().to_string(), value));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn web_ui_text() {
        let p = parse(
            "a cat, sitting\non a mat\nNegative prompt: blurry, dark\nSteps: 20, Sampler: Euler a, CFG scale: 7, Seed: 1234, Size: 512x768, Model hash: abc123, Model: sd15, Lora hashes: \"x: 1, y: 2\"",
        );
        assert_eq!(p.prompt, "a cat, sitting\non a mat");
        assert_eq!(p.negative_prompt.as_deref(), Some("blurry, dark"));
        assert_eq!(p.steps(), Some(20));
        assert_eq!(p.sampler(), Some("Euler a"));
        assert_eq!(p.cfg_scale(), Some(7.0));
        assert_eq!(p.seed(), Some(1234));
        assert_eq!(p.size(), Some((512, 768)));
        assert_eq!(p.model_hash(), Some("abc123"));
        assert_eq!(p.model(), Some("sd15"));
        assert_eq!(p.get("lora hashes"), Some("x: 1, y: 2"));
    }

    #[test]
    fn prompt_only_and_garbage() {
        let p = parse("just words: here, and there");
        assert_eq!(p.prompt, "just words: here, and there");
        assert!(p.settings.is_empty());
        let p = parse("");
        assert_eq!(p, Parameters::default());
        for junk in [
            "\"",
            ":::,,,",
            "Steps: \"unterminated, Seed: 1, Size: 1x1",
            "Negative prompt:",
            "\u{0}\u{1b}[31m",
        ] {
            let _ = parse(junk);
        }
        let p = parse("Steps: 3, Seed: -1, Size: 8x8");
        assert_eq!(p.prompt, "");
        assert_eq!(p.steps(), Some(3));
        assert_eq!(p.seed(), None);
    }
}
