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

use crate::input::{InputKind, InputSubjects};
use crate::signing_key::{KeyError, SigningKey};

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

/// The flag of a setting.
fn flag_name(key: &str) -> String {
    key.replace('_', "-")
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
            log_format: LogFormat::Text,
            #[cfg(feature = "testkit")]
            fault: None,
        }
    }
}

/// Values given as flags, by key (only those given on the command line).
#[derive(Clone, Debug, Default)]
pub struct SettingsArgs(Vec<(&'static str, String)>);

impl SettingsArgs {
    /// Flags as if given on the command line (for tests).
    pub fn from_pairs(pairs: &[(&'static str, &str)]) -> SettingsArgs {
        SettingsArgs(pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect())
    }
}

impl clap::Args for SettingsArgs {
    fn augment_args(command: clap::Command) -> clap::Command {
        Settings::keys().iter().fold(command, |command, &key| {
            command.arg(
                clap::Arg::new(key)
                    .long(flag_name(key))
                    .value_name("VALUE")
                    .help(format!("{} [env: {}]", describe(key), env_name(key))),
            )
        })
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

impl clap::FromArgMatches for SettingsArgs {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let given = Settings::keys()
            .iter()
            .filter_map(|&key| Some((key, matches.get_one::<String>(key)?.clone())))
            .collect();
        Ok(SettingsArgs(given))
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

/// A path setting that is set and not empty (an empty environment variable
/// leaves it unset).
fn given(path: &Option<PathBuf>) -> Option<&PathBuf> {
    path.as_ref().filter(|p| !p.as_os_str().is_empty())
}

/// One line of `--help` per setting; `docs/configuration.md` has the rest.
/// A unit test checks that every key has one.
fn describe(key: &str) -> &'static str {
    match key {
        "server_name" => "our homeserver's name (required by run)",
        "signing_key_path" => "ed25519 signing key file (required by run)",
        "database_url" => "sqlite://… or postgres://…",
        "nats_url" => "NATS server(s), comma-separated (user:password@ or token@ authenticate)",
        "nats_creds" => "NATS .creds file",
        "nats_nkey_seed" => "file holding a NATS NKey user seed",
        "nats_tls_ca" => "CA certificate (PEM) of the NATS servers; requires TLS",
        "nats_tls_cert" => "client certificate (PEM) for NATS mutual TLS",
        "nats_tls_key" => "key (PEM) of the NATS client certificate",
        "http_addr" => "health and metrics listener",
        "federation_overrides" => "server=base_url,…: fixed base URLs",
        "federation_timeout" => "per federation request",
        "retry_min" => "first wait after a failed fetch",
        "retry_max" => "cap of every back-off",
        "startup_spread" => "spread of the start-up rescan",
        "max_devices" => "fetched lists with more devices are not stored",
        "input_update_subject" => "subject of device-list updates",
        "input_signing_key_subject" => "subject of signing-key updates",
        "input_resync_subject" => "subject of resync requests",
        "input_membership_subject" => "subject of room membership changes",
        "input_member_key_subject" => "subject of MSC4430 member-key links",
        "membership" => "on: track only users sharing a room with us",
        "msc4430" => "on: accept MSC4430 member keys as room identities",
        "batch_size" => "input messages per batch (one transaction each)",
        "startup_timeout" => "wait for NATS and the database at start-up",
        "lease_ttl" => "input lease length",
        "max_deliver" => "deliveries of an input message before it is dead-lettered",
        "ack_wait" => "redelivery wait of unacked input and fetch jobs",
        "fetch_concurrency" => "remote servers fetched from at once",
        "stream_replicas" => "replicas of the streams and KV buckets it creates (3 on a cluster)",
        "log_format" => "text or json",
        #[cfg(feature = "testkit")]
        "fault" => "fault injection (test builds only)",
        _ => "",
    }
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
        match (given(&self.nats_tls_cert), given(&self.nats_tls_key)) {
            (Some(_), None) => return invalid("nats_tls_key", "nats_tls_cert needs its key"),
            (None, Some(_)) => {
                return invalid("nats_tls_cert", "nats_tls_key needs its certificate");
            }
            _ => {}
        }
        Ok(())
    }

    /// Where NATS is and the credentials to use there.
    pub fn nats(&self) -> crate::bus::NatsConnection {
        crate::bus::NatsConnection {
            urls: self.nats_url.clone(),
            creds: given(&self.nats_creds).cloned(),
            nkey_seed: given(&self.nats_nkey_seed).cloned(),
            tls_ca: given(&self.nats_tls_ca).cloned(),
            tls_client: given(&self.nats_tls_cert)
                .cloned()
                .zip(given(&self.nats_tls_key).cloned()),
        }
    }

    /// The fault injection asked for (none outside test builds).
    pub fn faults(&self) -> crate::faults::Faults {
        #[cfg(feature = "testkit")]
        return crate::faults::Faults::armed(self.fault);
        #[cfg(not(feature = "testkit"))]
        crate::faults::Faults::default()
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
    pub signing_key: SigningKey,
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
        let signing_key = SigningKey::load(path)?;
        Ok(Config {
            server_name,
            signing_key,
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
            ..Settings::default()
        };
        Config {
            server_name: OwnedServerName::try_from(server_name).expect("a valid server name"),
            signing_key: SigningKey::generate().expect("a new signing key"),
            settings,
        }
    }
}

/// Deserialisers for values that arrive as text from the environment and
/// flags, and as text or TOML values from the file.
mod value {
    use std::collections::BTreeMap;
    use std::str::FromStr;
    use std::time::Duration;

    use ruma::OwnedServerName;
    use serde::de::{self, Deserialize, Deserializer, Error as _, Visitor};

    /// A humantime duration: `250ms`, `10s`, `1h`.
    pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(|e| D::Error::custom(format!("{text:?}: {e}")))
    }

    /// An integer, as a TOML integer or as text.
    pub fn number<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr + TryFrom<i64>,
        <T as FromStr>::Err: std::fmt::Display,
    {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum IntOrText {
            Int(i64),
            Text(String),
        }
        match IntOrText::deserialize(d)? {
            IntOrText::Int(i) => {
                T::try_from(i).map_err(|_| D::Error::custom(format!("{i} is out of range")))
            }
            IntOrText::Text(text) => text
                .parse()
                .map_err(|e| D::Error::custom(format!("{text:?}: {e}"))),
        }
    }

    /// `server=base_url,server2=base_url2`.
    pub fn overrides<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<OwnedServerName, String>, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_overrides(&text).map_err(D::Error::custom)
    }

    /// The field names a derived `Deserialize` of a struct asks for.
    pub fn field_names<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
        let mut names: &'static [&'static str] = &[];
        let _ = T::deserialize(FieldNames(&mut names));
        names
    }

    /// A deserializer that only records the field list it is given.
    struct FieldNames<'a>(&'a mut &'static [&'static str]);

    impl<'de> Deserializer<'de> for FieldNames<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(Self::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(Self::Error::custom("field names recorded"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
}

/// Parses `server=base_url,server2=base_url2`.
fn parse_overrides(raw: &str) -> Result<BTreeMap<OwnedServerName, String>, String> {
    raw.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (server, url) = entry
                .split_once('=')
                .ok_or_else(|| format!("{entry:?} is not server=base_url"))?;
            let server =
                OwnedServerName::try_from(server.trim()).map_err(|e| format!("{server:?}: {e}"))?;
            let url = url.trim();
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!("{url:?} is not an http(s) URL"));
            }
            Ok((server, url.trim_end_matches('/').to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_file(dir: &Path) -> String {
        let path = dir.join("signing.key");
        SigningKey::generate().unwrap().write_new(&path).unwrap();
        path.display().to_string()
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn scratch() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dlu-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn flags_over_environment_over_file_and_defaults_fill_the_rest() {
        let dir = scratch();
        let file = dir.join("config.toml");
        std::fs::write(
            &file,
            format!(
                "server_name = \"file.example\"\nsigning_key_path = \"{}\"\nretry_min = \"5s\"\nmax_devices = 7\nbatch_size = 3\n",
                key_file(&dir)
            ),
        )
        .unwrap();
        let flags = SettingsArgs::from_pairs(&[("server_name", "flag.example")]);
        let settings = Settings::load(
            Some(&file),
            env(&[
                ("DLU_SERVER_NAME", "env.example"),
                ("DLU_BATCH_SIZE", " 9 "),
                ("DLU_MAX_DEVICES", "  "),
                ("OTHER", "x"),
            ]),
            &flags,
        )
        .unwrap();
        let config = Config::from_settings(settings).unwrap();
        assert_eq!(config.server_name.as_str(), "flag.example");
        let settings = &config.settings;
        assert_eq!(settings.batch_size, 9, "the environment beats the file");
        assert_eq!(settings.max_devices, 7, "a blank variable is unset");
        assert_eq!(settings.retry_min, Duration::from_secs(5));
        assert_eq!(settings.retry_max, Duration::from_secs(3600));
        assert_eq!(
            settings.database_url,
            "sqlite://device-lists.sqlite?mode=rwc"
        );
        assert_eq!(settings.http_addr.to_string(), "127.0.0.1:9464");
        assert_eq!(settings.log_format, LogFormat::Text);
    }

    #[test]
    fn bad_settings_say_which() {
        let dir = scratch();
        let key = key_file(&dir);
        let load = |pairs: &[(&str, &str)]| {
            Settings::load(None, env(pairs), &SettingsArgs::default())
                .and_then(Config::from_settings)
                .unwrap_err()
                .to_string()
        };
        assert!(load(&[]).contains("server_name is required"));
        let err = load(&[
            ("DLU_SERVER_NAME", "a.example"),
            ("DLU_SIGNING_KEY_PATH", &key),
            ("DLU_RETRY_MIN", "soon"),
        ]);
        assert!(err.starts_with("retry_min (DLU_RETRY_MIN)"), "{err}");
        let err = load(&[
            ("DLU_SERVER_NAME", "a.example"),
            ("DLU_SIGNING_KEY_PATH", "/nonexistent/key"),
        ]);
        assert!(err.starts_with("signing key"), "{err}");
        let err = load(&[("DLU_BATCH_SIZE", "many")]);
        assert!(err.starts_with("batch_size"), "{err}");
        let err = load(&[("DLU_FETCH_CONCURRENCY", "0")]);
        assert!(err.starts_with("fetch_concurrency"), "{err}");
        for replicas in ["0", "6"] {
            let err = load(&[("DLU_STREAM_REPLICAS", replicas)]);
            assert!(
                err.contains("stream_replicas") && err.contains("between 1 and 5"),
                "{err}"
            );
        }
        let err = load(&[("DLU_LOG_FORMAT", "xml")]);
        assert!(err.contains("DLU_LOG_FORMAT"), "{err}");
        let err = load(&[("DLU_RETRY_MIN", "2h")]);
        assert!(err.starts_with("retry_max"), "{err}");
    }

    #[test]
    fn unknown_file_keys_are_refused() {
        let dir = scratch();
        let file = dir.join("config.toml");
        std::fs::write(&file, "server_nmae = \"typo.example\"\n").unwrap();
        let err = Settings::load(Some(&file), env(&[]), &SettingsArgs::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("server_nmae"), "{err}");
    }

    #[test]
    fn every_field_is_a_key_with_help() {
        let keys = Settings::keys();
        assert!(keys.contains(&"server_name") && keys.contains(&"log_format"));
        assert!(keys.len() >= 21, "{keys:?}");
        for key in keys {
            assert!(!describe(key).is_empty(), "{key} has no --help line");
        }
    }

    #[test]
    fn every_key_is_documented() {
        let doc = include_str!("../docs/configuration.md");
        for key in Settings::keys() {
            if *key == "fault" {
                continue; // test builds only, described below the table
            }
            assert!(
                doc.contains(&format!("| `{key}` | `{}` |", env_name(key))),
                "docs/configuration.md has no row for {key}"
            );
        }
    }

    #[test]
    fn overrides_parse() {
        let map =
            parse_overrides("a.example=http://127.0.0.1:8001/, b.example:8448=https://b").unwrap();
        assert_eq!(map.len(), 2);
        assert_eq!(
            map[<&ruma::ServerName>::try_from("a.example").unwrap()],
            "http://127.0.0.1:8001"
        );
        assert!(parse_overrides("nonsense").is_err());
        assert!(parse_overrides("a.example=ftp://x").is_err());
    }
}
