//! Configuration (SPEC §3): a TOML file, overridden by `DLU_*` environment
//! variables, overridden by flags. Every setting has one key name, used as the
//! TOML key, the flag (`--key-name`) and the variable (`DLU_KEY_NAME`).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ruma::OwnedServerName;

use crate::input::InputKind;
use crate::signing_key::{KeyError, SigningKey};

/// A setting that is missing or wrong. Its `Display` is the one line printed
/// before exiting with code 2.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A required setting is absent.
    #[error("{0} is required (set DLU_{1} or `{0}` in the config file)")]
    Missing(&'static str, String),
    /// A setting does not parse.
    #[error("{key}: {why}")]
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

/// Every setting, as flag/env values (flags win over the environment).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SettingsArgs {
    /// Our homeserver's name; updates for our own users are ignored.
    #[arg(long, env = "DLU_SERVER_NAME")]
    pub server_name: Option<String>,
    /// ed25519 key file (`ed25519 <version> <base64 seed>`).
    #[arg(long, env = "DLU_SIGNING_KEY_PATH")]
    pub signing_key_path: Option<String>,
    /// `sqlite://…` or `postgres://…`.
    #[arg(long, env = "DLU_DATABASE_URL")]
    pub database_url: Option<String>,
    /// NATS server(s), comma-separated.
    #[arg(long, env = "DLU_NATS_URL")]
    pub nats_url: Option<String>,
    /// Health listener address.
    #[arg(long, env = "DLU_HTTP_ADDR")]
    pub http_addr: Option<String>,
    /// `server=base_url,…`: fixed base URLs for some servers.
    #[arg(long, env = "DLU_FEDERATION_OVERRIDES")]
    pub federation_overrides: Option<String>,
    /// Per federation request.
    #[arg(long, env = "DLU_FEDERATION_TIMEOUT")]
    pub federation_timeout: Option<String>,
    /// First wait after a failed fetch from a server.
    #[arg(long, env = "DLU_RETRY_MIN")]
    pub retry_min: Option<String>,
    /// Cap of the per-server back-off.
    #[arg(long, env = "DLU_RETRY_MAX")]
    pub retry_max: Option<String>,
    /// Stale users found at start-up are resynced over at most this long.
    #[arg(long, env = "DLU_STARTUP_SPREAD")]
    pub startup_spread: Option<String>,
    /// A fetched list with more devices is not stored.
    #[arg(long, env = "DLU_MAX_DEVICES")]
    pub max_devices: Option<String>,
    /// Subject of device-list updates.
    #[arg(long, env = "DLU_INPUT_UPDATE_SUBJECT")]
    pub input_update_subject: Option<String>,
    /// Subject of signing-key updates.
    #[arg(long, env = "DLU_INPUT_SIGNING_KEY_SUBJECT")]
    pub input_signing_key_subject: Option<String>,
    /// Subject of resync requests.
    #[arg(long, env = "DLU_INPUT_RESYNC_SUBJECT")]
    pub input_resync_subject: Option<String>,
    /// Input messages per batch (one transaction each).
    #[arg(long, env = "DLU_BATCH_SIZE")]
    pub batch_size: Option<String>,
    /// How long to wait for NATS and the database at start-up.
    #[arg(long, env = "DLU_STARTUP_TIMEOUT")]
    pub startup_timeout: Option<String>,
    /// How long a crashed replica keeps the input lease before another takes over.
    #[arg(long, env = "DLU_LEASE_TTL")]
    pub lease_ttl: Option<String>,
    /// Deliveries of one input message before it is dead-lettered.
    #[arg(long, env = "DLU_MAX_DELIVER")]
    pub max_deliver: Option<String>,
    /// How long an unacked input message waits before redelivery (crashed replicas).
    #[arg(long, env = "DLU_ACK_WAIT")]
    pub ack_wait: Option<String>,
    /// Remote servers fetched from at once by one replica.
    #[arg(long, env = "DLU_FETCH_CONCURRENCY")]
    pub fetch_concurrency: Option<String>,
}

