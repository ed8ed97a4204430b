//! `devicelist.in.signing_key`: the content of an `m.signing_key_update` EDU.

use ruma::OwnedUserId;
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use super::cross_signing::{self, KeyUsage};
use super::dead_letter::{DeadReason, Rejection};
use super::fields;

/// A checked signing-key update: only well-formed keys survive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SigningKeyUpdate {
    /// Owner of the keys.
    pub user_id: OwnedUserId,
    /// The master key as received, if present and well formed.
    pub master_key: Option<String>,
    /// The self-signing key as received, if present and well formed.
    pub self_signing_key: Option<String>,
    /// Why a key that was present was dropped (for logs).
    pub dropped: Vec<String>,
}

#[derive(Deserialize)]
struct Wire<'a> {
    user_id: Option<Value>,
    #[serde(borrow)]
    master_key: Option<&'a RawValue>,
    #[serde(borrow)]
    self_signing_key: Option<&'a RawValue>,
}

impl SigningKeyUpdate {
    /// Parses an EDU `content`. A key that fails the checks of SPEC §5.3 is
    /// dropped; an update left with no key at all is refused.
    pub fn parse(body: &[u8]) -> Result<Self, Rejection> {
        let wire: Wire<'_> = super::from_json(body)?;
        let user_id = fields::user_id(wire.user_id.as_ref())?;
        let mut dropped = Vec::new();
        let mut check = |raw: Option<&RawValue>, usage: KeyUsage| {
            let raw = raw?;
            match cross_signing::check(raw.get(), &user_id, usage) {
                Ok(()) => Some(raw.get().to_owned()),
                Err(e) => {
                    dropped.push(format!("{}: {e}", usage.as_str()));
                    None
                }
            }
        };
        let master_key = check(wire.master_key, KeyUsage::Master);
        let self_signing_key = check(wire.self_signing_key, KeyUsage::SelfSigning);
        if master_key.is_none() && self_signing_key.is_none() {
            let why = if dropped.is_empty() {
                "no master_key or self_signing_key".to_owned()
            } else {
                dropped.join("; ")
            };
            return Err(Rejection::new(DeadReason::InvalidSigningKey, why));
        }
        Ok(SigningKeyUpdate {
            user_id,
            master_key,
            self_signing_key,
            dropped,
        })
    }
}
