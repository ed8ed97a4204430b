//! Settings from every source, their checks, and the documentation of every key.

use super::args::documented;
use super::value::parse_overrides;
use super::*;

fn key_file(dir: &Path) -> String {
    let path = dir.join("signing.key");
    ServerKey::generate().unwrap().write_new(&path).unwrap();
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
fn every_key_has_one_row_in_the_settings_table() {
    let keys = Settings::keys();
    assert!(keys.contains(&"server_name") && keys.contains(&"log_format"));
    assert!(keys.len() >= 21, "{keys:?}");
    for key in keys {
        if *key == "fault" {
            continue; // test builds only, described below the table
        }
        let (_, meaning) =
            documented(key).unwrap_or_else(|| panic!("docs/configuration.md has no row for {key}"));
        assert!(!meaning.is_empty(), "{key}'s row has no meaning");
    }
}

/// The defaults column of `docs/configuration.md` says what
/// [`Settings::default`] holds: each documented default, given as the
/// key's value, loads the very same settings as giving nothing.
#[test]
fn the_settings_table_states_the_defaults() {
    let defaults = format!(
        "{:?}",
        Settings::load(None, env(&[]), &SettingsArgs::default()).unwrap()
    );
    let mut checked = 0;
    for key in Settings::keys() {
        let Some((default, _)) = documented(key) else {
            continue;
        };
        if default.starts_with("required") || default == "empty" {
            let given = format!("{:?}", Settings::default());
            let empty = ["None", "\"\"", "{}"];
            assert!(
                empty
                    .iter()
                    .any(|e| given.contains(&format!("{key}: {e},"))),
                "{key} is documented as {default} but has a default"
            );
            continue;
        }
        let value = default.trim_matches('`');
        let name = env_name(key);
        let loaded = Settings::load(
            None,
            env(&[(name.as_str(), value)]),
            &SettingsArgs::default(),
        )
        .unwrap_or_else(|e| panic!("{key}'s documented default {default} does not load: {e}"));
        assert_eq!(
            format!("{loaded:?}"),
            defaults,
            "{key}'s documented default {default} is not its default"
        );
        checked += 1;
    }
    assert!(checked >= 20, "{checked} defaults checked");
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
    assert_eq!(
        parse_overrides("nonsense"),
        Err(OverrideError::NotAPair("nonsense".into()))
    );
    assert_eq!(
        parse_overrides("a.example=ftp://x"),
        Err(OverrideError::NotHttp("ftp://x".into()))
    );
    assert!(matches!(
        parse_overrides("not a server=http://x"),
        Err(OverrideError::ServerName { .. })
    ));
}
