//! Retention policies (`cairn prune`), with restic's `forget --keep-*` semantics.
//!
//! Versions are considered newest first:
//! - `last N` keeps the N newest versions;
//! - `hourly/daily/weekly/monthly N` walk the versions newest to oldest, put each in its time
//!   bucket (UTC hour, day, ISO week, month, from the version's `time_ns`) and keep the newest
//!   version of each of the first N distinct buckets;
//! - tagged versions are always kept.
//!
//! A version kept by any rule is kept, with every rule that keeps it listed as a reason.
//! Pruning only marks versions deleted; their space comes back with `cairn gc`.

use cairn_format::keys;
use std::collections::{HashMap, HashSet};

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};
use crate::resolve::history;

/// How many versions each rule keeps; 0 disables the rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeepPolicy {
    pub last: u32,
    pub hourly: u32,
    pub daily: u32,
    pub weekly: u32,
    pub monthly: u32,
}

impl KeepPolicy {
    /// True when no rule keeps anything (only tagged versions would survive).
    pub fn is_empty(&self) -> bool {
        self.last == 0
            && self.hourly == 0
            && self.daily == 0
            && self.weekly == 0
            && self.monthly == 0
    }
}

/// What the policy decided for one version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionDecision {
    pub id: Id,
    pub seq: u64,
    pub keep: bool,
    /// Why it is kept (`last 1`, `daily 2026-11-21`, `tagged v1.0`, ...); empty if removed.
    pub reasons: Vec<String>,
}

/// A protecting "tag" that is a VM version binding the version (no tag name starts so:
/// tag names have no spaces).
const VM_BOUND: &str = "vm version ";

/// Applies `policy` to `versions` (newest first). Versions in `tagged` are always kept.
pub fn plan_retention(
    versions: &[(Id, VersionRecord)],
    policy: &KeepPolicy,
    tagged: &HashSet<Id>,
) -> Vec<RetentionDecision> {
    let names: HashMap<Id, Vec<String>> = tagged.iter().map(|id| (*id, Vec::new())).collect();
    plan_retention_named(versions, policy, &names)
}

/// Like [`plan_retention`], with the tag names of each tagged version for the reasons
/// (`tagged v1.0`; an empty list gives plain `tagged`).
pub fn plan_retention_named(
    versions: &[(Id, VersionRecord)],
    policy: &KeepPolicy,
    tagged: &HashMap<Id, Vec<String>>,
) -> Vec<RetentionDecision> {
    let dated: Vec<Dated> = versions
        .iter()
        .map(|(id, r)| Dated {
            id: *id,
            seq: r.seq,
            time_ns: r.time_ns,
        })
        .collect();
    plan_dated(&dated, policy, tagged)
}

/// A version as retention sees it: what it is, and when it was taken.
#[derive(Debug, Clone, Copy)]
pub struct Dated {
    pub id: Id,
    pub seq: u64,
    pub time_ns: i64,
}

/// [`plan_retention_named`] over any versions (image or VM versions), newest first.
pub fn plan_dated(
    versions: &[Dated],
    policy: &KeepPolicy,
    tagged: &HashMap<Id, Vec<String>>,
) -> Vec<RetentionDecision> {
    type BucketFn = fn(i64) -> String;
    let rules: [(&str, u32, BucketFn); 4] = [
        ("hourly", policy.hourly, hour_bucket),
        ("daily", policy.daily, day_bucket),
        ("weekly", policy.weekly, week_bucket),
        ("monthly", policy.monthly, month_bucket),
    ];
    let mut seen: Vec<HashSet<String>> = vec![HashSet::new(); rules.len()];
    let mut out = Vec::with_capacity(versions.len());
    for (i, v) in versions.iter().enumerate() {
        let mut reasons = Vec::new();
        if (i as u64) < u64::from(policy.last) {
            reasons.push(format!("last {}", i + 1));
        }
        for ((name, count, bucket_of), seen) in rules.iter().zip(seen.iter_mut()) {
            if *count == 0 || seen.len() >= *count as usize {
                continue;
            }
            let bucket = bucket_of(v.time_ns);
            if !seen.contains(&bucket) {
                reasons.push(format!("{name} {bucket}"));
                seen.insert(bucket);
            }
        }
        if let Some(tags) = tagged.get(&v.id) {
            if tags.is_empty() {
                reasons.push("tagged".to_string());
            }
            reasons.extend(tags.iter().map(|t| match t.strip_prefix(VM_BOUND) {
                Some(vm_version) => format!("disk of VM version {vm_version}"),
                None => format!("tagged {t}"),
            }));
        }
        out.push(RetentionDecision {
            id: v.id,
            seq: v.seq,
            keep: !reasons.is_empty(),
            reasons,
        });
    }
    out
}

