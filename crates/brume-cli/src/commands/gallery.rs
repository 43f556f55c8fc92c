//! `brume gallery`: browse and manage the on-device gallery from a terminal.
//! Text that came from images (prompts, tags, model names) is printed with its
//! control characters escaped: an image must not be able to drive the terminal.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use brume_gallery::{escape_for_terminal as esc, time, Deleted, Gallery, ImageId, ImageInfo, Query};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The gallery's data directory (default: $BRUME_DATA_DIR, else $XDG_DATA_HOME/brume, else ~/.local/share/brume).
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// List images, newest first.
    List(ListArgs),
    /// Full-text search over prompts and negative prompts.
    Search {
        /// Words to find (all must match; a trailing * matches a prefix).
        text: String,
        #[command(flatten)]
        list: ListArgs,
    },
    /// Everything stored about one image, with its recipe.
    Show {
        id: ImageId,
        /// Print the stored record as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write an image to a file, with its recipe or stripped of all metadata.
    Export {
        id: ImageId,
        #[arg(long)]
        out: PathBuf,
        /// Remove the recipe and every other metadata chunk (for sharing privately).
        #[arg(long)]
        strip: bool,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Soft-delete images (hidden until restored; removed for good by `purge`).
    Delete {
        #[arg(required = true)]
        ids: Vec<ImageId>,
    },
    /// Undo a soft delete.
    Restore {
        #[arg(required = true)]
        ids: Vec<ImageId>,
    },
    /// Remove soft-deleted images and their files for good.
    Purge,
    /// Import PNGs that carry a brume recipe or A1111 parameters.
    Import {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Mark images as favourites (or unmark with --off).
    Favourite {
        #[arg(required = true)]
        ids: Vec<ImageId>,
        #[arg(long)]
        off: bool,
    },
    /// Add or remove tags.
    Tag {
        id: ImageId,
        /// Tags to add.
        #[arg(long)]
        add: Vec<String>,
        /// Tags to remove.
        #[arg(long)]
        remove: Vec<String>,
    },
}

#[derive(clap::Args, Debug, Default)]
struct ListArgs {
    /// Model name or model hash.
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    sampler: Option<String>,
    /// WIDTHxHEIGHT, e.g. 512x512.
    #[arg(long)]
    size: Option<String>,
    #[arg(long)]
    seed: Option<u64>,
    /// Made at or after (YYYY-MM-DD, RFC 3339 or Unix seconds).
    #[arg(long)]
    since: Option<String>,
    /// Made before (same forms).
    #[arg(long)]
    until: Option<String>,
    /// Favourites only.
    #[arg(long)]
    favourites: bool,
    #[arg(long)]
    tag: Option<String>,
    /// Edits of this image.
    #[arg(long)]
    parent: Option<ImageId>,
    /// Soft-deleted images only (what `purge` would remove).
    #[arg(long, conflicts_with = "all")]
    deleted: bool,
    /// Live and soft-deleted images.
    #[arg(long)]
    all: bool,
    /// Rows per page.
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// Continue after a previous page (the cursor it printed).
    #[arg(long)]
    cursor: Option<String>,
    /// Print the page as JSON.
    #[arg(long)]
    json: bool,
}

impl ListArgs {
    fn query(&self, text: Option<String>) -> anyhow::Result<Query> {
        let (width, height) = match &self.size {
            Some(s) => {
                let (w, h) = s.split_once(['x', 'X']).context("--size: expected WIDTHxHEIGHT, e.g. 512x512")?;
                let num = |v: &str| {
                    v.trim()
                        .parse::<u32>()
                        .with_context(|| format!("--size: {v:?} is not a number of pixels"))
                };
                (Some(num(w)?), Some(num(h)?))
            }
            None => (None, None),
        };
        Ok(Query {
            text,
            model: self.model.clone(),
            sampler: self.sampler.clone(),
            width,
            height,
            seed: self.seed,
            since: self.since.as_deref().map(|s| time::parse_time(s, "--since")).transpose()?,
            until: self.until.as_deref().map(|s| time::parse_time(s, "--until")).transpose()?,
            favourite: self.favourites.then_some(true),
            tag: self.tag.clone(),
            parent: self.parent,
            deleted: if self.deleted {
                Deleted::Only
            } else if self.all {
                Deleted::Include
            } else {
                Deleted::Exclude
            },
            cursor: self.cursor.clone(),
            limit: Some(self.limit),
        })
    }
}

/// JSON made safe for a terminal and still valid JSON with the same values:
/// serde_json escapes C0 controls but not DEL, C1 controls or bidirectional
/// overrides, which can only occur inside strings, where `\uXXXX` means the same.
fn safe_json(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if (c.is_control() && c != '\n') || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// Cuts `s` to `n` characters (with an ellipsis), after escaping.
fn cut(s: &str, n: usize) -> String {
    let e = esc(s);
    if e.chars().count() <= n {
        return e;
    }
    let mut out: String = e.chars().take(n.saturating_sub(1)).collect();
    out.push('…');
    out
}

fn print_table(items: &[ImageInfo], out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>6}  {:<16}  {:>9}  {:<12}  {:<10}  {:>5}  {:>20}  {:1}  PROMPT",
        "ID", "CREATED (UTC)", "SIZE", "MODEL", "SAMPLER", "STEPS", "SEED", "*"
    )?;
    for i in items {
        let created = i.created_at.replace('T', " ");
        writeln!(
            out,
            "{:>6}  {:<16}  {:>9}  {:<12}  {:<10}  {:>5}  {:>20}  {:1}  {}{}",
            i.id.0,
            created.get(..16).unwrap_or(&created),
            format!("{}x{}", i.width, i.height),
            cut(i.model.as_deref().unwrap_or("-"), 12),
            cut(i.sampler.as_deref().unwrap_or("-"), 10),
            i.steps.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
            i.seed.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
            if i.favourite { "*" } else { "" },
            if i.deleted { "[deleted] " } else { "" },
            cut(&i.prompt, 60),
        )?;
    }
    Ok(())
}

fn list(g: &Gallery, q: &Query, json: bool) -> anyhow::Result<()> {
    let page = g.list(q)?;
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", safe_json(&serde_json::to_string_pretty(&page)?))?;
        return Ok(());
    }
    if page.items.is_empty() {
        writeln!(out, "no images")?;
        return Ok(());
    }
    print_table(&page.items, &mut out)?;
    if let Some(c) = &page.next_cursor {
        writeln!(out, "more: --cursor {c}")?;
    }
    Ok(())
}

