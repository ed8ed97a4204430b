//! Configuration (SPEC §3) as data.
//!
//! [`Settings`] is every setting, typed, with every default in one place
//! ([`Settings::default`]). Sources are layered lowest first: a TOML file,
//! `DLU_*` environment variables, flags. Each setting has one key: the TOML
//! key `retry_min`, the variable `DLU_RETRY_MIN`, the flag `--retry-min`. The
//! list of keys is the struct's own field list (read from its serde
//! derive), so a new field is a new key everywhere at once.
//!
//! Layering is done here rather than with figment: figment's environment
//! provider guesses types from the text (a value such as `8080` or `0123`
//! becomes a number and no longer deserialises into a string), and clap
//! already reads the flags. Every source becomes a TOML table of strings or
//! values; the merged table is deserialised once, with unknown keys refused
//! and the failing key named.
//!
//! [`Config`] is what `run` needs: the settings plus the two required ones
//! resolved (our server name, the loaded signing key).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ruma::OwnedServerName;
use serde::Deserialize;

use crate::input::{InputKind, InputSubjects, RoomRules, Tracking};

mod args;
mod value;

use crate::server_key::{KeyError, ServerKey};
pub use args::SettingsArgs;
pub use value::OverrideError;

/// A setting that is missing or wrong. Its `Display` is the one line printed
/// before exiting with code 2.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A required setting is absent.
    #[error(
        "{key} is required (set {} or `{key}` in the config file)",
        env_name(key)
    )]
    Missing {
        /// The setting.
        key: &'static str,
    },
    /// A setting does not parse or is out of range.
    #[error("{key} ({}): {why}", env_name(key))]
    Invalid {
        /// The setting.
        key: String,
        /// What is wrong.
        why: String,
    },
    /// The config file cannot be used.
    #[error("config file {path}: {why}")]
    File {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// The signing key cannot be used.
    #[error("signing key: {0}")]
    Key(#[from] KeyError),
}

/// The environment variable of a setting.
pub fn env_name(key: &str) -> String {
    format!("DLU_{}", key.to_uppercase())
}

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A setting that is `on` or `off`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    /// Off.
    #[default]
    Off,
    /// On.
    On,
}

impl Switch {
    /// Whether it is on.
    pub fn is_on(self) -> bool {
        self == Switch::On
    }
}