/// Applies `policy` to the live versions of `image` and, unless `dry_run`, marks the versions
/// it does not keep deleted. Returns every decision, newest first.
pub async fn prune(
    repo: &Repo,
    image: &str,
    policy: &KeepPolicy,
    dry_run: bool,
) -> EngineResult<Vec<RetentionDecision>> {
    if policy.is_empty() {
        return Err(EngineError::BadInput(format!(
            "refusing to remove every version of {image:?}: the retention policy keeps nothing"
        )));
    }
    let versions = history(repo, image).await?;
    let mut tags = tag_names(repo).await?;
    // A disk version a VM version binds goes with its VM version (`cairn vm rm`), never alone.
    for (id, vm_version) in crate::vm::bound_versions(repo, &[image]).await? {
        tags.entry(id)
            .or_default()
            .push(format!("{VM_BOUND}{vm_version}"));
    }
    let decisions = plan_retention_named(&versions, policy, &tags);
    if !dry_run {
        for d in decisions.iter().filter(|d| !d.keep) {
            repo.mark_deleted(&d.id).await?;
            tracing::info!(image, seq = d.seq, id = %d.id, "pruned");
        }
    }
    Ok(decisions)
}

/// Every tagged version with the names of its tags.
pub(crate) async fn tag_names(repo: &Repo) -> EngineResult<HashMap<Id, Vec<String>>> {
    let mut out: HashMap<Id, Vec<String>> = HashMap::new();
    // A tag that cannot be read protects nothing it could name: reported by verify.
    let (tags, _damaged) = repo.all_tag_targets_checked().await?;
    for (key, id) in tags {
        out.entry(id).or_default().push(tag_name(&key));
    }
    for names in out.values_mut() {
        names.sort();
    }
    Ok(out)
}

/// `tags/<escaped image>/<tag>` → `<tag>` (escaped image names contain no '/').
pub(crate) fn tag_name(key: &str) -> String {
    keys::tag_from_key(key)
}

// ---- time buckets (UTC) ----

const NS_PER_SEC: i64 = 1_000_000_000;
const SECS_PER_DAY: i64 = 86_400;

fn days_and_secs(time_ns: i64) -> (i64, i64) {
    let secs = time_ns.div_euclid(NS_PER_SEC);
    (secs.div_euclid(SECS_PER_DAY), secs.rem_euclid(SECS_PER_DAY))
}

/// Civil date (year, month 1..=12, day 1..=31) of a day count since 1970-01-01
/// (proleptic Gregorian; Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March = 0
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

/// Days since 1970-01-01 of a civil date (the inverse of [`civil_from_days`]).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400); // [0, 399]
    let m = i64::from(m);
    let mp = if m > 2 { m - 3 } else { m + 9 }; // March = 0
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era * 146_097 + doe - 719_468
}

/// ISO 8601 week (ISO year, week 1..=53) of a day count since 1970-01-01. Weeks start on
/// Monday; a week belongs to the year of its Thursday.
pub fn iso_week(days: i64) -> (i64, u32) {
    // 1970-01-01 was a Thursday: ISO weekday 4 (Monday = 1 .. Sunday = 7).
    let weekday = (days + 3).rem_euclid(7) + 1;
    let thursday = days - weekday + 4;
    let (year, _, _) = civil_from_days(thursday);
    let day_of_year = thursday - days_from_civil(year, 1, 1); // 0-based
    (year, (day_of_year / 7 + 1) as u32)
}