fn show(g: &Gallery, id: ImageId, json: bool) -> anyhow::Result<()> {
    let d = g.get(id)?;
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", safe_json(&serde_json::to_string_pretty(&d)?))?;
        return Ok(());
    }
    let i = &d.info;
    let opt = |v: Option<String>| v.map(|s| esc(&s)).unwrap_or_else(|| "-".into());
    writeln!(
        out,
        "id:              {}{}",
        i.id,
        if i.deleted {
            " (deleted; brume gallery restore to undo)"
        } else {
            ""
        }
    )?;
    writeln!(out, "created:         {}", i.created_at)?;
    writeln!(out, "prompt:          {}", esc(&i.prompt))?;
    writeln!(out, "negative prompt: {}", opt(i.negative_prompt.clone()))?;
    writeln!(
        out,
        "model:           {} (hash {})",
        opt(i.model.clone()),
        opt(i.model_hash.clone())
    )?;
    writeln!(out, "mode:            {}", opt(i.mode.clone()))?;
    writeln!(out, "sampler:         {}", opt(i.sampler.clone()))?;
    writeln!(out, "steps:           {}", opt(i.steps.map(|v| v.to_string())))?;
    writeln!(out, "guidance:        {}", opt(i.guidance.map(|v| v.to_string())))?;
    writeln!(out, "seed:            {}", opt(i.seed.map(|v| v.to_string())))?;
    writeln!(out, "size:            {}x{} ({} bytes)", i.width, i.height, i.bytes)?;
    writeln!(out, "favourite:       {}", if i.favourite { "yes" } else { "no" })?;
    writeln!(
        out,
        "tags:            {}",
        if i.tags.is_empty() {
            "-".into()
        } else {
            i.tags.iter().map(|t| esc(t)).collect::<Vec<_>>().join(", ")
        }
    )?;
    let lineage: Vec<String> = d.lineage.iter().map(|l| l.to_string()).collect();
    writeln!(out, "lineage:         {}", lineage.join(" -> "))?;
    if let Some(t) = &d.timings {
        writeln!(out, "timings:         {}", esc(&t.to_string()))?;
    }
    if let Some(p) = &d.parameters {
        writeln!(out, "parameters:")?;
        for line in p.lines() {
            writeln!(out, "  {}", esc(line))?;
        }
    }
    match &d.recipe {
        Some(r) => {
            writeln!(out, "recipe:")?;
            for line in safe_json(&serde_json::to_string_pretty(r)?).lines() {
                writeln!(out, "  {line}")?;
            }
        }
        None => writeln!(out, "recipe:          none (imported from another tool)")?,
    }
    Ok(())
}

