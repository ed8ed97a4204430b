//! The `scale` phase: what the worker costs as the number of tracked users
//! grows. For each size of `BENCH_SCALE_SIZES` (default 10000, 100000,
//! 1000000) a database on a private PostgreSQL instance is filled by SQL
//! with that many tracked users (2 devices each with realistic keys,
//! cross-signing keys for every third user, on size / 100 servers), in the
//! rows the worker itself writes for a fetched list (checked: the users a
//! start-up fetches are stored exactly as the fill wrote them). Then,
//! `BENCH_SCALE_RUNS` (3) runs each of:
//!
//! - the bare JetStream loop (pull, publish, ack) over as many messages,
//!   the ceiling beside the ingest figure;
//! - ingest: `BENCH_SCALE_UPDATES` (100000) chained updates spread over all
//!   users, published while the worker binary is stopped; start → every key
//!   change in `KEY_CHANGE`; the worker's CPU per update;
//! - latency: updates at a steady `BENCH_SCALE_RATE` (2000) a second for
//!   `BENCH_SCALE_SECONDS` (10), publish → key change, p50 and p99;
//! - the query RPC for 100 users spread over the table (median of 5);
//! - the worker's peak RSS over the run;
//! - `admin stale`, `admin user` and `admin untrack-unshared` (a dry run,
//!   membership on), each the binary from exec to exit;
//! - start-up with 1 % of the users stale (their lists lost): start → `/readyz`
//!   ready, → the query RPC answering, → every stale user fetched from a
//!   mock fleet (X-Matrix checked), its servers at once
//!   (`DLU_STARTUP_SPREAD=0s`: the figure is the fetch's, not the spread's).
//!
//! Then the largest size again with membership on (`BENCH_SCALE_ROOMS=off`
//! skips it): every user in a room of 100 with us and the first 100,000 in
//! `!big` too, all applied through the worker's membership input (so the
//! room rows are its own); the same runs, and in each our server leaving
//! `!big` (published → its sweep done, and the worker's CPU for it), then
//! joining again.
//!
//! `BENCH_SCALE_CSV=path` writes every figure as `size,run,metric,value`
//! (`scripts/plot-scale` draws them). `BENCH_SCALE_EXPLAIN=on` then turns
//! on `auto_explain` for the largest size's databases, runs each workload
//! once more (with 1 % of the users queued for revalidation), and prints
//! every distinct statement with its runs, time and the scans its plans
//! used, marking a sequential scan of a table that grows with the users.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use device_list_updater::testkit::postgres::PrivatePostgres;
use device_list_updater::testkit::remote::{MockFederation, Reply};
use device_list_updater::testkit::{
    Nats, create_input_stream, create_postgres_database, stream_len, wait_for,
};
use sea_orm::{ConnectionTrait, DatabaseConnection};

use super::outside::{Worker, key_file};
use super::{Latencies, fresh_streams, key_changes_seen, latencies_once_seen, publish_all};

/// The settings of the phase.
struct Settings {
    sizes: Vec<usize>,
    runs: usize,
    updates: usize,
    rate: usize,
    seconds: usize,
    csv: Option<String>,
    explain: bool,
    /// Also the largest size with membership on and rooms.
    rooms: bool,
    /// The plans' pass: 1 % of the users are stale in their own back-off
    /// throughout, so their updates make no key change; ingest is waited
    /// for by the input drained, and there is no steady window.
    explaining: bool,
}

impl Settings {
    fn from_env() -> Settings {
        let var = |key: &str| std::env::var(key).ok();
        let number =
            |key: &str, default: usize| var(key).and_then(|v| v.parse().ok()).unwrap_or(default);
        Settings {
            sizes: var("BENCH_SCALE_SIZES")
                .unwrap_or_else(|| "10000,100000,1000000".into())
                .split(',')
                .filter_map(|s| s.trim().parse().ok())
                .collect(),
            runs: number("BENCH_SCALE_RUNS", 3),
            updates: number("BENCH_SCALE_UPDATES", 100_000),
            rate: number("BENCH_SCALE_RATE", 2_000),
            seconds: number("BENCH_SCALE_SECONDS", 10),
            csv: var("BENCH_SCALE_CSV"),
            explain: var("BENCH_SCALE_EXPLAIN").as_deref() == Some("on"),
            rooms: var("BENCH_SCALE_ROOMS").as_deref() != Some("off"),
            explaining: false,
        }
    }
}

/// Tables whose rows grow with the tracked users (or their rooms): a
/// sequential scan of one of these on a hot path grows with them.
const GROWING_TABLES: &[&str] = &[
    "remote_user",
    "remote_device",
    "cross_signing_key",
    "stale_user",
    "revalidation",
    "shared_user",
    "room_user",
    "room_member",
    "member_key_link",
];

