//! `device-list-updater`: the command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use device_list_updater::bus::NatsConnection;
use device_list_updater::config::{Config, LogFormat, Settings, SettingsArgs};
use device_list_updater::server_key::ServerKey;
use device_list_updater::store::{Schema, Store};
use device_list_updater::worker;

/// Admin subcommands.
#[derive(Subcommand)]
enum AdminCommand {
    /// Show what is stored for users: devices, stream id, keys, stale flag.
    User {
        /// User ids.
        #[arg(required = true)]
        users: Vec<String>,
    },
    /// Count stale users per server; with --server, list that server's.
    Stale {
        /// List the stale users of this server.
        #[arg(long)]
        server: Option<String>,
    },
    /// List remote servers, worst first: tracked and stale users, back-off,
    /// last success, revalidations and divergences.
    Servers,
    /// Mark a user stale and queue its server's fetch (a worker fetches it).
    Resync {
        /// The user id.
        user: String,
    },
    /// Show the streams and consumers.
    Streams,
    /// Publish what the outbox holds now.
    ReplayOutbox,
    /// List stored users that share no room with us (membership on); with
    /// --apply, untrack them.
    UntrackUnshared {
        /// Untrack them (without it: a dry run that only lists them).
        #[arg(long)]
        apply: bool,
    },
    /// Show the rooms a user is in and through which identities.
    Rooms {
        /// The user id.
        user: String,
    },
}

impl AdminCommand {
    /// Whether the command talks to NATS (the others read the database only).
    fn needs_nats(&self) -> bool {
        match self {
            AdminCommand::Resync { .. } | AdminCommand::Streams | AdminCommand::ReplayOutbox => {
                true
            }
            AdminCommand::User { .. }
            | AdminCommand::Stale { .. }
            | AdminCommand::Servers
            | AdminCommand::UntrackUnshared { .. }
            | AdminCommand::Rooms { .. } => false,
        }
    }
}

/// Keeps a Matrix homeserver's copy of remote users' device lists up to date.
#[derive(Parser)]
#[command(name = "device-list-updater", version)]
struct Cli {
    /// TOML configuration file (overridden by DLU_* variables, overridden by flags).
    #[arg(long, global = true, env = "DLU_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the worker until SIGTERM or SIGINT.
    Run {
        #[command(flatten)]
        settings: SettingsArgs,
    },
    /// Apply database migrations and exit.
    Migrate {
        #[command(flatten)]
        settings: SettingsArgs,
    },
    /// Look at or nudge what the workers share (database, NATS).
    Admin {
        #[command(flatten)]
        settings: SettingsArgs,
        /// Print JSON instead of text.
        #[arg(long, global = true)]
        json: bool,
        #[command(subcommand)]
        command: AdminCommand,
    },
    /// Write a new signing key file and print its key id.
    GenerateKey {
        /// Where to write the key (must not exist).
        path: PathBuf,
    },
}

/// glibc gives threads that allocate at once heaps ("arenas") of their
/// own, up to eight per core, and each keeps its freed memory: a fetch
/// fan-out's thousand requests spread over them and the resident set grows
/// by their free space (measured in BENCHMARKS.md, Fan-out: peak RSS 78 →
/// 69 MiB with one arena, worker CPU unchanged on 2 cores). One arena,
/// unless the operator sets `MALLOC_ARENA_MAX` (glibc reads it itself).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn one_malloc_arena() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: first thing in `main`, before any other thread exists;
        // mallopt only sets one of the allocator's parameters.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

/// Other allocators keep their own arenas: nothing to set.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn one_malloc_arena() {}

/// How long `run` may take to stop after a signal.
const STOP_GRACE: Duration = Duration::from_secs(9);

fn main() -> ExitCode {
    one_malloc_arena();
    let cli = Cli::parse();
    // Settings first: the log format is one of them.
    let settings = match &cli.command {
        Command::GenerateKey { .. } => Ok(None),
        Command::Run { settings }
        | Command::Migrate { settings }
        | Command::Admin { settings, .. } => {
            Settings::from_process(cli.config.as_deref(), settings).map(Some)
        }
    };
    let settings = match settings {
        Ok(settings) => settings,
        Err(e) => return fail(2, &format!("configuration: {e}")),
    };
    let log_format = settings.as_ref().map_or(LogFormat::Text, |s| s.log_format);
    // An admin command's answer stands alone: only warnings and errors on
    // stderr unless RUST_LOG asks for more.
    let default_level = match cli.command {
        Command::Admin { .. } => "warn",
        Command::Run { .. } | Command::Migrate { .. } | Command::GenerateKey { .. } => "info",
    };
    let telemetry = match device_list_updater::telemetry::Telemetry::init(log_format, default_level)
    {
        Ok(telemetry) => telemetry,
        Err(e) => return fail(2, &e.to_string()),
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => return fail(1, &format!("cannot start the runtime: {e}")),
    };
    let code = runtime.block_on(async move {
        match (cli.command, settings) {
            (Command::GenerateKey { path }, _) => generate_key(&path),
            (Command::Migrate { .. }, Some(settings)) => migrate(&settings).await,
            (Command::Run { .. }, Some(settings)) => run(settings).await,
            (Command::Admin { json, command, .. }, Some(settings)) => {
                admin(&settings, json, command).await
            }
            (_, None) => fail(1, "no settings were loaded"),
        }
    });
    // Outside the runtime: the exporter flushes on its own threads.
    telemetry.shutdown();
    code
}