/// Every setting (SPEC §3), as deserialised from the merged sources.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Our homeserver's name; updates for our own users are ignored.
    /// Required by `run`.
    pub server_name: Option<OwnedServerName>,
    /// ed25519 key file (`ed25519 <version> <base64 seed>`). Required by `run`.
    pub signing_key_path: Option<PathBuf>,
    /// `sqlite://…` or `postgres://…`.
    pub database_url: String,
    /// NATS server(s), comma-separated; `user:password@` or `token@` in a
    /// URL authenticate.
    pub nats_url: String,
    /// A NATS `.creds` file (JWT and NKey seed).
    pub nats_creds: Option<PathBuf>,
    /// A file holding an NKey user seed (`SU…`).
    pub nats_nkey_seed: Option<PathBuf>,
    /// CA certificate (PEM) to verify the NATS servers; requires TLS.
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for NATS mutual TLS (with `nats_tls_key`).
    pub nats_tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    pub nats_tls_key: Option<PathBuf>,
    /// Health and metrics listener.
    pub http_addr: SocketAddr,
    /// `server=base_url,…`: fixed base URLs for some servers.
    #[serde(deserialize_with = "value::overrides")]
    pub federation_overrides: BTreeMap<OwnedServerName, String>,
    /// Per federation request.
    #[serde(deserialize_with = "value::duration")]
    pub federation_timeout: Duration,
    /// First wait after a failed fetch (a floor).
    #[serde(deserialize_with = "value::duration")]
    pub retry_min: Duration,
    /// Cap of every back-off.
    #[serde(deserialize_with = "value::duration")]
    pub retry_max: Duration,
    /// Stale users found at start-up are fetched over at most this long.
    #[serde(deserialize_with = "value::duration")]
    pub startup_spread: Duration,
    /// A fetched list with more devices is not stored.
    #[serde(deserialize_with = "value::number")]
    pub max_devices: usize,
    /// A tracked list last fetched longer ago than this is fetched again,
    /// spread evenly, after real work (SPEC §5.7); zero: never.
    #[serde(deserialize_with = "value::duration")]
    pub revalidate_after: Duration,
    /// Subject of device-list updates.
    pub input_update_subject: String,
    /// Subject of signing-key updates.
    pub input_signing_key_subject: String,
    /// Subject of resync requests.
    pub input_resync_subject: String,
    /// Subject of room membership changes.
    pub input_membership_subject: String,
    /// Subject of member-key links.
    pub input_member_key_subject: String,
    /// `on`: only remote users sharing a room with us are tracked, from the
    /// membership feed (SPEC §5.5).
    pub membership: Switch,
    /// `on`: MSC4430 member keys are room identities (SPEC §5.6).
    pub msc4430: Switch,
    /// Input messages per pull and per transaction.
    #[serde(deserialize_with = "value::number")]
    pub batch_size: usize,
    /// How long to wait for NATS and the database at start-up.
    #[serde(deserialize_with = "value::duration")]
    pub startup_timeout: Duration,
    /// How long a crashed replica keeps the input lease.
    #[serde(deserialize_with = "value::duration")]
    pub lease_ttl: Duration,
    /// Deliveries of one input message before it is dead-lettered.
    #[serde(deserialize_with = "value::number")]
    pub max_deliver: i64,
    /// Redelivery wait of unacked input and of a dead replica's fetch job.
    #[serde(deserialize_with = "value::duration")]
    pub ack_wait: Duration,
    /// Remote servers one replica fetches from at once.
    #[serde(deserialize_with = "value::number")]
    pub fetch_concurrency: usize,
    /// Replicas of the streams and KV buckets the worker creates (1–5).
    #[serde(deserialize_with = "value::number")]
    pub stream_replicas: usize,
    /// Input partitions (1–256): the input is split by user or room id
    /// into this many, each ingested by one replica at a time (SPEC §4.5).
    #[serde(deserialize_with = "value::number")]
    pub input_partitions: u16,
    /// `text` or `json` log lines on stderr.
    pub log_format: LogFormat,
    /// Fault injection for the crash tests; compiled into test builds only.
    #[cfg(feature = "testkit")]
    pub fault: Option<crate::faults::Fault>,
}

/// The one table of defaults.
impl Default for Settings {
    fn default() -> Self {
        Settings {
            server_name: None,
            signing_key_path: None,
            database_url: "sqlite://device-lists.sqlite?mode=rwc".into(),
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_creds: None,
            nats_nkey_seed: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            http_addr: SocketAddr::from(([127, 0, 0, 1], 9464)),
            federation_overrides: BTreeMap::new(),
            federation_timeout: Duration::from_secs(30),
            retry_min: Duration::from_secs(60),
            retry_max: Duration::from_secs(3600),
            startup_spread: Duration::from_secs(120),
            max_devices: 1000,
            revalidate_after: Duration::from_secs(7 * 24 * 3600),
            input_update_subject: InputKind::Update.default_subject().into(),
            input_signing_key_subject: InputKind::SigningKey.default_subject().into(),
            input_resync_subject: InputKind::Resync.default_subject().into(),
            input_membership_subject: InputKind::Membership.default_subject().into(),
            input_member_key_subject: InputKind::MemberKey.default_subject().into(),
            membership: Switch::Off,
            msc4430: Switch::Off,
            batch_size: 1000,
            startup_timeout: Duration::from_secs(30),
            lease_ttl: Duration::from_secs(10),
            max_deliver: 10,
            ack_wait: Duration::from_secs(60),
            fetch_concurrency: 1024,
            stream_replicas: 1,
            input_partitions: 1,
            log_format: LogFormat::Text,
            #[cfg(feature = "testkit")]
            fault: None,
        }
    }
}