/// Members of each room with membership on.
const ROOM_MEMBERS: usize = 100;
/// The room our server leaves with membership on, and its members (the
/// first users; fewer if there are fewer).
const BIG_ROOM: &str = "!big:our.example";
const BIG_ROOM_MEMBERS: usize = 100_000;

/// Users per server in the fill.
const USERS_PER_SERVER: usize = 100;

/// The `u`th user of a fill of `size` users.
fn user(u: usize, size: usize) -> String {
    format!("@user{u}:server{}.example", u % servers(size))
}

fn servers(size: usize) -> usize {
    (size / USERS_PER_SERVER).max(1)
}

/// The same user id as SQL over an integer expression `u`.
fn user_sql(u: &str, size: usize) -> String {
    format!(
        "'@user' || {u} || ':server' || ({u} % {}) || '.example'",
        servers(size)
    )
}

/// Whether the `u`th user is one of the 1 % a start-up finds stale.
fn is_stale(u: usize) -> bool {
    u % 100 == 50
}

/// Whether the `u`th user has cross-signing keys.
fn has_cross_signing(u: usize) -> bool {
    u.is_multiple_of(3)
}

const CURVE: &str = "3C5BFWi2Y8MaVvjM8M22DBmh24PmgR0nPvJOIArzgyI";
const ED: &str = "lEuiRJBit0IG6nUf5pUzWTUEsRVVe/HJkoKuEww9ULI";
const MASTER: &str = "nqOvzeuGWT/sRx3h7+MHoInYj3Uk2LD/unI9kDYcHwk";
const SELF_SIGNING: &str = "EmkqvokUn8p+vQAGZitOk4PWjp7Ukp3txV2TbMPEiBQ";
const SIGNATURE: &str =
    "FLWxXqGbwrb8SM3Y795eB6OA8bwBcoMZFXBqnTn58AYWZSqiD45tlBVcDa2L7RwdKXebW/VzDlnfVJ+9jok1Bw";

/// A device's keys as the fleet answers them (the fill's
/// [`device_keys_sql`] writes the same JSON).
fn device_keys(user: &str, device: &str) -> serde_json::Value {
    serde_json::json!({
        "user_id": user, "device_id": device,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {format!("curve25519:{device}"): CURVE, format!("ed25519:{device}"): ED},
        "signatures": {user: {format!("ed25519:{device}"): SIGNATURE}}
    })
}

fn device_keys_sql(user: &str, device: &str) -> String {
    format!(
        "json_build_object('user_id', {user}, 'device_id', {device}, \
         'algorithms', json_build_array('m.olm.v1.curve25519-aes-sha2', 'm.megolm.v1.aes-sha2'), \
         'keys', json_build_object('curve25519:' || {device}, '{CURVE}', 'ed25519:' || {device}, '{ED}'), \
         'signatures', json_build_object({user}, json_build_object('ed25519:' || {device}, '{SIGNATURE}')))::text"
    )
}

/// A cross-signing key (`master` or `self_signing`) as the fleet answers it.
fn cross_signing_key(user: &str, usage: &str) -> serde_json::Value {
    let (key, signer) = if usage == "master" {
        (MASTER, "DEVICE0")
    } else {
        (SELF_SIGNING, MASTER)
    };
    serde_json::json!({
        "user_id": user, "usage": [usage], "keys": {format!("ed25519:{key}"): key},
        "signatures": {user: {format!("ed25519:{signer}"): SIGNATURE}}
    })
}

fn cross_signing_key_sql(user: &str, usage: &str) -> String {
    format!(
        "json_build_object('user_id', {user}, 'usage', json_build_array({usage}), \
         'keys', json_build_object('ed25519:' || (CASE WHEN {usage} = 'master' THEN '{MASTER}' ELSE '{SELF_SIGNING}' END), \
                                   CASE WHEN {usage} = 'master' THEN '{MASTER}' ELSE '{SELF_SIGNING}' END), \
         'signatures', json_build_object({user}, json_build_object('ed25519:' || \
             (CASE WHEN {usage} = 'master' THEN 'DEVICE0' ELSE '{MASTER}' END), '{SIGNATURE}')))::text"
    )
}

/// The devices every user has: (id, display name).
const DEVICES: [(&str, &str); 2] = [("DEVICE0", "Phone"), ("DEVICE1", "Laptop")];

/// The fleet's answer for the `u`th user.
fn device_list(u: usize, size: usize) -> serde_json::Value {
    let user = user(u, size);
    let devices: Vec<_> = DEVICES
        .iter()
        .map(|(device, name)| {
            serde_json::json!({"device_id": device, "device_display_name": name,
                               "keys": device_keys(&user, device)})
        })
        .collect();
    // Stream id 0, as the fill stores: the chained updates that follow
    // (number 1 on) still apply.
    let mut list = serde_json::json!({"user_id": user, "stream_id": 0, "devices": devices});
    if has_cross_signing(u) {
        list["master_key"] = cross_signing_key(&user, "master");
        list["self_signing_key"] = cross_signing_key(&user, "self_signing");
    }
    list
}

