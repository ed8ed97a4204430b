//! Our server's federation key: the ed25519 key requests are signed with
//!. Its file: one line, `ed25519 <version> <unpadded
//! base64 of the 32-byte seed>` (Synapse's `signing.key` format).

use std::fmt;
use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};

/// Our server's federation key: its version (the part after `ed25519:` in key ids) and seed.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerKey {
    version: String,
    seed: [u8; 32],
}

/// Why a key file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file's content is not a key line.
    #[error("{0}")]
    Format(String),
}

impl ServerKey {
    /// Parses the first non-empty line of a key file.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("");
        let mut parts = line.split_whitespace();
        let (Some(algorithm), Some(version), Some(seed), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(KeyError::Format(
                "expected one line `ed25519 <version> <base64 seed>`".into(),
            ));
        };
        if algorithm != "ed25519" {
            return Err(KeyError::Format(format!(
                "algorithm {algorithm:?} is not ed25519"
            )));
        }
        if !version
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(KeyError::Format(format!(
                "key version {version:?} must be [A-Za-z0-9_]+"
            )));
        }
        let bytes = STANDARD_NO_PAD
            .decode(seed)
            .or_else(|_| STANDARD.decode(seed))
            .map_err(|_| KeyError::Format("seed is not base64".into()))?;
        let seed: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| {
            KeyError::Format(format!("seed has {} bytes, not 32", b.len()))
        })?;
        Ok(ServerKey {
            version: version.to_owned(),
            seed,
        })
    }

    /// Reads and parses a key file.
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|e| KeyError::Format(format!("{}: {e}", path.display())))
    }

    /// A new random key with a random version `a_XXXX`.
    pub fn generate() -> Result<Self, KeyError> {
        let mut seed = [0u8; 32];
        let mut tag = [0u8; 4];
        getrandom::fill(&mut seed)
            .and_then(|()| getrandom::fill(&mut tag))
            .map_err(|e| KeyError::Format(format!("no randomness: {e}")))?;
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let suffix: String = tag
            .iter()
            .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
            .collect();
        Ok(ServerKey {
            version: format!("a_{suffix}"),
            seed,
        })
    }

    /// Writes a new key file (mode 0600); refuses to overwrite one.
    pub fn write_new(&self, path: &Path) -> Result<(), KeyError> {
        use std::io::Write as _;
        let io = |source| KeyError::Io {
            path: path.display().to_string(),
            source,
        };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(path).map_err(io)?;
        file.write_all(self.to_line().as_bytes()).map_err(io)
    }

    /// The key as ruma's signing key pair (for X-Matrix request signatures).
    pub fn key_pair(&self) -> Result<ruma::signatures::Ed25519KeyPair, KeyError> {
        // PKCS#8 v1 wrapping of a raw Ed25519 seed (RFC 8410): a fixed
        // 16-byte header, then the 32 seed bytes.
        const PKCS8_PREFIX: [u8; 16] = [
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        let mut der = Vec::with_capacity(48);
        der.extend_from_slice(&PKCS8_PREFIX);
        der.extend_from_slice(&self.seed);
        ruma::signatures::Ed25519KeyPair::from_der(&der, self.version.clone())
            .map_err(|e| KeyError::Format(format!("unusable ed25519 seed: {e}")))
    }

    /// The key version (`ed25519:<version>` is its key id).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The key file line.
    pub fn to_line(&self) -> String {
        format!(
            "ed25519 {} {}\n",
            self.version,
            STANDARD_NO_PAD.encode(self.seed)
        )
    }

    /// The key id, `ed25519:<version>`.
    pub fn key_id(&self) -> String {
        format!("ed25519:{}", self.version)
    }

    /// The 32-byte seed.
    pub fn seed(&self) -> &[u8; 32] {
        &self.seed
    }
}

impl fmt::Debug for ServerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ServerKey({}, <secret>)", self.key_id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_the_file_format() {
        let key = ServerKey::generate().unwrap();
        let parsed = ServerKey::parse(&key.to_line()).unwrap();
        assert_eq!(parsed, key);
        assert!(key.key_id().starts_with("ed25519:a_"));
        assert!(!format!("{key:?}").contains(&STANDARD_NO_PAD.encode(key.seed())));
    }

    #[test]
    fn parses_synapse_keys_and_refuses_bad_ones() {
        let line = "ed25519 a_AbCd nqOvzeuGWT/sRx3h7+MHoInYj3Uk2LD/unI9kDYcHwk\n";
        assert_eq!(ServerKey::parse(line).unwrap().key_id(), "ed25519:a_AbCd");
        for bad in [
            "",
            "ed25519 a_x",
            "rsa a_x AAAA",
            "ed25519 a-x nqOv",
            "ed25519 a_x AAAA",
        ] {
            assert!(ServerKey::parse(bad).is_err(), "{bad}");
        }
    }
}