impl SettingsArgs {
    fn pairs(&self) -> [(&'static str, &Option<String>); 20] {
        [
            ("server_name", &self.server_name),
            ("signing_key_path", &self.signing_key_path),
            ("database_url", &self.database_url),
            ("nats_url", &self.nats_url),
            ("http_addr", &self.http_addr),
            ("federation_overrides", &self.federation_overrides),
            ("federation_timeout", &self.federation_timeout),
            ("retry_min", &self.retry_min),
            ("retry_max", &self.retry_max),
            ("startup_spread", &self.startup_spread),
            ("max_devices", &self.max_devices),
            ("input_update_subject", &self.input_update_subject),
            ("input_signing_key_subject", &self.input_signing_key_subject),
            ("input_resync_subject", &self.input_resync_subject),
            ("batch_size", &self.batch_size),
            ("startup_timeout", &self.startup_timeout),
            ("lease_ttl", &self.lease_ttl),
            ("max_deliver", &self.max_deliver),
            ("ack_wait", &self.ack_wait),
            ("fetch_concurrency", &self.fetch_concurrency),
        ]
    }
}

/// The input subjects and which kind of message each carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputSubjects {
    /// `devicelist.in.update` by default.
    pub update: String,
    /// `devicelist.in.signing_key` by default.
    pub signing_key: String,
    /// `devicelist.in.resync` by default.
    pub resync: String,
}

impl Default for InputSubjects {
    fn default() -> Self {
        InputSubjects {
            update: "devicelist.in.update".into(),
            signing_key: "devicelist.in.signing_key".into(),
            resync: "devicelist.in.resync".into(),
        }
    }
}

impl InputSubjects {
    /// The kind of message on `subject`.
    pub fn kind_of(&self, subject: &str) -> Option<InputKind> {
        if subject == self.update {
            Some(InputKind::Update)
        } else if subject == self.signing_key {
            Some(InputKind::SigningKey)
        } else if subject == self.resync {
            Some(InputKind::Resync)
        } else {
            None
        }
    }

    /// All three subjects.
    pub fn all(&self) -> Vec<String> {
        vec![
            self.update.clone(),
            self.signing_key.clone(),
            self.resync.clone(),
        ]
    }
}

/// Remote servers one replica fetches from at once, unless configured.
pub const DEFAULT_FETCH_CONCURRENCY: usize = 1024;

/// The resolved configuration of `run`.
#[derive(Clone, Debug)]
pub struct Config {
    /// Our homeserver's name.
    pub server_name: OwnedServerName,
    /// The key federation requests are signed with.
    pub signing_key: SigningKey,
    /// Database URL.
    pub database_url: String,
    /// NATS URL(s).
    pub nats_url: String,
    /// Health listener.
    pub http_addr: SocketAddr,
    /// Fixed base URLs per server.
    pub federation_overrides: BTreeMap<OwnedServerName, String>,
    /// Per federation request.
    pub federation_timeout: Duration,
    /// First back-off wait.
    pub retry_min: Duration,
    /// Back-off cap.
    pub retry_max: Duration,
    /// Spread of start-up resyncs.
    pub startup_spread: Duration,
    /// Device cap of a fetched list.
    pub max_devices: usize,
    /// Input subjects.
    pub input: InputSubjects,
    /// Messages per batch.
    pub batch_size: usize,
    /// Start-up wait for NATS and the database.
    pub startup_timeout: Duration,
    /// Input lease length.
    pub lease_ttl: Duration,
    /// Deliveries before dead-lettering.
    pub max_deliver: i64,
    /// Redelivery wait of unacked input.
    pub ack_wait: Duration,
    /// Remote servers fetched from at once by one replica.
    pub fetch_concurrency: usize,
}

/// The default database: a SQLite file in the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://device-lists.sqlite?mode=rwc";

