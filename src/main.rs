//! `device-list-updater`: the command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use device_list_updater::config::{SettingsArgs, Sources};
use device_list_updater::signing_key::SigningKey;
use device_list_updater::worker::{self, Faults};

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
    /// Mark a user stale and queue its server's fetch (a worker fetches it).
    Resync {
        /// The user id.
        user: String,
    },
    /// Show the streams and consumers.
    Streams,
    /// Publish what the outbox holds now.
    ReplayOutbox,
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

/// How long `run` may take to stop after a signal.
const STOP_GRACE: Duration = Duration::from_secs(9);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let telemetry = match device_list_updater::telemetry::Telemetry::init(
        std::env::var("DLU_LOG_FORMAT").ok().as_deref(),
    ) {
        Ok(telemetry) => telemetry,
        Err(e) => return fail(2, &e),
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => return fail(1, &format!("cannot start the runtime: {e}")),
    };
    let code = runtime.block_on(async move {
        match cli.command {
            Command::GenerateKey { path } => generate_key(&path),
            Command::Migrate { settings } => migrate(&settings, cli.config.as_deref()).await,
            Command::Run { settings } => run(&settings, cli.config.as_deref()).await,
            Command::Admin {
                settings,
                json,
                command,
            } => admin(&settings, cli.config.as_deref(), json, command).await,
        }
    });
    // Outside the runtime: the exporter flushes on its own threads.
    telemetry.shutdown();
    code
}

async fn admin(
    settings: &SettingsArgs,
    config: Option<&std::path::Path>,
    json: bool,
    command: AdminCommand,
) -> ExitCode {
    use device_list_updater::admin;
    let sources = match Sources::load(settings, config) {
        Ok(sources) => sources,
        Err(e) => return fail(2, &e.to_string()),
    };
    let store = match worker::open_store(&sources.database_url(), Duration::from_secs(10)).await {
        Ok(store) => store,
        Err(e) => return fail(2, &e.to_string()),
    };
    let needs_nats = matches!(
        command,
        AdminCommand::Resync { .. } | AdminCommand::Streams | AdminCommand::ReplayOutbox
    );
    let js = if needs_nats {
        match device_list_updater::bus::connect(&sources.nats_url(), Duration::from_secs(10)).await
        {
            Ok(client) => Some(async_nats::jetstream::new(client)),
            Err(e) => return fail(2, &e),
        }
    } else {
        None
    };
    let result = match (command, js.as_ref()) {
        (AdminCommand::User { users }, _) => admin::user(&store, &users).await,
        (AdminCommand::Stale { server }, _) => admin::stale(&store, server.as_deref()).await,
        (AdminCommand::Resync { user }, Some(js)) => admin::resync(&store, js, &user).await,
        (AdminCommand::Streams, Some(js)) => admin::streams(js).await,
        (AdminCommand::ReplayOutbox, Some(js)) => admin::replay_outbox(&store, js).await,
        _ => Err("NATS is needed for this command".into()),
    };
    match result {
        Ok(value) if json => {
            println!("{value}");
            ExitCode::SUCCESS
        }
        Ok(value) => {
            print!("{}", admin::to_text(&value));
            ExitCode::SUCCESS
        }
        Err(e) => fail(1, &e),
    }
}

/// Prints one line on stderr and returns `code`.
fn fail(code: u8, line: &str) -> ExitCode {
    eprintln!("device-list-updater: {line}");
    ExitCode::from(code)
}

fn generate_key(path: &std::path::Path) -> ExitCode {
    let written = SigningKey::generate().and_then(|key| key.write_new(path).map(|()| key));
    match written {
        Ok(key) => {
            println!("{}", key.key_id());
            ExitCode::SUCCESS
        }
        Err(e) => fail(1, &e.to_string()),
    }
}

async fn migrate(settings: &SettingsArgs, config: Option<&std::path::Path>) -> ExitCode {
    let sources = match Sources::load(settings, config) {
        Ok(sources) => sources,
        Err(e) => return fail(2, &e.to_string()),
    };
    match worker::open_store(&sources.database_url(), Duration::from_secs(30)).await {
        Ok(_) => {
            tracing::info!("migrations applied");
            ExitCode::SUCCESS
        }
        Err(e) => fail(2, &e.to_string()),
    }
}

async fn run(settings: &SettingsArgs, config: Option<&std::path::Path>) -> ExitCode {
    let config = match Sources::load(settings, config).and_then(|s| s.run_config()) {
        Ok(config) => config,
        Err(e) => return fail(2, &format!("configuration: {e}")),
    };
    raise_open_file_limit(config.fetch_concurrency);
    let running = match worker::start(config, Faults::from_env()).await {
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