/// Fills the (migrated) database with `size` users, as fetched now.
async fn fill(db: &DatabaseConnection, size: usize) {
    let now = device_list_updater::store::now_ms();
    let user = user_sql("u", size);
    let server = format!("'server' || (u % {}) || '.example'", servers(size));
    let statements = [
        format!(
            "INSERT INTO remote_user (user_id, server_name, known_stream_ids, max_stream_id, \
             fetched_stream_id, fetched_at_ms) \
             SELECT {user}, {server}, '[0]', 0, 0, {now} FROM generate_series(0, {}) u",
            size - 1
        ),
        format!(
            "INSERT INTO remote_device (user_id, device_id, display_name, keys_json, stream_id, deleted) \
             SELECT r.user_id, d.id, d.name, {}, 0, false FROM remote_user r \
             CROSS JOIN (VALUES ('DEVICE0', 'Phone'), ('DEVICE1', 'Laptop')) AS d(id, name)",
            device_keys_sql("r.user_id", "d.id")
        ),
        format!(
            "INSERT INTO cross_signing_key (user_id, key_usage, key_json) \
             SELECT {user}, k.usage, {} FROM generate_series(0, {}, 3) u \
             CROSS JOIN (VALUES ('master'), ('self_signing')) AS k(usage)",
            cross_signing_key_sql(&user, "k.usage"),
            size - 1
        ),
        // As autovacuum leaves a settled database (visibility map set,
        // statistics current), not a pass of its own in the first run.
        "VACUUM ANALYZE".into(),
    ];
    for statement in statements {
        db.execute_unprepared(&statement).await.expect("fill");
    }
    let counts = [
        ("remote_user", size),
        ("remote_device", 2 * size),
        ("cross_signing_key", 2 * size.div_ceil(3)),
    ];
    for (table, expected) in counts {
        assert_eq!(
            count(db, &format!("SELECT count(*) FROM {table}")).await,
            expected as i64
        );
    }
}

async fn count(db: &DatabaseConnection, sql: &str) -> i64 {
    let row = db
        .query_one_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            sql,
        ))
        .await
        .expect("query")
        .expect("a row");
    row.try_get_by_index::<i64>(0).expect("a count")
}

/// Makes the 1 % stale as if their lists were lost: devices and keys gone,
/// each marked stale.
async fn lose_lists(db: &DatabaseConnection, size: usize) {
    let now = device_list_updater::store::now_ms();
    let stale_users = format!(
        "SELECT {} AS user_id, 'server' || (u % {}) || '.example' AS server_name \
         FROM generate_series(50, {}, 100) u",
        user_sql("u", size),
        servers(size),
        size.saturating_sub(1)
    );
    for statement in [
        format!(
            "DELETE FROM remote_device WHERE user_id IN (SELECT user_id FROM ({stale_users}) s)"
        ),
        format!(
            "DELETE FROM cross_signing_key WHERE user_id IN (SELECT user_id FROM ({stale_users}) s)"
        ),
        format!(
            "INSERT INTO stale_user (user_id, server_name, marked_at_ms, trigger_stream_ids, \
             last_error, failures, next_attempt_ms) \
             SELECT user_id, server_name, {now}, '[]', NULL, 0, 0 FROM ({stale_users}) s \
             ON CONFLICT DO NOTHING"
        ),
        // The statistics autovacuum keeps in a running deployment (its
        // next pass could come any time), so plans are those of 1 % stale.
        "ANALYZE stale_user, remote_device, cross_signing_key".into(),
    ] {
        db.execute_unprepared(&statement).await.expect("lose lists");
    }
}

/// Checks that the lists a start-up fetched are stored exactly as the fill
/// writes them: the fill's rows are the worker's own.
async fn check_fill_matches_fetch(db: &DatabaseConnection, size: usize) {
    let stale = (50..size).step_by(100).count() as i64;
    let users = format!(
        "SELECT {} AS user_id, u FROM generate_series(50, {}, 100) u",
        user_sql("u", size),
        size.saturating_sub(1)
    );
    let devices = count(
        db,
        &format!(
            "SELECT count(*) FROM remote_device d JOIN ({users}) s ON s.user_id = d.user_id \
             WHERE d.keys_json::jsonb = ({})::jsonb AND NOT d.deleted AND d.stream_id = 0 \
             AND d.display_name = CASE d.device_id WHEN 'DEVICE0' THEN 'Phone' ELSE 'Laptop' END",
            device_keys_sql("d.user_id", "d.device_id")
        ),
    )
    .await;
    assert_eq!(
        devices,
        2 * stale,
        "fetched devices stored as the fill writes them"
    );
    let keys = count(
        db,
        &format!(
            "SELECT count(*) FROM cross_signing_key k JOIN ({users}) s ON s.user_id = k.user_id \
             WHERE k.key_json::jsonb = ({})::jsonb",
            cross_signing_key_sql("k.user_id", "k.key_usage")
        ),
    )
    .await;
    let with_keys = (50..size)
        .step_by(100)
        .filter(|u| has_cross_signing(*u))
        .count() as i64;
    assert_eq!(
        keys,
        2 * with_keys,
        "fetched cross-signing keys stored as the fill writes them"
    );
}