fn export(g: &Gallery, id: ImageId, out: &std::path::Path, strip: bool, force: bool) -> anyhow::Result<()> {
    let bytes = g.export(id, !strip)?;
    if !force && std::fs::symlink_metadata(out).is_ok() {
        bail!("{} exists; pass --force to replace it", out.display());
    }
    // Written beside the target and renamed: a reader never sees half a PNG.
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let name = out.file_name().context("--out names no file")?.to_string_lossy().into_owned();
    let tmp = dir.join(format!(".{name}.brume-tmp-{}", std::process::id()));
    let write = || -> anyhow::Result<()> {
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        if !force && std::fs::symlink_metadata(out).is_ok() {
            bail!("{} exists; pass --force to replace it", out.display());
        }
        std::fs::rename(&tmp, out).with_context(|| format!("cannot write {}", out.display()))?;
        Ok(())
    };
    let r = write();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r?;
    println!(
        "wrote {} ({} bytes{})",
        out.display(),
        bytes.len(),
        if strip { ", metadata stripped" } else { ", with recipe" }
    );
    Ok(())
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let dir = match a.data_dir.clone().or_else(brume_gallery::default_data_dir) {
        Some(d) => d,
        None => bail!("no data directory: pass --data-dir or set BRUME_DATA_DIR (HOME is not set)"),
    };
    let (g, report) = Gallery::open(&dir).with_context(|| format!("opening the gallery in {}", dir.display()))?;
    if !report.is_clean() {
        eprintln!("{}", esc(&report.to_string()));
    }
    match a.command {
        Cmd::List(l) => list(&g, &l.query(None)?, l.json),
        Cmd::Search { text, list: l } => list(&g, &l.query(Some(text))?, l.json),
        Cmd::Show { id, json } => show(&g, id, json),
        Cmd::Export { id, out, strip, force } => export(&g, id, &out, strip, force),
        Cmd::Delete { ids } => {
            for id in ids {
                g.delete(id)?;
                println!("deleted {id} (restore with: brume gallery restore {id})");
            }
            Ok(())
        }
        Cmd::Restore { ids } => {
            for id in ids {
                g.restore(id)?;
                println!("restored {id}");
            }
            Ok(())
        }
        Cmd::Purge => {
            let r = g.purge()?;
            println!("purged {} image(s), {} file(s) removed", r.rows, r.files);
            Ok(())
        }
        Cmd::Import { files } => {
            let mut failed = 0;
            for f in &files {
                match g.import_file(f) {
                    Ok(i) if i.created => println!("imported {} as {}", esc(&f.display().to_string()), i.id),
                    Ok(i) => println!("{} is already in the gallery as {}", esc(&f.display().to_string()), i.id),
                    Err(e) => {
                        eprintln!("error: {}", esc(&e.to_string()));
                        failed += 1;
                    }
                }
            }
            if failed > 0 {
                bail!("{failed} of {} file(s) not imported", files.len());
            }
            Ok(())
        }
        Cmd::Favourite { ids, off } => {
            for id in ids {
                g.set_favourite(id, !off)?;
                println!("{id}: {}", if off { "not a favourite" } else { "favourite" });
            }
            Ok(())
        }
        Cmd::Tag { id, add, remove } => {
            if add.is_empty() && remove.is_empty() {
                bail!("nothing to do: give --add TAG and/or --remove TAG");
            }
            for t in &add {
                g.add_tag(id, t)?;
            }
            for t in &remove {
                g.remove_tag(id, t)?;
            }
            let tags: Vec<String> = g.tags(id)?.iter().map(|t| esc(t)).collect();
            println!("{id}: tags {}", if tags.is_empty() { "-".into() } else { tags.join(", ") });
            Ok(())
        }
    }
}
