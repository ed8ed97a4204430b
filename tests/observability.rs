//! What operators look at rather than read: the Grafana dashboard and the
//! Prometheus alert rules in `deploy/`. Every metric name they use is one
//! the worker exports; every dashboard query and rule is valid PromQL
//! (`promtool check rules`); every alert fires on the series that should
//! raise it and stays quiet otherwise (`promtool test rules`, with
//! `deploy/prometheus/alerts_test.yml`). Debian's `prometheus` package has
//! `promtool`; `.ci/run` installs it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use device_list_updater::testkit::metric_family_names;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The dashboard's queries, with their panel titles.
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/device-list-updater.json")).expect("JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().expect("a title").to_owned();
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().expect("an expr").to_owned();
            queries.push((title.clone(), expr));
        }
    }
    queries
}

/// The `dlu_…` names in `text`, a histogram's `_bucket`, `_sum` and
/// `_count` series named by their family.
fn metric_names(text: &str, histograms: &BTreeSet<String>) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("dlu_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let before = start.checked_sub(1).map(|b| bytes[b]);
        if !before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
            let name = &text[start..end];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    name.strip_suffix(suffix)
                        .filter(|base| histograms.contains(*base))
                })
                .unwrap_or(name);
            names.insert(family.to_owned());
        }
        i = end;
    }
    names
}

#[test]
fn the_dashboard_and_the_rules_use_only_exported_metrics() {
    let exported: BTreeSet<String> = metric_family_names().into_iter().collect();
    let histograms: BTreeSet<String> = [
        "dlu_federation_request_seconds",
        "dlu_update_to_key_change_seconds",
    ]
    .map(str::to_owned)
    .into();
    assert!(histograms.is_subset(&exported));
    let queries: String = dashboard_queries()
        .into_iter()
        .map(|(_, expr)| expr + "\n")
        .collect();
    for (what, text) in [
        ("the dashboard", queries),
        ("the alert rules", read("deploy/prometheus/alerts.yml")),
    ] {
        let used = metric_names(&text, &histograms);
        assert!(used.len() >= 5, "{what} uses {used:?}");
        let unknown: Vec<&String> = used.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{what} uses metrics the worker does not export: {unknown:?}"
        );
    }
}

#[test]
fn the_dashboard_shows_what_operators_look_at() {
    let titles: Vec<String> = dashboard_queries().into_iter().map(|(t, _)| t).collect();
    let queries: String = dashboard_queries()
        .into_iter()
        .map(|(_, expr)| expr + "\n")
        .collect();
    for metric in [
        "dlu_updates_total",
        "dlu_update_to_key_change_seconds_bucket",
        "dlu_stale_users",
        "dlu_fetches_total",
        "dlu_servers_backing_off",
        "dlu_revalidations_total",
        "dlu_revalidation_divergences_total",
        "dlu_outbox_backlog",
        "dlu_input_partitions_held",
        "dlu_dead_letters_total",
    ] {
        assert!(
            queries.contains(metric),
            "no panel shows {metric}: {titles:?}"
        );
    }
}

#[test]
fn the_metric_name_scan_finds_names_and_families() {
    let histograms: BTreeSet<String> = ["dlu_x_seconds".to_owned()].into();
    let names = metric_names(
        "rate(dlu_a_total[5m]) + dlu_x_seconds_bucket{le=\"1\"} / my_dlu_b + dlu_c_count",
        &histograms,
    );
    assert_eq!(
        names,
        ["dlu_a_total", "dlu_c_count", "dlu_x_seconds"]
            .map(str::to_owned)
            .into()
    );
}

/// `promtool` with `args`, run in `deploy/prometheus`; its output on failure.
fn promtool(args: &[&str]) -> Result<(), String> {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(repo("deploy/prometheus"))
        .output();
    let output = match output {
        Ok(output) => output,
        Err(e) => {
            return Err(format!(
                "cannot run promtool ({e}): install Debian's `prometheus` package (.ci/run does)"
            ));
        }
    };
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    ))
}

#[test]
fn the_alert_rules_are_valid_and_fire_when_they_should() {
    promtool(&["check", "rules", "alerts.yml"]).unwrap_or_else(|e| panic!("{e}"));
    promtool(&["test", "rules", "alerts_test.yml"]).unwrap_or_else(|e| panic!("{e}"));
}

/// Every dashboard query is valid PromQL: promtool checks them as the
/// expressions of recording rules.
#[test]
fn the_dashboard_queries_are_valid_promql() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (title, expr)) in dashboard_queries().into_iter().enumerate() {
        let expr = serde_json::to_string(&expr).expect("a string");
        rules.push_str(&format!(
            "      # {title}\n      - record: dashboard:query{i}\n        expr: {expr}\n"
        ));
    }
    let path = dir.path().join("dashboard.yml");
    std::fs::write(&path, rules).expect("write");
    let path = path.to_str().expect("a UTF-8 path");
    promtool(&["check", "rules", path]).unwrap_or_else(|e| panic!("{e}"));
}
