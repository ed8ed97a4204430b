//! Settings as flags: one `--key` per setting, its help taken from the
//! settings table of `docs/configuration.md`.

use super::{Settings, env_name};

/// The flag of a setting.
fn flag_name(key: &str) -> String {
    key.replace('_', "-")
}

/// Values given as flags, by key (only those given on the command line).
#[derive(Clone, Debug, Default)]
pub struct SettingsArgs(pub(super) Vec<(&'static str, String)>);

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
                    .help(format!(
                        "{} [env: {}]",
                        first_clause(&describe(key)),
                        env_name(key)
                    ))
                    .long_help(format!("{} [env: {}]", describe(key), env_name(key))),
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

/// The settings table of `docs/configuration.md`: the one description of
/// every key, which `--help` shows.
const TABLE: &str = include_str!("../../docs/configuration.md");

/// A key's row in the settings table: its default and its meaning, as
/// written (markdown included). None for a key without a row.
pub(super) fn documented(key: &str) -> Option<(&'static str, &'static str)> {
    let start = format!("| `{key}` | `{}` | ", env_name(key));
    let row = TABLE
        .lines()
        .find_map(|line| line.strip_prefix(start.as_str()))?;
    let (default, meaning) = row.split_once(" | ")?;
    Some((
        default,
        meaning.trim_end_matches(" |").trim_end_matches('|').trim(),
    ))
}

/// A key's `--help` text: its meaning from the settings table, without
/// the markdown.
fn describe(key: &str) -> String {
    #[cfg(feature = "testkit")]
    if key == "fault" {
        return "fault injection (test builds only)".to_owned();
    }
    documented(key).map_or_else(String::new, |(_, meaning)| plain(meaning))
}

/// The first clause of a description (up to its first `;`), for `-h`.
fn first_clause(text: &str) -> &str {
    text.split(';').next().unwrap_or(text).trim()
}

/// Markdown to plain text: code spans lose their backticks, links keep
/// their text.
fn plain(markdown: &str) -> String {
    let mut out = String::with_capacity(markdown.len());
    let mut rest = markdown;
    while let Some(open) = rest.find('[') {
        let (before, after) = rest.split_at(open);
        out.push_str(before);
        match after.find("](").zip(after.find(')')) {
            Some((close, end)) if close < end => {
                out.push_str(&after[1..close]);
                rest = &after[end + 1..];
            }
            _ => {
                out.push('[');
                rest = &after[1..];
            }
        }
    }
    out.push_str(rest);
    out.replace('`', "")
}
