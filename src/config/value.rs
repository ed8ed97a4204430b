//! Deserialisers for values that arrive as text from the environment and
//! flags, and as text or TOML values from the file.

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
    parse_overrides(&text).map_err(D::Error::custom)
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

/// Why `federation_overrides` does not parse.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum OverrideError {
    /// An entry without `=`.
    #[error("{0:?} is not server=base_url")]
    NotAPair(String),
    /// The part before `=` is not a server name.
    #[error("{server:?}: {why}")]
    ServerName {
        /// The text given.
        server: String,
        /// What is wrong with it.
        why: String,
    },
    /// The base URL is not `http://…` or `https://…`.
    #[error("{0:?} is not an http(s) URL")]
    NotHttp(String),
}

/// Parses `server=base_url,server2=base_url2`.
pub(super) fn parse_overrides(
    raw: &str,
) -> Result<BTreeMap<OwnedServerName, String>, OverrideError> {
    raw.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (server, url) = entry
                .split_once('=')
                .ok_or_else(|| OverrideError::NotAPair(entry.to_owned()))?;
            let server = OwnedServerName::try_from(server.trim()).map_err(|e| {
                OverrideError::ServerName {
                    server: server.to_owned(),
                    why: e.to_string(),
                }
            })?;
            let url = url.trim();
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(OverrideError::NotHttp(url.to_owned()));
            }
            Ok((server, url.trim_end_matches('/').to_owned()))
        })
        .collect()
}
