use std::path::PathBuf;

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
                let value: serde_json::Value = serde_json::from_str(v)?;
                println!("{}", serde_json::to_string_pretty(&value)?);
            }
        } else if k != RECIPE_KEY {
            println!("{k}:\n{v}");
        }
    }
    if !a.json && chunks.iter().any(|(k, _)| k == RECIPE_KEY) {
        println!("\n(full recipe: brume info --json; re-create: brume generate/edit --from {})", a.image.display());
    }
    Ok(())
}
