//! `brume-world`: dataset generation, the held-out prompt list, reference renders and judging
//! from the command line (the main `brume` CLI will wire these in later).

use brume_world::judge::judge;
use brume_world::{held_out_prompts, parse_caption, render, scene_from_spec, write_dataset, CaptionConfig};
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage:
  brume-world dataset --out DIR [--count N=1000] [--size PX=128] [--seed S=0]
                     [--omit-size P=0] [--omit-position P=0]   (caption leaves it out with probability P)
  brume-world held-out [--count N=200]            (JSON lines: caption, seed)
  brume-world render --caption TEXT --out FILE.png [--size PX=128] [--seed S=0]
  brume-world judge --image FILE --caption TEXT   (prints the verdict; exit 1 if any attribute fails)";

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("brume-world: {e}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

struct Args(Vec<String>);

impl Args {
    fn take(&mut self, flag: &str) -> Result<Option<String>, String> {
        match self.0.iter().position(|a| a == flag) {
            None => Ok(None),
            Some(i) if i + 1 < self.0.len() => {
                let v = self.0.remove(i + 1);
                self.0.remove(i);
                Ok(Some(v))
            }
            Some(_) => Err(format!("{flag} needs a value")),
        }
    }

    fn num<T: std::str::FromStr>(&mut self, flag: &str, default: T) -> Result<T, String> {
        match self.take(flag)? {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("{flag}: not a number: {v:?}")),
        }
    }

    fn required(&mut self, flag: &str) -> Result<String, String> {
        self.take(flag)?.ok_or_else(|| format!("missing {flag}"))
    }

    fn done(self) -> Result<(), String> {
        match self.0.first() {
            Some(a) => Err(format!("unexpected argument {a:?}")),
            None => Ok(()),
        }
    }
}

fn run(argv: Vec<String>) -> Result<ExitCode, String> {
    let Some((cmd, rest)) = argv.split_first() else { return Err("no command".into()) };
    let mut a = Args(rest.to_vec());
    match cmd.as_str() {
        "dataset" => {
            let out = PathBuf::from(a.required("--out")?);
            let count = a.num("--count", 1000u64)?;
            let size = a.num("--size", 128u32)?;
            let seed = a.num("--seed", 0u64)?;
            let captions =
                CaptionConfig { omit_size: a.num("--omit-size", 0.0)?, omit_position: a.num("--omit-position", 0.0)? };
            a.done()?;
            if size < 32 {
                return Err("--size must be at least 32".into());
            }
            captions.validate().map_err(|e| format!("--{}", e.replacen('_', "-", 1)))?;
            let n = write_dataset(&out, count, size, seed, &captions).map_err(|e| format!("{}: {e}", out.display()))?;
            eprintln!("wrote {n} new images ({count} total) and captions.jsonl to {}", out.display());
        }
        "held-out" => {
            let count = a.num("--count", 200usize)?;
            a.done()?;
            for (caption, seed) in held_out_prompts(count) {
                println!("{}", serde_json::json!({"caption": caption, "seed": seed}));
            }
        }
        "render" => {
            let caption = a.required("--caption")?;
            let out = a.required("--out")?;
            let size = a.num("--size", 128u32)?;
            let seed = a.num("--seed", 0u64)?;
            a.done()?;
            let spec = parse_caption(&caption).map_err(|e| e.to_string())?;
            if size < 32 {
                return Err("--size must be at least 32".into());
            }
            render(&scene_from_spec(&spec, seed), size).save(&out).map_err(|e| format!("{out}: {e}"))?;
        }
        "judge" => {
            let path = a.required("--image")?;
            let caption = a.required("--caption")?;
            a.done()?;
            let spec = parse_caption(&caption).map_err(|e| e.to_string())?;
            let img = image::open(&path).map_err(|e| format!("{path}: {e}"))?.to_rgb8();
            let v = judge(&img, &spec);
            let attrs: serde_json::Map<String, serde_json::Value> = v
                .attributes()
                .into_iter()
                .enumerate()
                .map(|(i, (name, ok))| (format!("{i:02}_{name}"), ok.into()))
                .collect();
            println!("{}", serde_json::json!({"all_correct": v.all_correct(), "score": v.score(), "attributes": attrs}));
            return Ok(if v.all_correct() { ExitCode::SUCCESS } else { ExitCode::from(1) });
        }
        other => return Err(format!("unknown command {other:?}")),
    }
    Ok(ExitCode::SUCCESS)
}