/// `YYYY-MM-DD HH` (UTC).
pub fn hour_bucket(time_ns: i64) -> String {
    let (days, secs) = days_and_secs(time_ns);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}", secs / 3600)
}

/// `YYYY-MM-DD` (UTC).
pub fn day_bucket(time_ns: i64) -> String {
    let (y, m, d) = civil_from_days(days_and_secs(time_ns).0);
    format!("{y:04}-{m:02}-{d:02}")
}

/// `YYYY-Www` (ISO week, UTC).
pub fn week_bucket(time_ns: i64) -> String {
    let (y, w) = iso_week(days_and_secs(time_ns).0);
    format!("{y:04}-W{w:02}")
}

/// `YYYY-MM` (UTC).
pub fn month_bucket(time_ns: i64) -> String {
    let (y, m, _) = civil_from_days(days_and_secs(time_ns).0);
    format!("{y:04}-{m:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(y: i64, m: u32, d: u32, h: i64) -> i64 {
        (days_from_civil(y, m, d) * SECS_PER_DAY + h * 3600) * NS_PER_SEC
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2025, 11, 22), 20_414);
        for days in -800_000..800_000 {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
    }

    #[test]
    fn iso_weeks_across_year_boundaries() {
        let week = |y, m, d| iso_week(days_from_civil(y, m, d));
        assert_eq!(week(2020, 12, 31), (2020, 53));
        assert_eq!(week(2021, 1, 1), (2020, 53));
        assert_eq!(week(2021, 1, 3), (2020, 53)); // a Sunday
        assert_eq!(week(2021, 1, 4), (2021, 1)); // a Monday
        assert_eq!(week(2019, 12, 30), (2020, 1));
        assert_eq!(week(2024, 12, 30), (2025, 1));
        assert_eq!(week(2026, 1, 1), (2026, 1)); // a Thursday
        assert_eq!(week(2027, 1, 1), (2026, 53));
        assert_eq!(week(2027, 1, 4), (2027, 1));
        assert_eq!(week(2008, 12, 29), (2009, 1));
        assert_eq!(week(2010, 1, 3), (2009, 53));
        assert_eq!(week(1969, 12, 31), (1970, 1));
        assert_eq!(week(1970, 1, 1), (1970, 1));
        assert_eq!(week(2023, 6, 15), (2023, 24));
    }

    #[test]
    fn iso_weeks_are_consistent() {
        // Every Monday starts a new week, numbers run 1.. without gaps and restart in the
        // ISO year whose first Thursday they contain.
        let mut prev = iso_week(days_from_civil(1999, 12, 27));
        for days in days_from_civil(1999, 12, 28)..days_from_civil(2040, 1, 1) {
            let cur = iso_week(days);
            let monday = (days + 3).rem_euclid(7) == 0;
            if monday {
                assert!(
                    cur == (prev.0, prev.1 + 1) || (cur.0 == prev.0 + 1 && cur.1 == 1),
                    "{prev:?} → {cur:?}"
                );
                assert!(prev.1 == 52 || prev.1 == 53 || cur.1 == prev.1 + 1);
            } else {
                assert_eq!(cur, prev);
            }
            prev = cur;
        }
    }

    #[test]
    fn buckets() {
        let t = ns(2026, 11, 21, 13) + 59 * 60 * NS_PER_SEC;
        assert_eq!(hour_bucket(t), "2026-11-21 13");
        assert_eq!(day_bucket(t), "2026-11-21");
        assert_eq!(week_bucket(t), "2026-W47");
        assert_eq!(month_bucket(t), "2026-11");
        assert_eq!(week_bucket(ns(2021, 1, 3, 23)), "2020-W53");
        assert_eq!(day_bucket(-1), "1969-12-31");
        assert_eq!(hour_bucket(-1), "1969-12-31 23");
    }
}