/// A path setting that is set and not empty (an empty environment variable
/// leaves it unset).
pub fn given(path: &Option<PathBuf>) -> Option<&PathBuf> {
    path.as_ref().filter(|p| !p.as_os_str().is_empty())
}

impl Settings {
    /// Every key, in declaration order: the struct's own field list.
    pub fn keys() -> &'static [&'static str] {
        static KEYS: std::sync::OnceLock<&'static [&'static str]> = std::sync::OnceLock::new();
        KEYS.get_or_init(value::field_names::<Settings>)
    }

    /// Layers the file at `path` (if any), the `DLU_*` variables of `env`
    /// and the flags, then checks the result. Blank values count as unset.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &SettingsArgs,
    ) -> Result<Settings, ConfigError> {
        let mut merged = match path {
            Some(path) => read_file(path)?,
            None => toml::Table::new(),
        };
        let env: BTreeMap<String, String> = env.into_iter().collect();
        let given = Settings::keys()
            .iter()
            .filter_map(|key| Some((*key, env.get(&env_name(key))?.as_str())))
            .chain(flags.0.iter().map(|(key, value)| (*key, value.as_str())))
            // Blank counts as unset: a blank variable lets the file's value
            // (or the default) through.
            .filter(|(_, value)| !value.trim().is_empty());
        for (key, value) in given {
            merged.insert(key.to_owned(), toml::Value::String(value.to_owned()));
        }
        // Text is trimmed; a blank value left in the file is unset too.
        let merged: toml::Table = merged
            .into_iter()
            .filter_map(|(key, value)| match value {
                toml::Value::String(s) if s.trim().is_empty() => None,
                toml::Value::String(s) => Some((key, toml::Value::String(s.trim().to_owned()))),
                other => Some((key, other)),
            })
            .collect();
        let settings: Settings = serde_path_to_error::deserialize(toml::Value::Table(merged))
            .map_err(|e| {
                let key = e.path().to_string();
                let why = e.into_inner().to_string();
                if key == "." {
                    // Not about one key: an unknown one, most likely.
                    ConfigError::File {
                        path: path.map_or_else(String::new, |p| p.display().to_string()),
                        why,
                    }
                } else {
                    ConfigError::Invalid { key, why }
                }
            })?;
        settings.check()?;
        Ok(settings)
    }

    /// Loads from the process environment (`std::env::vars`).
    pub fn from_process(
        path: Option<&Path>,
        flags: &SettingsArgs,
    ) -> Result<Settings, ConfigError> {
        Settings::load(path, std::env::vars(), flags)
    }

    /// Ranges the types cannot express.
    fn check(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, why: &str| {
            Err(ConfigError::Invalid {
                key: key.into(),
                why: why.into(),
            })
        };
        if self.retry_max < self.retry_min {
            return invalid("retry_max", "must not be shorter than retry_min");
        }
        for (key, value) in [
            ("batch_size", self.batch_size),
            ("fetch_concurrency", self.fetch_concurrency),
        ] {
            if value == 0 {
                return invalid(key, "must be at least 1");
            }
        }
        if self.max_deliver < 1 {
            return invalid("max_deliver", "must be at least 1");
        }
        if !(1..=5).contains(&self.stream_replicas) {
            return invalid("stream_replicas", "must be between 1 and 5");
        }
        if !(1..=256).contains(&self.input_partitions) {
            return invalid("input_partitions", "must be between 1 and 256");
        }
        match (given(&self.nats_tls_cert), given(&self.nats_tls_key)) {
            (Some(_), None) => return invalid("nats_tls_key", "nats_tls_cert needs its key"),
            (None, Some(_)) => {
                return invalid("nats_tls_cert", "nats_tls_key needs its certificate");
            }
            _ => {}
        }
        Ok(())
    }

    /// The fault injection asked for (none outside test builds).
    pub fn faults(&self) -> crate::faults::Faults {
        #[cfg(feature = "testkit")]
        return crate::faults::Faults::armed(self.fault);
        #[cfg(not(feature = "testkit"))]
        crate::faults::Faults::default()
    }

    /// Who is tracked when our server is `own_server`: the one membership
    /// switch the parts are given.
    pub fn tracking_for(&self, own_server: &OwnedServerName) -> Tracking {
        match self.membership {
            Switch::Off => Tracking::Everyone,
            Switch::On => Tracking::SharedRooms(RoomRules {
                own_server: own_server.clone(),
                member_keys: self.msc4430.is_on(),
            }),
        }
    }

    /// Who is tracked, from `server_name`: rooms deciding needs it.
    pub fn tracking(&self) -> Result<Tracking, ConfigError> {
        match (&self.server_name, self.membership) {
            (Some(own_server), _) => Ok(self.tracking_for(own_server)),
            (None, Switch::Off) => Ok(Tracking::Everyone),
            (None, Switch::On) => Err(ConfigError::Missing { key: "server_name" }),
        }
    }

    /// The configured subject of each input kind.
    pub fn input_subjects(&self) -> InputSubjects {
        InputSubjects::new(|kind| match kind {
            InputKind::Update => &self.input_update_subject,
            InputKind::SigningKey => &self.input_signing_key_subject,
            InputKind::Resync => &self.input_resync_subject,
            InputKind::Membership => &self.input_membership_subject,
            InputKind::MemberKey => &self.input_member_key_subject,
        })
    }
}