/// The merged sources: flags/environment first, then the file.
#[derive(Debug, Default)]
pub struct Sources {
    values: HashMap<&'static str, String>,
}

impl Sources {
    /// Merges `args` over the TOML file at `path` (if any).
    pub fn load(args: &SettingsArgs, path: Option<&Path>) -> Result<Self, ConfigError> {
        let mut values = HashMap::new();
        if let Some(path) = path {
            let file_error = |why: String| ConfigError::File {
                path: path.display().to_string(),
                why,
            };
            let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
            let table: toml::Table = text
                .parse()
                .map_err(|e: toml::de::Error| file_error(e.to_string()))?;
            let known: Vec<&'static str> = args.pairs().iter().map(|(k, _)| *k).collect();
            for (key, value) in table {
                let Some(&name) = known.iter().find(|k| **k == key) else {
                    return Err(file_error(format!("unknown setting {key:?}")));
                };
                let value = match value {
                    toml::Value::String(s) => s,
                    toml::Value::Integer(i) => i.to_string(),
                    other => return Err(file_error(format!("{key}: unsupported value {other}"))),
                };
                values.insert(name, value);
            }
        }
        for (key, value) in args.pairs() {
            if let Some(value) = value {
                values.insert(key, value.clone());
            }
        }
        Ok(Sources { values })
    }