async fn admin(settings: &Settings, json: bool, command: AdminCommand) -> ExitCode {
    use device_list_updater::admin;
    let store = match admin_store(settings).await {
        Ok(store) => store,
        Err(code) => return code,
    };
    let js = if command.needs_nats() {
        let nats = NatsConnection::from_settings(settings);
        match device_list_updater::bus::connect(&nats, settings.startup_timeout).await {
            Ok(client) => Some(async_nats::jetstream::new(client)),
            Err(e) => return fail(2, &e.to_string()),
        }
    } else {
        None
    };
    let result = async {
        match (command, js.as_ref()) {
            (AdminCommand::User { users }, _) => {
                admin::user(&store, &admin::user_ids(&users)?).await
            }
            (AdminCommand::Stale { server }, _) => admin::stale(&store, server.as_deref()).await,
            (AdminCommand::Servers, _) => admin::servers(&store).await,
            (AdminCommand::Resync { user }, Some(js)) => {
                let user = admin::user_id(&user)?;
                admin::resync(&store, js, settings.retry_min, &user).await
            }
            (AdminCommand::Streams, Some(js)) => admin::streams(js).await,
            (AdminCommand::ReplayOutbox, Some(js)) => admin::replay_outbox(&store, js).await,
            (AdminCommand::UntrackUnshared { apply }, _) => {
                admin::untrack_unshared(&store, apply).await
            }
            (AdminCommand::Rooms { user }, _) => {
                admin::rooms(&store, &admin::user_id(&user)?).await
            }
            (
                AdminCommand::Resync { .. } | AdminCommand::Streams | AdminCommand::ReplayOutbox,
                None,
            ) => Err(admin::AdminError::Argument(
                "NATS is needed for this command".into(),
            )),
        }
    }
    .await;
    match result {
        Ok(value) if json => {
            println!("{value}");
            ExitCode::SUCCESS
        }
        Ok(value) => {
            print!("{}", admin::to_text(&value));
            ExitCode::SUCCESS
        }
        Err(e) => fail(e.exit_code(), &e.to_string()),
    }
}

/// The store the admin commands read, without migrating: only `run` and
/// `migrate` change the schema (an operator reading with a newer binary
/// during a rolling upgrade must not change it under the running workers).
/// A database whose schema is behind or ahead of this binary is refused.
async fn admin_store(settings: &Settings) -> Result<Store, ExitCode> {
    let tracking = settings
        .tracking()
        .map_err(|e| fail(2, &format!("configuration: {e}")))?;
    let store = Store::connect_within(&settings.database_url, settings.startup_timeout)
        .await
        .map_err(|e| fail(2, &format!("cannot connect to the database: {e}")))?;
    match store.schema().await {
        Ok(Schema::Current) => Ok(store.with_tracking(tracking)),
        Ok(Schema::Behind { pending }) => Err(fail(
            2,
            &format!(
                "the database schema is behind this binary ({pending} migration(s) not applied): run `device-list-updater migrate` first"
            ),
        )),
        Ok(Schema::Ahead { unknown }) => Err(fail(
            2,
            &format!(
                "the database schema is newer than this binary (migrations it does not know: {}): use the binary that ran `migrate`",
                unknown.join(", ")
            ),
        )),
        Err(e) => Err(fail(2, &format!("cannot read the database schema: {e}"))),
    }
}

/// Prints one line on stderr and returns `code`.
fn fail(code: u8, line: &str) -> ExitCode {
    eprintln!("device-list-updater: {line}");
    ExitCode::from(code)
}

fn generate_key(path: &std::path::Path) -> ExitCode {
    let written = ServerKey::generate().and_then(|key| key.write_new(path).map(|()| key));
    match written {
        Ok(key) => {
            println!("{}", key.key_id());
            ExitCode::SUCCESS
        }
        Err(e) => fail(1, &e.to_string()),
    }
}

async fn migrate(settings: &Settings) -> ExitCode {
    match worker::open_store(&settings.database_url, settings.startup_timeout).await {
        Ok(_) => {
            tracing::info!("migrations applied");
            ExitCode::SUCCESS
        }
        Err(e) => fail(2, &e.to_string()),
    }
}

async fn run(settings: Settings) -> ExitCode {
    let config = match Config::from_settings(settings) {
        Ok(config) => config,
        Err(e) => return fail(2, &format!("configuration: {e}")),
    };
    raise_open_file_limit(config.settings.fetch_concurrency);
    let running = match worker::start(config).await {
        Ok(running) => running,
        Err(e) => return fail(2, &e.to_string()),
    };
    wait_for_signal().await;
    tracing::info!("signal received; draining");
    running.stop(STOP_GRACE).await;
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// Each fetch in flight holds a socket. Many systems start processes with a
/// soft limit of 1024 open files and a far higher hard limit; raise the soft
/// limit to the hard one (as Go does), and warn if that is still too low.
fn raise_open_file_limit(fetch_concurrency: usize) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let raised = rustix::process::Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    if limit.current != limit.maximum && setrlimit(Resource::Nofile, raised).is_err() {
        tracing::debug!("cannot raise the open-file limit");
    }
    let now = getrlimit(Resource::Nofile).current;
    let wanted = fetch_concurrency as u64 + 256;
    if now.is_some_and(|n| n < wanted) {
        tracing::warn!(open_files = ?now, wanted, "the open-file limit is low for DLU_FETCH_CONCURRENCY");
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