fn read_file(path: &Path) -> Result<toml::Table, ConfigError> {
    let file_error = |why: String| ConfigError::File {
        path: path.display().to_string(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
    text.parse()
        .map_err(|e: toml::de::Error| file_error(e.to_string()))
}

/// The resolved configuration of `run`.
#[derive(Clone, Debug)]
pub struct Config {
    /// Our homeserver's name.
    pub server_name: OwnedServerName,
    /// The key federation requests are signed with.
    pub server_key: ServerKey,
    /// Everything else.
    pub settings: Settings,
}

impl Config {
    /// Requires the server name and reads the signing key.
    pub fn from_settings(settings: Settings) -> Result<Config, ConfigError> {
        let server_name = settings
            .server_name
            .clone()
            .ok_or(ConfigError::Missing { key: "server_name" })?;
        let path = settings
            .signing_key_path
            .as_deref()
            .ok_or(ConfigError::Missing {
                key: "signing_key_path",
            })?;
        let server_key = ServerKey::load(path)?;
        Ok(Config {
            server_name,
            server_key,
            settings,
        })
    }

    /// A configuration for tests, the demo and the benchmarks: a new signing
    /// key, any free HTTP port, no start-up spread, short timeouts. Tests
    /// change what they exercise on the returned value.
    #[cfg(feature = "testkit")]
    pub fn for_tests(server_name: &str, nats_url: &str, database_url: &str) -> Config {
        let settings = Settings {
            server_name: OwnedServerName::try_from(server_name).ok(),
            database_url: database_url.to_owned(),
            nats_url: nats_url.to_owned(),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            federation_timeout: Duration::from_secs(5),
            retry_min: Duration::from_millis(200),
            retry_max: Duration::from_secs(2),
            startup_spread: Duration::ZERO,
            startup_timeout: Duration::from_secs(10),
            lease_ttl: Duration::from_secs(2),
            ack_wait: Duration::from_secs(2),
            fetch_concurrency: 64,
            // Tests of revalidation turn it on with a short period.
            revalidate_after: Duration::ZERO,
            ..Settings::default()
        };
        Config {
            server_name: OwnedServerName::try_from(server_name).expect("a valid server name"),
            server_key: ServerKey::generate().expect("a new signing key"),
            settings,
        }
    }
}

#[cfg(test)]
mod tests;