/// The figures of one size, by metric, one value per run.
type Figures = BTreeMap<&'static str, Vec<f64>>;

/// Runs the phase and prints its table.
pub async fn phase(nats: &Nats) {
    let settings = Settings::from_env();
    let pg = PrivatePostgres::start();
    let mut all: Vec<(String, Figures)> = Vec::new();
    let mut csv = String::from("size,run,metric,value\n");
    let mut last = Vec::new();
    let largest = settings.sizes.iter().copied().max();
    let runs = settings
        .sizes
        .iter()
        .map(|&size| (size, false))
        .chain(largest.filter(|_| settings.rooms).map(|size| (size, true)));
    for (size, membership) in runs {
        let (url, _) = create_postgres_database(&pg.url, &format!("dlu_scale_{size}")).await;
        let mut at = Size::new(nats, &url, size).await;
        if membership {
            at.join_rooms().await;
        }
        let figures = at.measure(&settings).await;
        let label = if membership {
            format!("{size} rooms")
        } else {
            size.to_string()
        };
        for (metric, values) in &figures {
            for (run, value) in values.iter().enumerate() {
                let _ = writeln!(csv, "{label},{run},\"{metric}\",{value}");
            }
        }
        all.push((label, figures));
        // Each size's figures as soon as they are known: a later failure
        // loses nothing measured.
        print_table(&all[all.len() - 1..]);
        if let Some(path) = &settings.csv {
            std::fs::write(path, &csv).expect("write the CSV");
        }
        if Some(size) == largest {
            last.push(at);
        }
    }
    print_table(&all);
    if settings.explain {
        for mut at in last {
            at.explain(&pg).await;
        }
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn print_table(all: &[(String, Figures)]) {
    if all.is_empty() {
        return;
    }
    print!("\n| figure (median of runs; min–max) |");
    for (size, _) in all {
        print!(" {size} |");
    }
    print!("\n|---|");
    for _ in all {
        print!("---|");
    }
    println!();
    let metrics: std::collections::BTreeSet<&str> =
        all.iter().flat_map(|(_, f)| f.keys().copied()).collect();
    for metric in metrics {
        print!("| {metric} |");
        for (_, figures) in all {
            let Some(values) = figures.get(metric) else {
                print!(" - |");
                continue;
            };
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            print!(" {:.1} ({min:.1}–{max:.1}) |", median(values));
        }
        println!();
    }
}

/// One size's database and what has been published to it.
struct Size<'a> {
    nats: &'a Nats,
    url: String,
    size: usize,
    db: DatabaseConnection,
    key_path: std::path::PathBuf,
    fleet: MockFederation,
    overrides: String,
    /// Membership on: every user shares a room of [`ROOM_MEMBERS`] with us,
    /// and the first [`BIG_ROOM_MEMBERS`] also `!big`.
    membership: bool,
    /// The last `stream_ordering` of the membership published.
    ordering: usize,
    /// Updates published so far: update `g` is the `u = g % size`th user's
    /// number `1 + g / size`, chained on the one before.
    published: usize,
    _dir: tempfile::TempDir,
}

impl<'a> Size<'a> {
    async fn new(nats: &'a Nats, url: &str, size: usize) -> Size<'a> {
        let store = device_list_updater::worker::open_store(url, Duration::from_secs(10))
            .await
            .expect("db");
        let db = store.connection().clone();
        let started = Instant::now();
        fill(&db, size).await;
        eprintln!(
            "scale: {size} users filled in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let js = nats.js().await;
        fresh_streams(&js).await;
        create_input_stream(&js).await;
        let dir = tempfile::tempdir().expect("dir");
        let (key, key_path) = key_file(dir.path());
        let pair = key.key_pair().expect("key pair");
        let fleet = MockFederation::start(
            "our.example",
            key.version(),
            pair.public_key(),
            Duration::from_millis(10),
        )
        .await;
        let mut stale_servers = std::collections::BTreeSet::new();
        for u in (0..size).filter(|u| is_stale(*u)) {
            fleet.script(&user(u, size), vec![Reply::Json(device_list(u, size))]);
            stale_servers.insert(u % servers(size));
        }
        let overrides = stale_servers
            .iter()
            .map(|s| format!("server{s}.example={}", fleet.base_url()))
            .collect::<Vec<_>>()
            .join(",");
        Size {
            nats,
            url: url.to_owned(),
            size,
            db,
            key_path,
            fleet,
            overrides,
            membership: false,
            ordering: 0,
            published: 0,
            _dir: dir,
        }
    }

    /// The `g`th update overall (see [`Size::published`]).
    fn update(&self, g: usize) -> ((String, i64), String) {
        let (u, round) = (g % self.size, 1 + g / self.size);
        let name = user(u, self.size);
        let body = super::realistic_update(&name, round);
        ((name, round as i64), body)
    }

    fn start_worker(&self, http: std::net::SocketAddr) -> Worker {
        Worker::start_with(
            self.nats,
            &self.url,
            &self.key_path,
            &self.overrides,
            // Stale users' servers are fetched at once, not spread over
            // the default two minutes: the start-up figure is the fetch's
            // own time.
            &[
                ("DLU_HTTP_ADDR", http.to_string()),
                ("DLU_STARTUP_SPREAD", "0s".into()),
                (
                    "DLU_MEMBERSHIP",
                    if self.membership { "on" } else { "off" }.into(),
                ),
            ],
        )
    }

    async fn measure(&mut self, settings: &Settings) -> Figures {
        let mut figures = Figures::new();
        let add = |figures: &mut Figures, metric: &'static str, value: f64| {
            figures.entry(metric).or_default().push(value);
        };
        let js = self.nats.js().await;
        for _ in 0..settings.runs {
            let bare = super::bare_loop(self.nats, settings.updates, self.size).await;
            add(&mut figures, "bare JetStream loop: messages/s", bare);
            let before = stream_len(&js, "KEY_CHANGE").await;
            let first = self.published;
            let updates: Vec<String> = (first..first + settings.updates)
                .map(|g| self.update(g).1)
                .collect();
            publish_all(&js, "devicelist.in.update", updates.into_iter()).await;
            self.published += settings.updates;
            let started = Instant::now();
            let worker = self.start_worker(free_addr());
            let n = settings.updates as u64;
            if settings.explaining {
                device_list_updater::testkit::wait_input_drained_within(
                    &js,
                    Duration::from_secs(1200),
                )
                .await;
            } else {
                wait_for(Duration::from_secs(1200), "all key changes", || async {
                    (stream_len(&js, "KEY_CHANGE").await >= before + n).then_some(())
                })
                .await;
            }
            let elapsed = started.elapsed();
            let (_, cpu) = worker.usage();
            add(
                &mut figures,
                "ingest: updates/s",
                n as f64 / elapsed.as_secs_f64(),
            );
            add(
                &mut figures,
                "ingest: worker CPU µs/update",
                cpu.as_secs_f64() * 1e6 / n as f64,
            );
            let seconds = if settings.explaining {
                0
            } else {
                settings.seconds
            };
            let latency = self.steady(settings.rate, seconds).await;
            add(
                &mut figures,
                "steady: p50 ms",
                latency.p50.as_secs_f64() * 1e3,
            );
            add(
                &mut figures,
                "steady: p99 ms",
                latency.p99.as_secs_f64() * 1e3,
            );
            let mut rpc = Vec::new();
            for _ in 0..5 {
                rpc.push(self.query_sample().await.as_secs_f64() * 1e3);
            }
            add(&mut figures, "query RPC, 100 users: ms", median(&rpc));
            let (peak, _) = worker.usage();
            worker.stop().await;
            add(&mut figures, "worker peak RSS: MiB", peak as f64 / 1024.0);
            let some_user = user(self.size / 2 + 1, self.size);
            for (metric, args) in [
                ("admin stale: ms", vec!["stale"]),
                ("admin user: ms", vec!["user", some_user.as_str()]),
                ("admin untrack-unshared (dry): ms", vec!["untrack-unshared"]),
            ] {
                add(&mut figures, metric, self.admin(&args).as_secs_f64() * 1e3);
            }
            if self.membership {
                let (left, cpu) = self.leave_big_room().await;
                add(
                    &mut figures,
                    "our server leaving !big: s",
                    left.as_secs_f64(),
                );
                add(
                    &mut figures,
                    "our server leaving !big: worker CPU s",
                    cpu.as_secs_f64(),
                );
            }
        }
        for run in 0..settings.runs {
            let (ready, answering, fetched) = self.start_up().await;
            add(
                &mut figures,
                "start-up, 1 % stale: to ready ms",
                ready.as_secs_f64() * 1e3,
            );
            add(
                &mut figures,
                "start-up, 1 % stale: to RPC answered ms",
                answering.as_secs_f64() * 1e3,
            );
            add(
                &mut figures,
                "start-up, 1 % stale: to all fetched s",
                fetched.as_secs_f64(),
            );
            if run == 0 {
                check_fill_matches_fetch(&self.db, self.size).await;
            }
        }
        assert_eq!(self.fleet.bad_signatures(), 0);
        figures
    }

    /// Membership on: our user joins a room of [`ROOM_MEMBERS`] users for
    /// every [`ROOM_MEMBERS`] users, and `!big` with the first
    /// [`BIG_ROOM_MEMBERS`], all through the worker's membership input
    /// (its own rows, exactly); the users' lists are stored already, so
    /// none is fetched (SPEC §5.5.3).
    async fn join_rooms(&mut self) {
        self.membership = true;
        let js = self.nats.js().await;
        let mut events = Vec::with_capacity(self.size + 2 * self.size / ROOM_MEMBERS + 1);
        for room in 0..self.size.div_ceil(ROOM_MEMBERS) {
            let room_id = format!("!room{room}:our.example");
            events.push(self.membership_event(&room_id, "@me:our.example", "join"));
            for u in room * ROOM_MEMBERS..((room + 1) * ROOM_MEMBERS).min(self.size) {
                events.push(self.membership_event(&room_id, &user(u, self.size), "join"));
            }
        }
        events.push(self.membership_event(BIG_ROOM, "@me:our.example", "join"));
        for u in 0..BIG_ROOM_MEMBERS.min(self.size) {
            events.push(self.membership_event(BIG_ROOM, &user(u, self.size), "join"));
        }
        let n = events.len();
        publish_all(&js, "devicelist.in.membership", events.into_iter()).await;
        let started = Instant::now();
        let worker = self.start_worker(free_addr());
        wait_for(Duration::from_secs(1200), "every user sharing", || async {
            (count(&self.db, "SELECT count(*) FROM shared_user").await == self.size as i64)
                .then_some(())
        })
        .await;
        self.wait_rooms_settled(true).await;
        // Every user starting to share is a key change: stopped before the
        // outbox is published, the next start would publish them first and
        // the first ingest run would measure that.
        wait_for(
            Duration::from_secs(1200),
            "the outbox published",
            || async {
                (count(&self.db, "SELECT count(*) FROM key_change_outbox").await == 0).then_some(())
            },
        )
        .await;
        eprintln!(
            "scale: {n} membership events applied in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        worker.stop().await;
        assert_eq!(
            count(&self.db, "SELECT count(*) FROM shared_user").await,
            self.size as i64,
            "every user shares a room"
        );
        self.db
            .execute_unprepared("VACUUM ANALYZE")
            .await
            .expect("vacuum");
    }

    fn membership_event(&mut self, room: &str, who: &str, membership: &str) -> String {
        self.ordering += 1;
        serde_json::json!({"room_id": room, "state_key": who, "membership": membership,
                           "stream_ordering": self.ordering})
        .to_string()
    }

    /// Waits until the membership input is applied: `!big` ours (or not)
    /// and no room sweep left.
    async fn wait_rooms_settled(&self, big_ours: bool) {
        let sql = format!(
            "SELECT count(*) FROM room WHERE sweep OR (room_id = '{BIG_ROOM}' AND (local_joined > 0) <> {big_ours})"
        );
        let big = format!("SELECT count(*) FROM room WHERE room_id = '{BIG_ROOM}'");
        wait_for(Duration::from_secs(1200), "the rooms settled", || async {
            (count(&self.db, &big).await == 1 && count(&self.db, &sql).await == 0).then_some(())
        })
        .await;
    }

    /// Our server leaves `!big` (its members share another room, so they
    /// stay tracked, but each is decided again): published → sweep done,
    /// and the worker's CPU for it; then joins it again.
    async fn leave_big_room(&mut self) -> (Duration, Duration) {
        let js = self.nats.js().await;
        let worker = self.start_worker(free_addr());
        let leave = self.membership_event(BIG_ROOM, "@me:our.example", "leave");
        let (_, cpu_before) = worker.usage();
        let started = Instant::now();
        publish_all(&js, "devicelist.in.membership", std::iter::once(leave)).await;
        self.wait_rooms_settled(false).await;
        let left = started.elapsed();
        let (_, cpu_after) = worker.usage();
        let join = self.membership_event(BIG_ROOM, "@me:our.example", "join");
        publish_all(&js, "devicelist.in.membership", std::iter::once(join)).await;
        self.wait_rooms_settled(true).await;
        worker.stop().await;
        assert_eq!(
            count(&self.db, "SELECT count(*) FROM shared_user").await,
            self.size as i64
        );
        (left, cpu_after - cpu_before)
    }

    /// Updates at `rate` a second for `seconds` to the running worker;
    /// publish → key change.
    async fn steady(&mut self, rate: usize, seconds: usize) -> Latencies {
        let js = self.nats.js().await;
        let received = key_changes_seen(self.nats).await;
        let acks = super::AcksAside::new();
        let total = rate * seconds;
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut sent = Vec::with_capacity(total);
        let started = Instant::now();
        while sent.len() < total {
            tick.tick().await;
            // As many as are due by now: the rate holds whatever the tick.
            let due = ((started.elapsed().as_secs_f64() * rate as f64) as usize).min(total);
            while sent.len() < due {
                let (key, body) = self.update(self.published);
                self.published += 1;
                sent.push((key, acks.publish(&js, body).await));
            }
        }
        acks.finish().await;
        Latencies::of(latencies_once_seen(&received, &sent, Duration::from_secs(300)).await)
    }

    /// 100 users spread over the table, not stale.
    fn sample(&self) -> Vec<String> {
        (0..100)
            .map(|k| user(k * self.size / 100 + 7, self.size))
            .collect()
    }

    /// One query RPC for the sample; checks every user is fresh with both
    /// devices.
    async fn query_sample(&self) -> Duration {
        let client = self.nats.client().await;
        let users = self.sample();
        let request = serde_json::json!({ "user_ids": users }).to_string();
        let started = Instant::now();
        let reply = client
            .request("devicelist.rpc.query", request.into())
            .await
            .expect("query RPC");
        let elapsed = started.elapsed();
        let reply: serde_json::Value = serde_json::from_slice(&reply.payload).expect("JSON");
        for u in &users {
            let answer = &reply["users"][u];
            assert_eq!(answer["stale"], false, "{u}: {answer}");
            assert_eq!(
                answer["devices"].as_object().map(|d| d.len()),
                Some(2),
                "{u}"
            );
        }
        elapsed
    }

    /// Runs `device-list-updater admin <args>`; its time from exec to exit.
    fn admin(&self, args: &[&str]) -> Duration {
        let started = Instant::now();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_device-list-updater"))
            .arg("admin")
            .args(args)
            .env("DLU_SERVER_NAME", "our.example")
            .env("DLU_SIGNING_KEY_PATH", &self.key_path)
            .env("DLU_DATABASE_URL", &self.url)
            .env("DLU_NATS_URL", &self.nats.url)
            .env("DLU_MEMBERSHIP", "on")
            .output()
            .expect("admin");
        let elapsed = started.elapsed();
        assert!(
            output.status.success(),
            "admin {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        elapsed
    }

    /// A start with 1 % of the lists lost: (→ ready, → query RPC answered,
    /// → all fetched).
    async fn start_up(&self) -> (Duration, Duration, Duration) {
        lose_lists(&self.db, self.size).await;
        let client = self.nats.client().await;
        let request: bytes::Bytes = serde_json::json!({ "user_ids": self.sample() })
            .to_string()
            .into();
        let http = free_addr();
        let started = Instant::now();
        let worker = self.start_worker(http);
        eprintln!("scale: start-up of {} users, 1 % stale", self.size);
        let ready = wait_for(Duration::from_secs(300), "ready", || async {
            let body = super::try_http_get(http, "/readyz").await?;
            body.starts_with("ready").then(|| started.elapsed())
        })
        .await;
        let answering = wait_for(Duration::from_secs(300), "the query RPC", || async {
            client
                .request("devicelist.rpc.query", request.clone())
                .await
                .ok()
                .map(|_| started.elapsed())
        })
        .await;
        let fetched = wait_for(
            Duration::from_secs(1200),
            "every stale user fetched",
            || async {
                // The lost lists, not those in their own back-off (the
                // plans' pass keeps 1 % there).
                (count(
                    &self.db,
                    "SELECT count(*) FROM stale_user WHERE failures = 0",
                )
                .await
                    == 0)
                    .then(|| started.elapsed())
            },
        )
        .await;
        worker.stop().await;
        (ready, answering, fetched)
    }

    /// Every workload once more with `auto_explain` logging each plan;
    /// prints each distinct statement with its scans.
    async fn explain(&mut self, pg: &PrivatePostgres) {
        let name = self.url.rsplit('/').next().unwrap_or_default().to_owned();
        for setting in [
            "session_preload_libraries = 'auto_explain'",
            "auto_explain.log_min_duration = 0",
        ] {
            self.db
                .execute_unprepared(&format!("ALTER DATABASE {name} SET {setting}"))
                .await
                .expect("auto_explain");
        }
        // A revalidation queue as a busy deployment has one: 1 % of the
        // users queued, each in its own back-off for a day (so no job
        // sends one), for the plans over that table.
        let now = device_list_updater::store::now_ms();
        for statement in [
            format!(
                "INSERT INTO revalidation (user_id, server_name, queued_at_ms, failures, next_attempt_ms, last_error) \
                 SELECT {}, 'server' || (u % {}) || '.example', {now}, 1, {}, 'bench' \
                 FROM generate_series(25, {}, 100) u",
                user_sql("u", self.size),
                servers(self.size),
                now + 86_400_000,
                self.size.saturating_sub(1)
            ),
            // And 1 % stale in their own back-off (their server answered,
            // but not for them), for the plans of ingest and the jobs over
            // a stale_user table of that size.
            format!(
                "INSERT INTO stale_user (user_id, server_name, marked_at_ms, trigger_stream_ids, \
                 last_error, failures, next_attempt_ms) \
                 SELECT {}, 'server' || (u % {}) || '.example', {now}, '[]', 'bench', 1, {} \
                 FROM generate_series(75, {}, 100) u",
                user_sql("u", self.size),
                servers(self.size),
                now + 86_400_000,
                self.size.saturating_sub(1)
            ),
            "VACUUM ANALYZE".into(),
        ] {
            self.db.execute_unprepared(&statement).await.expect("queue");
        }
        let log = pg.dir().join("server.log");
        let from = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
        let settings = Settings {
            sizes: vec![self.size],
            runs: 1,
            updates: 2_000,
            rate: 200,
            seconds: 2,
            csv: None,
            explain: false,
            rooms: false,
            explaining: true,
        };
        eprintln!(
            "scale: the plans of {} users (membership {})",
            self.size, self.membership
        );
        self.measure(&settings).await;
        for args in [
            vec!["servers"],
            vec!["stale", "--server", "server50.example"],
        ] {
            self.admin(&args);
        }
        let text = std::fs::read(&log).expect("server.log");
        let text = String::from_utf8_lossy(&text[from as usize..]);
        print_plans(&text);
    }
}

/// `query` with each parameter written `$` and lists of them (`IN ($1,
/// $2)`, `VALUES ($1, $2), ($3, $4)`) written once, so one statement of
/// any length is one row.
fn normalized(query: &str) -> String {
    let mut out = String::with_capacity(query.len());
    let mut chars = query.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if c == '$' {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
        }
    }
    for (list, one) in [("$, $", "$"), ("($), ($)", "($)")] {
        while out.contains(list) {
            out = out.replace(list, one);
        }
    }
    out
}

/// A free local address for the worker's HTTP listener.
fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// Prints each distinct statement of an `auto_explain` log with the scans
/// of its plans, marking sequential scans of growing tables.
fn print_plans(log: &str) {
    /// A statement's executions, their total and longest time (ms), and
    /// the scans its plans used.
    #[derive(Default)]
    struct Plans {
        runs: usize,
        total_ms: f64,
        max_ms: f64,
        scans: std::collections::BTreeSet<String>,
    }
    let mut plans: BTreeMap<String, Plans> = BTreeMap::new();
    let mut entries = Vec::new();
    let mut current = String::new();
    for line in log.lines() {
        if line.starts_with(|c: char| c.is_ascii_digit()) && !current.is_empty() {
            entries.push(std::mem::take(&mut current));
        }
        current.push_str(line);
        current.push('\n');
    }
    entries.push(current);
    for entry in entries.iter().filter(|e| e.contains("plan:")) {
        let Some((_, rest)) = entry.split_once("Query Text:") else {
            continue;
        };
        let mut lines = rest.lines();
        let query: String = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let query: String = normalized(&query).chars().take(600).collect();
        let scans = lines.filter_map(|line| {
            let node = line.trim().trim_start_matches("->").trim();
            let node = node.split("  (").next().unwrap_or(node);
            node.contains("Scan").then(|| node.to_owned())
        });
        let ms: f64 = entry
            .split_once("duration: ")
            .and_then(|(_, rest)| rest.split_once(" ms"))
            .and_then(|(ms, _)| ms.parse().ok())
            .unwrap_or(0.0);
        let plan = plans.entry(query).or_default();
        plan.runs += 1;
        plan.total_ms += ms;
        plan.max_ms = plan.max_ms.max(ms);
        plan.scans.extend(scans);
    }
    println!("\n| statement | runs | total ms | max ms | scans |\n|---|---|---|---|---|");
    for (query, plan) in &plans {
        let scans: Vec<String> = plan
            .scans
            .iter()
            .map(|scan| {
                let growing = GROWING_TABLES
                    .iter()
                    .any(|t| scan.starts_with("Seq Scan") && scan.contains(&format!(" on {t}")));
                if growing {
                    format!("**{scan}**")
                } else {
                    scan.clone()
                }
            })
            .collect();
        println!(
            "| `{}` | {} | {:.0} | {:.1} | {} |",
            query.replace('|', "\\|"),
            plan.runs,
            plan.total_ms,
            plan.max_ms,
            scans.join("; ")
        );
    }
}
