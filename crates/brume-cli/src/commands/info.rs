use std::path::PathBuf;

use brume::output::escape_control;
use brume::pipelines::recipe::{read_png_text, RECIPE_KEY};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A PNG written by brume (or another tool that writes "parameters").
    image: PathBuf,
    /// Print the full JSON recipe instead of the parameters text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let chunks = read_png_text(&a.image)?;
    if chunks.is_empty() {
        anyhow::bail!("{} carries no text metadata", a.image.display());
    }
    for (k, v) in &chunks {
        if a.json {
            if k == RECIPE_KEY {
                let value: serde_json::Value = serde_json::from_str(v)
                    .map_err(|e| anyhow::anyhow!("{}: the {RECIPE_KEY} chunk is not JSON: {e}", a.image.display()))?;
                println!("{}", json_terminal_safe(&serde_json::to_string_pretty(&value)?));
            }
        } else if k != RECIPE_KEY {
            // Text from a file: control characters escaped so it cannot drive the terminal.
            println!("{}:\n{}", escape_control(k), escape_control(v));
        }
    }
    if !a.json && chunks.iter().any(|(k, _)| k == RECIPE_KEY) {
        println!("\n(full recipe: brume info --json; re-create: brume generate/edit --from {})", a.image.display());
    }
    Ok(())
}

/// JSON as serde writes it escapes only C0 controls inside strings; C1 controls
/// (e.g. U+009B, a one-byte CSI), DEL and bidirectional overrides can still
/// drive a terminal. They are written as `\uXXXX`, which stays valid JSON (raw
/// newlines in pretty JSON are structure, never string content).
fn json_terminal_safe(json: &str) -> String {
    json.chars()
        .map(|c| {
            if (c.is_control() && c != '\n') || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') {
                format!("\\u{:04x}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
}
