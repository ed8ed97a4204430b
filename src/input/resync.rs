//! `devicelist.in.resync`: the homeserver asks for a user's list to be fetched again.

use ruma::OwnedUserId;
use serde::Deserialize;
use serde_json::Value;

use super::dead_letter::Rejection;
use super::fields;

/// A request to refetch one user's device list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResyncRequest {
    /// The user whose list is wanted.
    pub user_id: OwnedUserId,
}

#[derive(Deserialize)]
struct Wire {
    user_id: Option<Value>,
}

impl ResyncRequest {
    /// Parses `{"user_id": "@a:b"}`.
    pub fn parse(body: &[u8]) -> Result<Self, Rejection> {
        let wire: Wire = super::from_json(body)?;
        Ok(ResyncRequest {
            user_id: fields::user_id(wire.user_id.as_ref())?,
        })
    }
}