    fn get(&self, key: &'static str) -> Option<&str> {
        self.values
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.trim().is_empty())
    }

    fn parse<T>(
        &self,
        key: &'static str,
        default: T,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(raw) => parse(raw.trim()).map_err(|why| ConfigError::Invalid {
                key: key.to_owned(),
                why: format!("{raw:?}: {why}"),
            }),
        }
    }

    fn duration(&self, key: &'static str, default: Duration) -> Result<Duration, ConfigError> {
        self.parse(key, default, |s| {
            humantime::parse_duration(s).map_err(|e| e.to_string())
        })
    }

    fn number<T: std::str::FromStr>(&self, key: &'static str, default: T) -> Result<T, ConfigError>
    where
        T::Err: std::fmt::Display,
    {
        self.parse(key, default, |s| s.parse::<T>().map_err(|e| e.to_string()))
    }

    /// The database URL (all `migrate` needs).
    pub fn database_url(&self) -> String {
        self.get("database_url")
            .unwrap_or(DEFAULT_DATABASE_URL)
            .to_owned()
    }

    /// The NATS URL(s) (for admin commands).
    pub fn nats_url(&self) -> String {
        self.get("nats_url")
            .unwrap_or("nats://127.0.0.1:4222")
            .to_owned()
    }

    /// Resolves everything `run` needs, reading the signing key.
    pub fn run_config(&self) -> Result<Config, ConfigError> {
        let server_name = self
            .get("server_name")
            .ok_or_else(|| ConfigError::Missing("server_name", "SERVER_NAME".into()))
            .and_then(|s| {
                OwnedServerName::try_from(s.trim()).map_err(|e| ConfigError::Invalid {
                    key: "server_name".into(),
                    why: format!("{s:?}: {e}"),
                })
            })?;
        let key_path = self
            .get("signing_key_path")
            .ok_or_else(|| ConfigError::Missing("signing_key_path", "SIGNING_KEY_PATH".into()))?;
        let signing_key = SigningKey::load(Path::new(key_path))?;
        let retry_min = self.duration("retry_min", Duration::from_secs(60))?;
        let retry_max = self.duration("retry_max", Duration::from_secs(3600))?;
        if retry_max < retry_min {
            return Err(ConfigError::Invalid {
                key: "retry_max".into(),
                why: "must not be shorter than retry_min".into(),
            });
        }
        let defaults = InputSubjects::default();
        let batch_size: usize = self.number("batch_size", 1000)?;
        let max_deliver: i64 = self.number("max_deliver", 10)?;
        let fetch_concurrency: usize =
            self.number("fetch_concurrency", DEFAULT_FETCH_CONCURRENCY)?;
        if batch_size == 0 || max_deliver < 1 || fetch_concurrency == 0 {
            return Err(ConfigError::Invalid {
                key: if batch_size == 0 {
                    "batch_size"
                } else if max_deliver < 1 {
                    "max_deliver"
                } else {
                    "fetch_concurrency"
                }
                .into(),
                why: "must be at least 1".into(),
            });
        }
        Ok(Config {
            server_name,
            signing_key,
            database_url: self.database_url(),
            nats_url: self
                .get("nats_url")
                .unwrap_or("nats://127.0.0.1:4222")
                .to_owned(),
            http_addr: self.parse("http_addr", SocketAddr::from(([127, 0, 0, 1], 9464)), |s| {
                s.parse()
                    .map_err(|e: std::net::AddrParseError| e.to_string())
            })?,
            federation_overrides: self.parse(
                "federation_overrides",
                BTreeMap::new(),
                parse_overrides,
            )?,
            federation_timeout: self.duration("federation_timeout", Duration::from_secs(30))?,
            retry_min,
            retry_max,
            startup_spread: self.duration("startup_spread", Duration::from_secs(120))?,
            max_devices: self.number("max_devices", 1000)?,
            input: InputSubjects {
                update: self
                    .get("input_update_subject")
                    .unwrap_or(&defaults.update)
                    .to_owned(),
                signing_key: self
                    .get("input_signing_key_subject")
                    .unwrap_or(&defaults.signing_key)
                    .to_owned(),
                resync: self
                    .get("input_resync_subject")
                    .unwrap_or(&defaults.resync)
                    .to_owned(),
            },
            batch_size,
            startup_timeout: self.duration("startup_timeout", Duration::from_secs(30))?,
            lease_ttl: self.duration("lease_ttl", Duration::from_secs(10))?,
            max_deliver,
            ack_wait: self.duration("ack_wait", Duration::from_secs(60))?,
            fetch_concurrency,
        })
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

    #[test]
    fn flags_override_file_and_defaults_fill_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(
            &file,
            format!(
                "server_name = \"file.example\"\nsigning_key_path = \"{}\"\nretry_min = \"5s\"\nmax_devices = 7\n",
                key_file(dir.path())
            ),
        )
        .unwrap();
        let args = SettingsArgs {
            server_name: Some("flag.example".into()),
            ..Default::default()
        };
        let config = Sources::load(&args, Some(&file))
            .unwrap()
            .run_config()
            .unwrap();
        assert_eq!(config.server_name.as_str(), "flag.example");
        assert_eq!(config.retry_min, Duration::from_secs(5));
        assert_eq!(config.max_devices, 7);
        assert_eq!(config.retry_max, Duration::from_secs(3600));
        assert_eq!(config.database_url, DEFAULT_DATABASE_URL);
        assert_eq!(config.http_addr.to_string(), "127.0.0.1:9464");
    }

    #[test]
    fn bad_settings_say_which() {
        let dir = tempfile::tempdir().unwrap();
        let key = key_file(dir.path());
        let missing = Sources::load(&SettingsArgs::default(), None)
            .unwrap()
            .run_config();
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .contains("server_name is required")
        );
        let args = SettingsArgs {
            server_name: Some("a.example".into()),
            signing_key_path: Some(key),
            retry_min: Some("soon".into()),
            ..Default::default()
        };
        let err = Sources::load(&args, None)
            .unwrap()
            .run_config()
            .unwrap_err();
        assert!(err.to_string().starts_with("retry_min"), "{err}");
        let args = SettingsArgs {
            server_name: Some("a.example".into()),
            signing_key_path: Some("/nonexistent/key".into()),
            ..Default::default()
        };
        let err = Sources::load(&args, None)
            .unwrap()
            .run_config()
            .unwrap_err();
        assert!(err.to_string().starts_with("signing key"), "{err}");
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
