//! `cairn-trace`: the trace-driven scale benchmark, the VM-centric paper's own
//! method (`002_…` §5). It generates the chunk-id streams of a fleet of VMs — a shared OS
//! base, application layers shared by groups, each VM's own data, 2–5% change a snapshot —
//! and drives them through cairn's dedup tiers (the engine's `search_similar`, the same code a
//! commit runs) without data bytes, against a simulated store of packs (`store.rs`).
//!
//! It reports what bounded dedup stores against exact dedup (which the generator counts as
//! the chunks it commits for the first time, and which `--mode exact` reproduces through the
//! tiers and an index lookup a chunk, as a check of the harness), what each tier found, the
//! index lookups and bytes a real reader would make, and a commit's dedup memory (modelled
//! from cairn's own structure sizes, `memory.rs`) against the raw data: the paper's raw:RAM.
//!
//! VMs are committed one after another, each through its snapshots (VM-major order); a
//! commit is a process of its own, so its caches start empty.

mod commit;
mod fleet;
mod memory;
mod store;

use std::process::ExitCode;
use std::time::Instant;

use cairn_engine::commit::claims::CLAIM_GENERATION;
use cairn_engine::commit::dedup::similar::HOOKS;
use cairn_engine::commit::DedupMode;
use clap::Parser;
use serde_json::json;

use commit::{CommitFigures, CommitSettings};
use fleet::{FirstSeen, FleetParams, Layers, Vm, CHUNK_BYTES};
use memory::{CommitCost, TRAILER_HELD};
use store::{Store, GROUP_CHUNKS};

const GIB: f64 = (1u64 << 30) as f64;

#[derive(Parser, Debug)]
#[command(
    name = "cairn-trace",
    about = "Trace-driven dedup benchmark: a fleet's chunk ids through cairn's dedup tiers",
    long_about = "Generates the chunk-id streams of a fleet of VMs (shared OS bases, shared \
                  application layers, per-VM data, daily change) and drives them through \
                  cairn's dedup tiers without data bytes. Reports bounded dedup against exact \
                  dedup, index lookups and bytes, and a commit's dedup memory against the raw \
                  data (raw:RAM).\n\nExample: cairn-trace --vms 100 --json out.json"
)]
struct Args {
    /// VMs in the fleet.
    #[arg(long, default_value_t = 10)]
    vms: u32,
    /// Snapshots of each VM (the first is a full commit, the rest change 2–5%).
    #[arg(long, default_value_t = 10)]
    snapshots: u32,
    /// Virtual disk size of each VM.
    #[arg(long, default_value_t = 40)]
    disk_gib: u32,
    /// OS bases the VMs are installed from.
    #[arg(long, default_value_t = 6)]
    os_bases: u32,
    /// Size of each OS base.
    #[arg(long, default_value_t = 4.0)]
    os_gib: f64,
    /// Application layers, each shared by one group of VMs.
    #[arg(long, default_value_t = 20)]
    app_groups: u32,
    /// Size of each application layer.
    #[arg(long, default_value_t = 2.0)]
    app_gib: f64,
    /// A VM's own data, on average.
    #[arg(long, default_value_t = 10.0)]
    user_gib: f64,
    /// Mean file size in 4 KiB chunks (geometric): smaller files scatter a segment's chunks
    /// over more packs.
    #[arg(long, default_value_t = 64)]
    file_chunks: u32,
    /// Share of OS and application files a VM places away from the template's order.
    #[arg(long, default_value_t = 0.1)]
    relocated: f64,
    /// Dedup mode: bounded (cairn's default), exact, or both (two runs, one report).
    #[arg(long, default_value = "both")]
    mode: String,
    /// Index memory budget in MiB (cairn's `--index-memory`: filters, and through
    /// `CacheLimits::for_index_memory` the trailer and piece caches); cairn's default.
    #[arg(long, default_value_t = cairn_repo::v2::CacheLimits::BUILT_IN.filter_bytes >> 20)]
    index_memory: u64,
    /// Other index memory budgets in MiB to cost the same commits at (the dedup is the same:
    /// only what the reader holds and reads differs; the trailer fetches are the main
    /// budget's), reported under `other_index_memory`.
    #[arg(long, value_delimiter = ',')]
    also_index_memory: Vec<u64>,
    /// VMs one host commits, for the per-host raw:RAM (the paper: 25 a machine).
    #[arg(long, default_value_t = 25)]
    host_vms: u32,
    /// Claims a commit keeps in memory a generation (0: cairn's default,
    /// `claims::CLAIM_GENERATION`); the older generation is spilled (bounded mode: within
    /// `claims::BOUNDED_SPILL_MEMORY`).
    #[arg(long, default_value_t = 0)]
    claims_generation: usize,
    /// Keep every claim in memory (what neither mode does: for comparison).
    #[arg(long)]
    keep_all_claims: bool,
    /// Sample the index the hooks ask: only keys below 2^64 / K are in it (1: every key, as
    /// cairn does today). A segment's hooks are its smallest keys, so a sampled index still
    /// holds some of most segments' hooks (sparse indexing, Lillibridge et al. 2009).
    #[arg(long, default_value_t = 1)]
    hook_sample: u64,
    /// Hooks a changed segment looks up at most (cairn's is 4).
    #[arg(long, default_value_t = HOOKS)]
    hooks: usize,
    /// Seed of the generator.
    #[arg(long, default_value_t = 17)]
    seed: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// A run's figures: sums over commits, and the costliest commit.
#[derive(Default, serde::Serialize)]
struct RunTotals {
    commits: u64,
    raw_chunks: u64,
    data_chunks: u64,
    changed_segments: u64,
    changed_chunks: u64,
    parent: u64,
    similar: u64,
    index: u64,
    within_commit: u64,
    hook_lookups: u64,
    hook_hits: u64,
    index_lookups: u64,
    trailer_fetches: u64,
    stored: u64,
    exact_new: u64,
    read_bytes: u64,
    peak: CommitCost,
    peak_total: u64,
    peak_commit: String,
    /// The same commits costed at the other filter budgets: (MiB, peak, index bytes read).
    others: Vec<OtherBudget>,
    seconds: f64,
}

/// The costliest commit at another filter budget.
#[derive(Default, serde::Serialize)]
struct OtherBudget {
    index_memory_mib: u64,
    peak: CommitCost,
    peak_total: u64,
    read_bytes: u64,
}

impl RunTotals {
    fn add(&mut self, f: &CommitFigures, cost: CommitCost, name: impl FnOnce() -> String) {
        self.commits += 1;
        self.raw_chunks += f.raw_chunks;
        self.data_chunks += f.data_chunks;
        self.changed_segments += f.changed_segments;
        self.changed_chunks += f.changed_chunks;
        self.parent += f.parent;
        self.similar += f.similar;
        self.index += f.index;
        self.within_commit += f.within_commit;
        self.hook_lookups += f.hook_lookups;
        self.hook_hits += f.hook_hits;
        self.index_lookups += f.index_lookups;
        self.trailer_fetches += f.trailer_fetches;
        self.stored += f.stored;
        self.exact_new += f.exact_new;
        self.read_bytes += cost.read_bytes;
        if cost.total() > self.peak_total {
            self.peak_total = cost.total();
            self.peak = cost;
            self.peak_commit = name();
        }
    }
}

fn run(p: &FleetParams, settings: CommitSettings, index_memory: u64, others: &[u64]) -> RunTotals {
    // The index a commit consults: group entries (a sixteenth of the chunks) and the chunk
    // keys, all of them or the sampled hooks.
    let index_entries =
        |stored: u64| stored / GROUP_CHUNKS as u64 + stored / settings.hook_sample.max(1);
    let mode = settings.mode;
    let started = Instant::now();
    let layers = Layers::new(p);
    let mut store = Store::default();
    let mut seen = FirstSeen::default();
    let mut totals = RunTotals {
        others: others
            .iter()
            .map(|mib| OtherBudget {
                index_memory_mib: *mib,
                ..OtherBudget::default()
            })
            .collect(),
        ..RunTotals::default()
    };
    for v in 0..p.vms {
        let mut vm = Vm::install(p, &layers, v);
        for day in 0..p.snapshots {
            if day > 0 {
                vm.change(p, &layers, day);
            }
            // The index the commit reads: what was published before it.
            let entries = index_entries(store.stored_chunks);
            let packs = store.packs() as u64;
            let f = commit::commit(&vm, day == 0, settings, &mut store, &mut seen);
            let cost = CommitCost::of(&f, entries, packs, index_memory);
            totals.add(&f, cost, || format!("vm {v} snapshot {day}"));
            for o in &mut totals.others {
                let cost = CommitCost::of(&f, entries, packs, o.index_memory_mib << 20);
                o.read_bytes += cost.read_bytes;
                if cost.total() > o.peak_total {
                    (o.peak_total, o.peak) = (cost.total(), cost);
                }
            }
        }
        seen.drop_stream(p.user_stream(v));
        if (v + 1) % 10 == 0 || v + 1 == p.vms {
            let done = (v + 1) as f64 / p.vms as f64;
            let secs = started.elapsed().as_secs_f64();
            eprintln!(
                "{mode:?}: {}/{} VMs, {:.0} s, about {:.0} s left; stored {:.1} GiB, \
                 exact {:.1} GiB; {} location extents",
                v + 1,
                p.vms,
                secs,
                secs / done - secs,
                totals.stored as f64 * CHUNK_BYTES as f64 / GIB,
                totals.exact_new as f64 * CHUNK_BYTES as f64 / GIB,
                store.located_extents()
            );
        }
    }
    totals.seconds = started.elapsed().as_secs_f64();
    totals
}

fn report(p: &FleetParams, args: &Args, t: &RunTotals, mode: DedupMode) -> serde_json::Value {
    let b = CHUNK_BYTES as f64;
    let raw = t.raw_chunks as f64 * b;
    let data = t.data_chunks as f64 * b;
    let stored = t.stored as f64 * b;
    let exact = t.exact_new as f64 * b;
    let committed_gib = t.changed_chunks as f64 * b / GIB;
    let host_raw = args.host_vms as f64 * p.snapshots as f64 * p.disk_gib as f64 * GIB;
    let peak = t.peak_total.max(1) as f64;
    json!({
        "mode": format!("{mode:?}").to_lowercase(),
        "commits": t.commits,
        "raw_tib": raw / GIB / 1024.0,
        "data_tib": data / GIB / 1024.0,
        "stored_gib": stored / GIB,
        "exact_gib": exact / GIB,
        "stored_over_exact": stored / exact,
        "efficiency_raw": (raw - stored) / (raw - exact),
        "efficiency_data": (data - stored) / (data - exact),
        "tiers": {
            "unchanged_segments_chunks": t.data_chunks - t.changed_chunks,
            "parent": t.parent,
            "similar": t.similar,
            "index": t.index,
            "within_commit": t.within_commit,
            "stored": t.stored,
        },
        "per_gib_through_tiers": {
            "gib": committed_gib,
            "hook_lookups": t.hook_lookups as f64 / committed_gib,
            "index_lookups": t.index_lookups as f64 / committed_gib,
            "trailer_fetches": t.trailer_fetches as f64 / committed_gib,
            "index_bytes_read": t.read_bytes as f64 / committed_gib,
        },
        "hook_hit_rate": t.hook_hits as f64 / t.hook_lookups.max(1) as f64,
        "peak_commit": t.peak_commit,
        "peak_memory": t.peak,
        "peak_memory_bytes": t.peak_total,
        "raw_to_ram_host": host_raw / peak,
        "raw_to_ram_fleet": raw / peak,
        // The same peak commit had its runs held version 1–2 meta whole.
        "raw_to_ram_host_whole_meta":
            host_raw / (peak - t.peak.index_meta as f64 + t.peak.index_meta_whole as f64),
        "other_index_memory": t.others.iter().map(|o| json!({
            "index_memory_mib": o.index_memory_mib,
            "peak_memory": o.peak,
            "peak_memory_bytes": o.peak_total,
            "raw_to_ram_host": host_raw / o.peak_total.max(1) as f64,
            "index_bytes_read_per_gib": o.read_bytes as f64 / committed_gib,
        })).collect::<Vec<_>>(),
        "seconds": t.seconds,
        "chunks_through_tiers_per_s": t.changed_chunks as f64 / t.seconds,
    })
}

/// The fleet `args` describe; the change model's shares are fixed (each result's `fleet` field lists them).
fn fleet_params(args: &Args) -> FleetParams {
    FleetParams {
        vms: args.vms,
        snapshots: args.snapshots,
        disk_gib: args.disk_gib,
        os_bases: args.os_bases,
        os_gib: args.os_gib,
        app_groups: args.app_groups,
        app_gib: args.app_gib,
        user_gib: args.user_gib,
        change_min: 0.02,
        change_max: 0.05,
        os_update: 0.005,
        new_share: 0.15,
        copy_share: 0.05,
        move_share: 0.3,
        moving_vms: 1.0 / 3.0,
        relocated: args.relocated,
        file_chunks: args.file_chunks,
        hot_files: 0.02,
        hot_share: 0.8,
        seed: args.seed,
    }
}

fn settings(args: &Args, mode: DedupMode) -> CommitSettings {
    CommitSettings {
        mode,
        trailer_slots: (cairn_repo::v2::CacheLimits::for_index_memory(args.index_memory << 20)
            .trailer_bytes
            / TRAILER_HELD) as usize,
        claims_generation: match (args.keep_all_claims, args.claims_generation) {
            (true, _) => None,
            (false, 0) => Some(CLAIM_GENERATION),
            (false, n) => Some(n),
        },
        hook_sample: args.hook_sample.max(1),
        hooks: args.hooks,
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let p = fleet_params(&args);
    let modes = match args.mode.as_str() {
        "bounded" => vec![DedupMode::Bounded],
        "exact" => vec![DedupMode::Exact],
        "both" => vec![DedupMode::Bounded, DedupMode::Exact],
        other => {
            eprintln!("cairn-trace: unknown mode {other:?} (bounded, exact or both)");
            return ExitCode::from(2);
        }
    };
    let mut runs = Vec::new();
    let mut ok = true;
    for mode in modes {
        let t = run(
            &p,
            settings(&args, mode),
            args.index_memory << 20,
            &args.also_index_memory,
        );
        if mode == DedupMode::Exact && t.stored != t.exact_new {
            eprintln!(
                "cairn-trace: exact mode stored {} chunks, the generator counts {} seen first",
                t.stored, t.exact_new
            );
            ok = false;
        }
        runs.push(report(&p, &args, &t, mode));
    }
    let out = json!({ "fleet": p, "index_memory_mib": args.index_memory,
                      "claims_generation": args.claims_generation,
                      "keep_all_claims": args.keep_all_claims, "hook_sample": args.hook_sample,
                      "hooks": args.hooks,
                      "host_vms": args.host_vms,
                      "runs": runs });
    println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    if let Some(path) = &args.json {
        if let Err(e) = std::fs::write(path, serde_json::to_vec_pretty(&out).expect("json")) {
            eprintln!("cairn-trace: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small fleet: 6 VMs of 2 GiB over 2 OS bases and 2 application layers, 4 snapshots.
    fn small(extra: &[&str]) -> (Args, FleetParams) {
        let mut argv = vec![
            "cairn-trace",
            "--vms",
            "6",
            "--snapshots",
            "4",
            "--disk-gib",
            "2",
            "--os-bases",
            "2",
            "--os-gib",
            "0.25",
            "--app-groups",
            "2",
            "--app-gib",
            "0.125",
            "--user-gib",
            "0.25",
        ];
        argv.extend(extra);
        let args = Args::parse_from(argv);
        let p = fleet_params(&args);
        (args, p)
    }

    #[test]
    fn exact_mode_stores_exactly_the_chunks_the_generator_commits_first() {
        let (args, p) = small(&[]);
        let t = run(&p, settings(&args, DedupMode::Exact), 64 << 20, &[]);
        assert_eq!(t.stored, t.exact_new);
        assert!(t.index > 0 && t.index_lookups > t.index);
        // Every data chunk of a changed segment is accounted for once.
        assert_eq!(
            t.parent + t.similar + t.index + t.within_commit + t.stored,
            t.changed_chunks
        );
    }

    #[test]
    fn bounded_mode_finds_shared_layers_through_similar_packs_and_stores_little_more() {
        let (args, p) = small(&[]);
        let t = run(&p, settings(&args, DedupMode::Bounded), 64 << 20, &[]);
        assert_eq!(t.index_lookups, 0);
        assert!(t.stored >= t.exact_new);
        assert!(
            t.stored as f64 <= 1.05 * t.exact_new as f64,
            "{} against {}",
            t.stored,
            t.exact_new
        );
        // Six VMs on two bases and two application layers, 98,304 shared chunks each: the
        // later VMs find theirs in the first VMs' packs (408,301 chunks with this seed).
        assert!(t.similar > 300_000, "{}", t.similar);
        assert!(t.hook_lookups > 0 && t.hook_hits > 0);
        let again = run(&p, settings(&args, DedupMode::Bounded), 64 << 20, &[]);
        assert_eq!((again.stored, again.similar), (t.stored, t.similar));
    }

    #[test]
    fn a_sampled_hook_index_is_asked_only_for_its_keys() {
        // One key in 1,024: a quarter of a full segment's 256 keys on average, so most
        // segments have no hook the index holds.
        let (args, p) = small(&["--hook-sample", "1024"]);
        let t = run(&p, settings(&args, DedupMode::Bounded), 64 << 20, &[]);
        let (full_args, _) = small(&[]);
        let full = run(&p, settings(&full_args, DedupMode::Bounded), 64 << 20, &[]);
        assert!(t.hook_lookups * 2 < full.hook_lookups);
        assert!(t.stored >= full.stored);
        assert!(t.similar > 0);
    }

    #[test]
    fn bounded_claims_take_less_memory_than_keeping_them_all() {
        let (args, p) = small(&["--claims-generation", "1000"]);
        let t = run(&p, settings(&args, DedupMode::Bounded), 64 << 20, &[]);
        let all = run(
            &p,
            settings(&small(&["--keep-all-claims"]).0, DedupMode::Bounded),
            64 << 20,
            &[],
        );
        assert!(t.peak.claims < all.peak.claims);
        assert_eq!(all.peak.claims, all.peak.claims_all_kept);
        assert!(t.stored >= all.stored);
    }
}
